"""The task formats users bring: Harbor task directories and SWE-bench-style JSONL.

Reading them is pure (a malformed task is one line naming the file and the field); running them
is the real sandbox: every shipped example's reference solution earns 1.0 and an empty attempt
0, a Harbor task's workspace is at its workdir for the agent and its tests, and the attacks a
model would write into its workspace against each format's scoring rule earn nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, TEST_IMAGE, gyre
from test_forgery import FORCE_PASS  # what a model would paste to make every pytest report pass

from gyre_hpc.agents import reference
from gyre_hpc.agents.dispatch import Dispatcher, make_harness
from gyre_hpc.agents.external import Endpoint
from gyre_hpc.agents.workspace import Workspace
from gyre_hpc.errors import GyreError
from gyre_hpc.execution.outcome import ScoreResult
from gyre_hpc.recipe.schema import AgentConfig, ScoringConfig
from gyre_hpc.sandbox import untrusted
from gyre_hpc.sandbox.confine import Sandbox, for_run
from gyre_hpc.scoring import RunArtifacts, ScoringRunners
from gyre_hpc.scoring.contract import WorkspaceFault
from gyre_hpc.scoring.harbor import reward
from gyre_hpc.tasks import harbor, swe, swe_repo
from gyre_hpc.tasks.suites import load_suite, private_paths
from gyre_hpc.tasks.task import Task

HARBOR = REPO / "examples" / "harbor"
SWE = REPO / "examples" / "swe" / "instances.jsonl"


# --- reading (pure) -------------------------------------------------------------------------------


def test_a_harbor_dataset_reads_into_tasks_with_their_workdir_seed_and_limits() -> None:
    tasks = {t.id: t for t in load_suite(str(HARBOR), 0)}
    assert set(tasks) == {"fix-wordcount", "hello-file"}
    fix = tasks["fix-wordcount"]
    assert (fix.format, fix.scorer, fix.workdir, fix.timeout_s) == ("harbor", "harbor", "/app", 300.0)
    assert set(fix.seed) == {"wordcount.py"} and 'split(" ")' in fix.seed["wordcount.py"]
    assert fix.harbor["verifier_timeout_s"] == 120.0 and fix.harbor["memory_mb"] == 1024
    assert (
        tasks["hello-file"].harbor["memory_mb"] == 1024 and tasks["hello-file"].harbor["storage_mb"] == 1024
    )
    assert fix.harbor["solution"].endswith("fix-wordcount/solution") and fix.harbor["tests"].endswith("tests")
    assert "Fix it." in fix.spec  # instruction.md, as the agent reads it


def harbor_task(tmp_path: Path, toml: str = "", dockerfile: str = "", name: str = "t-1") -> Path:
    root = tmp_path / name
    (root / "tests").mkdir(parents=True)
    (root / "environment").mkdir()
    (root / "instruction.md").write_text("Do it.\n")
    (root / "task.toml").write_text(toml)
    (root / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (root / "environment" / "Dockerfile").write_text(dockerfile)
    (root / "environment" / "seed.txt").write_text("seed\n")
    return root


def test_a_dockerfile_gives_the_workdir_and_seed_and_what_it_cannot_do_is_noted(tmp_path: Path) -> None:
    root = harbor_task(
        tmp_path, '[environment]\ndocker_image = "org/img:1"\nmemory = "512M"\n',
        "FROM python:3.11\nWORKDIR /srv/work\nRUN apt-get install -y jq\nCOPY seed.txt data/\n"
        "COPY seed.txt /usr/local/share/seed.txt\n",
    )  # fmt: skip
    task, notes = harbor.read_task(root)
    assert task.workdir == "/srv/work" and task.seed == {"data/seed.txt": "seed\n"}
    assert task.harbor["image"] == "org/img:1" and task.harbor["memory_mb"] == 512
    assert len(notes) == 2 and "RUN is not run here" in notes[0] and "outside the workdir" in notes[1], notes
    assert all("org/img:1" in n for n in notes)


@pytest.mark.parametrize(
    ("toml", "dockerfile", "expected"),
    [
        (
            "[agent]\ntimeout = 5\n",
            "",
            "task.toml: unknown key agent.timeout; valid keys of [agent]: timeout_sec",
        ),
        ("[agent]\ntimeout_sec = -1\n", "", "agent.timeout_sec = -1: a positive number"),
        ('[environment]\nmemory = "lots"\n', "", "environment.memory = 'lots': a size such as \"4G\""),
        ("[environment]\nallow_internet = 1\n", "", "environment.allow_internet must be true or false"),
        ("[tools]\nx = 1\n", "", "task.toml: unknown key tools; valid:"),
        ("[agent\n", "", "task.toml: not TOML"),
        ("", "WORKDIR /etc/app\n", "WORKDIR = '/etc/app': not under /etc"),
        ("", "COPY ../../secret /app/\n", "is not a file of the build context"),
    ],
)
def test_a_malformed_harbor_task_is_one_line_naming_the_file_and_field(
    tmp_path: Path, toml: str, dockerfile: str, expected: str
) -> None:
    root = harbor_task(tmp_path, toml, dockerfile)
    with pytest.raises(GyreError) as err:
        harbor.read_task(root)
    assert expected in str(err.value) and "\n" not in str(err.value), err.value


def test_a_harbor_task_without_tests_or_instruction_is_refused(tmp_path: Path) -> None:
    root = harbor_task(tmp_path)
    (root / "instruction.md").write_text("  \n")
    with pytest.raises(GyreError, match="instruction.md: empty"):
        harbor.read_task(root)
    (root / "instruction.md").write_text("x")
    (root / "tests" / "test.sh").unlink()
    with pytest.raises(GyreError, match="test.sh: missing"):
        harbor.read_task(root)
    with pytest.raises(GyreError, match="no task.toml"):
        harbor.load_dir(tmp_path / "t-1" / "tests")


def swe_record(**changes: object) -> dict:
    record = json.loads(SWE.read_text().splitlines()[0])
    return {**record, **changes}


def test_a_swe_instance_reads_with_its_lists_given_as_json_strings_or_lists() -> None:
    (task,) = load_suite(str(SWE), 0)
    assert (task.id, task.format, task.scorer) == ("minicalc-1", "swe", "swe")
    assert task.swe["fail_to_pass"] == [
        "tests/test_ops.py::test_divide_is_true_division", "tests/test_ops.py::test_mean",
    ]  # fmt: skip
    again = swe.task_from_record(swe_record(PASS_TO_PASS=["tests/test_ops.py::test_add"]), SWE.parent, "x")
    assert again.swe["pass_to_pass"] == ["tests/test_ops.py::test_add"]
    assert swe_repo.touched(task.swe["test_patch"]) == ["tests/test_ops.py"]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"repository": "x"}, "unknown key repository; valid keys of an instance: instance_id"),
        ({"FAIL_TO_PASS": "[]"}, "FAIL_TO_PASS is empty"),
        ({"FAIL_TO_PASS": "tests/a.py::t"}, "FAIL_TO_PASS: not a list of test ids"),
        ({"PASS_TO_PASS": ["../../etc/x.py::t"]}, "leaves the repository"),
        ({"repo": "repos/nowhere"}, "repo 'repos/nowhere' is neither a git repository nor a directory"),
        ({"test_patch": "rm -rf /"}, "test_patch is not a unified diff"),
        ({"instance_id": "a/b"}, "instance_id 'a/b' is not valid"),
        ({"problem_statement": ""}, "problem_statement must be a non-empty string"),
    ],
)
def test_a_malformed_swe_instance_is_one_line_naming_the_line_and_field(
    tmp_path: Path, changes: dict, expected: str
) -> None:
    shutil.copytree(SWE.parent / "repos", tmp_path / "repos")
    path = tmp_path / "instances.jsonl"
    path.write_text(json.dumps(swe_record(**changes)) + "\n")
    with pytest.raises(GyreError) as err:
        load_suite(str(path), 0)
    assert str(err.value).startswith(f"{path}:1: ") and expected in str(err.value), err.value


def test_tasks_check_says_ok_or_names_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    ok = gyre("tasks", "check", str(HARBOR))
    assert ok.returncode == 0 and "ok  fix-wordcount  (harbor, scored by harbor)" in ok.stdout, ok.stderr
    assert "note: no [environment] docker_image" in ok.stdout
    assert gyre("tasks", "check", str(SWE)).returncode == 0
    root = harbor_task(tmp_path, "[verifier]\ntimeout_sec = 'soon'\n")
    bad = gyre("tasks", "check", str(root))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr  # a user error: exit 2
    assert "verifier.timeout_sec = 'soon': a positive number" in bad.stderr


def test_what_a_format_keeps_from_the_agent_is_hidden_from_every_execution(tmp_path: Path) -> None:
    assert private_paths(str(HARBOR)) == [HARBOR.resolve()]  # tests and solutions with it
    hidden = private_paths(str(SWE))
    assert hidden == [SWE.resolve(), (SWE.parent / "repos" / "minicalc").resolve()]


def test_a_harbor_reward_is_one_number_in_range_and_never_a_link_a_fifo_or_two_that_disagree(
    tmp_path: Path,
) -> None:
    def read(files: dict[str, str]) -> float:
        logs = tmp_path / f"logs-{len(list(tmp_path.iterdir()))}"
        logs.mkdir()
        for name, text in files.items():
            (logs / name).write_text(text)
        return reward(logs, "exit code 0")

    assert read({"reward.txt": "0.75\n"}) == 0.75
    assert read({"reward.json": '{"reward": 1, "quality": 0.2}'}) == 1.0
    assert read({"reward.json": '{"accuracy": 0.5}'}) == 0.5
    assert read({"reward.json": '{"reward": 0.5}', "reward.txt": "0.5"}) == 0.5
    for files, why in [
        ({}, "wrote no reward"),
        ({"reward.txt": "1e9"}, "not a reward in [0, 1]"),
        ({"reward.txt": "nan"}, "not a reward in [0, 1]"),
        ({"reward.txt": "-0.5"}, "not a reward in [0, 1]"),
        ({"reward.txt": "passed"}, "not a number"),
        ({"reward.json": '{"reward": true}'}, "not a reward"),
        ({"reward.json": "[1]"}, 'must hold {"reward": x}'),
        ({"reward.json": '{"reward": 1}', "reward.txt": "0"}, "disagree"),
        ({"reward.txt": "1" + " " * (64 << 10)}, "is over"),
    ]:
        with pytest.raises(WorkspaceFault, match=why.replace("[", r"\[").replace("{", r"\{")):
            read(files)
    logs = tmp_path / "special"
    logs.mkdir()
    os.mkfifo(logs / "reward.txt")  # a FIFO no one writes: read, it would hang the runtime
    with pytest.raises(WorkspaceFault, match="not a regular file"):
        reward(logs, "")
    (logs / "reward.txt").unlink()
    (tmp_path / "one").write_text("1")
    (logs / "reward.txt").symlink_to(tmp_path / "one")
    with pytest.raises(WorkspaceFault, match="not a regular file"):
        reward(logs, "")


# --- running (the real sandbox) -------------------------------------------------------------------


def box(tmp_path: Path, suite: Path) -> Sandbox:
    tmp_path.chmod(0o755)
    return for_run(AgentConfig(sandbox="bwrap"), None, str(suite), pytest.fail)


def score(task: Task, workspace: Path, sandbox: Sandbox, tmp_path: Path, **config: object) -> ScoreResult:
    runners = ScoringRunners(ScoringConfig(max_retries=1, **config))  # type: ignore[arg-type]
    task_dir = tmp_path / "task-dir"
    task_dir.mkdir(exist_ok=True)
    sandbox.prepare(workspace)
    artifacts = RunArtifacts("r-1", workspace, "finished", task.for_scorer(task_dir), sandbox.for_task(task))
    return runners.get(task.scorer).score(artifacts)


def attempt(task: Task, tmp_path: Path, sandbox: Sandbox, name: str, solve: bool = False) -> Path:
    ws = tmp_path / name
    task.materialize(ws)
    sandbox.for_task(task).seed(ws)
    sandbox.prepare(ws)
    if solve:
        assert reference.apply(task, ws, sandbox, 60) is None
    return ws


@pytest.mark.bwrap
@pytest.mark.parametrize("suite", [HARBOR, SWE], ids=["harbor", "swe"])
def test_every_shipped_task_s_reference_earns_1_and_an_empty_attempt_0(suite: Path) -> None:
    out = gyre("tasks", "verify", str(suite))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if "│" in line and "task" not in line]
    assert rows and all("1.000" in r and "0.000" in r and "ok" in r for r in rows), out.stdout
    assert len(rows) == len(load_suite(str(suite), 0))


@pytest.mark.bwrap
def test_a_harbor_task_s_commands_see_the_workspace_at_its_workdir(tmp_path: Path) -> None:
    task = {t.id: t for t in load_suite(str(HARBOR), 0)}["fix-wordcount"]
    sandbox = box(tmp_path, HARBOR)
    ws = attempt(task, tmp_path, sandbox, "ws")
    out = Workspace(ws, sandbox.for_task(task)).run("pwd; echo $HOME; ls /app; touch /app/made", 30)
    assert out.exit_code == 0 and out.output.split() == ["/app", "/app", "wordcount.py"], out.output
    assert (ws / "made").exists()
    assert not Workspace(ws, sandbox.for_task(task)).run(f"ls {HARBOR}", 30).exit_code == 0  # hidden


WORDCOUNT_ATTACKS = {
    # each: files the model writes into /app, on top of its wrong (unchanged) wordcount.py
    "planted reward file": {"logs/verifier/reward.txt": "1\n", "reward.txt": "1\n"},
    "conftest forcing passes": {
        "conftest.py": (
            "import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    out = yield\n    out.get_result().outcome = 'passed'\n"
        )
    },
    "pytest.py shadowing pytest": {
        "pytest.py": (  # the JUnit report the tests' reward is read from
            "open('/logs/verifier/junit.xml', 'w').write('<testsuites><testsuite tests=\"3\" failures=\"0\" "
            'errors="0" skipped="0"/></testsuites>\')\n'
        )
    },
    "reward written at import": {
        "wordcount.py": (
            "open('/logs/verifier/reward.txt', 'w').write('1')\n"
            "open('/logs/verifier/reward.json', 'w').write('{\"reward\": 1}')\n"
            "def count_words(text):\n    return len(text.split(' '))\n"
        )
    },
    "reward made a link at import": {
        "wordcount.py": (
            "import os\nopen('/app/one', 'w').write('1')\n"
            "os.symlink('/app/one', '/logs/verifier/reward.txt')\n"
            "def count_words(text):\n    return len(text.split(' '))\n"
        )
    },
    # a process of the tested code that outlives its check and rewrites the reward after test.sh's write
    "a daemon rewriting the reward": {
        "wordcount.py": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    for _ in range(3000):\n"
            "        try:\n            open('/logs/verifier/reward.txt', 'w').write('1')\n"
            "        except OSError:\n            pass\n        time.sleep(0.005)\n    os._exit(0)\n"
            "def count_words(text):\n    return len(text.split(' '))\n"
        )
    },
    # a reward of its own, read-only, so that test.sh's final write cannot replace it
    "a read-only reward made first": {
        "wordcount.py": (
            "import os\np = '/logs/verifier/reward.txt'\nif not os.path.exists(p):\n"
            "    open(p, 'w').write('1')\n    os.chmod(p, 0o444)\n"
            "def count_words(text):\n    return len(text.split(' '))\n"
        )
    },
    # the tested code ends its checker with status 0 at import
    "exit 0 at import": {"wordcount.py": "import os\nos._exit(0)\n"},
}


@pytest.mark.bwrap
@pytest.mark.parametrize("attack", list(WORDCOUNT_ATTACKS))
def test_a_harbor_forgery_earns_nothing(tmp_path: Path, attack: str) -> None:
    task = {t.id: t for t in load_suite(str(HARBOR), 0)}["fix-wordcount"]
    sandbox = box(tmp_path, HARBOR)
    ws = attempt(task, tmp_path, sandbox, "ws")
    for rel, text in WORDCOUNT_ATTACKS[attack].items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    result = score(task, ws, sandbox, tmp_path)
    assert result.kind == "scored" and result.reward == 0.0, result


def swe_git_suite(tmp_path: Path) -> Path:
    """The example instance over a real git repository: the base commit, then the fix on top."""
    repo = tmp_path / "suite" / "repos" / "minicalc"
    shutil.copytree(SWE.parent / "repos" / "minicalc", repo)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    base = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    (repo / "minicalc" / "ops.py").write_text((repo / "minicalc" / "ops.py").read_text().replace("//", "/"))
    subprocess.run([*git, "commit", "-qam", "the fix"], check=True)
    path = tmp_path / "suite" / "instances.jsonl"
    path.write_text(json.dumps(swe_record(base_commit=base)) + "\n")
    return path


@pytest.mark.bwrap
def test_a_swe_workspace_holds_the_base_tree_and_none_of_the_history_that_has_the_fix(tmp_path: Path) -> None:
    suite = swe_git_suite(tmp_path)
    (task,) = load_suite(str(suite), 0)
    sandbox = box(tmp_path, suite)
    ws = attempt(task, tmp_path, sandbox, "ws")
    assert "a // b" in (ws / "minicalc" / "ops.py").read_text()
    log = Workspace(ws, sandbox).run(
        "git log --all --oneline | wc -l; git grep -c 'a / b' $(git rev-list --all)", 30
    )
    assert log.output.split()[0] == "1", log.output  # one commit: the base; the fix is nowhere
    assert not Workspace(ws, sandbox).run(f"ls {suite.parent / 'repos'}", 30).exit_code == 0  # hidden
    assert score(task, ws, sandbox, tmp_path).reward == 0.0
    solved = attempt(task, tmp_path, sandbox, "solved", solve=True)
    assert score(task, solved, sandbox, tmp_path).reward == 1.0


SWE_ATTACKS = {
    "the deciding tests rewritten": {
        "tests/test_ops.py": (
            "def test_add():\n    pass\n\ndef test_divide_is_true_division():\n    pass\n\n"
            "def test_mean(numbers):\n    pass\n"
        )
    },
    "a conftest forcing passes": {
        "conftest.py": (
            "import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    out = yield\n    out.get_result().outcome = 'passed'\n"
        )
    },
    "the repository's conftest changed": {
        "tests/conftest.py": (
            "import sys\nfrom pathlib import Path\nimport pytest\n"
            "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))\n"
            "@pytest.fixture\ndef numbers():\n    return [1, 2, 3, 4]\n"
            "@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    out = yield\n    out.get_result().outcome = 'passed'\n"
        )
    },
    "a pytest.py at the root": {"pytest.py": "import sys\nprint('3 passed')\nsys.exit(0)\n"},
}


@pytest.mark.bwrap
@pytest.mark.parametrize("attack", [*SWE_ATTACKS, "the runner patched at import", "tests made a link"])
def test_a_swe_forgery_earns_nothing(tmp_path: Path, attack: str) -> None:
    (task,) = load_suite(str(SWE), 0)
    sandbox = box(tmp_path, SWE)
    ws = attempt(task, tmp_path, sandbox, "ws")
    if attack == "the runner patched at import":  # caught by the canary, a test that must fail
        init = ws / "minicalc" / "__init__.py"
        init.write_text(FORCE_PASS + init.read_text())
    elif attack == "tests made a link":  # the restored test file would be written through it
        outside = tmp_path / "outside"
        outside.mkdir()
        untrusted.remove(ws / "tests")
        (ws / "tests").symlink_to(outside)
    for rel, text in SWE_ATTACKS.get(attack, {}).items():
        (ws / rel).write_text(text)
    result = score(task, ws, sandbox, tmp_path)
    assert result.kind == "scored" and result.reward == 0.0, result
    if attack == "tests made a link":
        assert list(outside.iterdir()) == []  # nothing written through it


@pytest.mark.bwrap
def test_the_dispatcher_runs_each_format_s_tasks_where_they_say_and_scores_them_by_their_rules(
    tmp_path: Path,
) -> None:
    """A black-box agent program (``agent.kind = command``) solves a Harbor task at /app and a SWE
    instance in its repository, as an agent would: the runtime seeds, confines and scores them."""
    solve = (
        'case "$(pwd)" in /app) printf "Hello, world!\\n" > hello.txt; pwd > where.txt ;; '
        '*) sed -i "s|a // b|a / b|" minicalc/ops.py ;; esac'
    )
    run = tmp_path / "run"
    run.mkdir()
    tmp_path.chmod(0o755)
    config = AgentConfig(kind="command", command=["bash", "-c", solve], sandbox="bwrap")
    box = for_run(config, run, str(HARBOR), pytest.fail)
    never_called = Endpoint("http://127.0.0.1:59999", lambda r, role: "k", "m")  # the program calls no model
    harness = make_harness(config, never_called, {}, 0, run, box)
    runners = ScoringRunners(ScoringConfig(max_retries=0, timeout_s=60))
    dispatcher = Dispatcher(harness, lambda t: runners.get(t.scorer), run / "ws", run / "tasks", 2)
    hello = {t.id: t for t in load_suite(str(HARBOR), 0)}["hello-file"]
    (minicalc,) = load_suite(str(SWE), 0)
    outcomes = asyncio.run(dispatcher.run_all([("r-harbor", hello), ("r-swe", minicalc)]))
    got = {o.execution.task_id: (o.execution.status, o.score.kind, o.score.reward) for o in outcomes}
    solved = ("finished", "scored", 1.0)
    assert got == {"hello-file": solved, "minicalc-1": solved}, outcomes
    assert (run / "ws" / "r-harbor" / "where.txt").read_text() == "/app\n"


# --- a task in its own image ----------------------------------------------------------------------

TREE_TEST = (
    "#!/bin/bash\n# passes only where tree is installed: the task's image, not the host\n"
    "if tree --version >/dev/null 2>&1; then r=1; else r=0; fi\necho $r > /logs/verifier/reward.txt\n"
)


@pytest.mark.image
def test_a_task_whose_tests_need_a_tool_of_its_image_passes_only_in_its_image(tmp_path: Path) -> None:
    assert shutil.which("tree") is None, "the host has tree: this test would show nothing"
    with_image = harbor_task(tmp_path, f'[environment]\ndocker_image = "{TEST_IMAGE}"\n', name="in-image")
    without = harbor_task(tmp_path, "", name="on-host")
    for root in (with_image, without):
        (root / "tests" / "test.sh").write_text(TREE_TEST)
    sandbox = box(tmp_path, tmp_path)
    rewards = {}
    for root in (with_image, without):
        task, _ = harbor.read_task(root)
        ws = attempt(task, tmp_path, sandbox, f"ws-{task.id}")
        rewards[task.id] = score(task, ws, sandbox, tmp_path).reward
    assert rewards == {"in-image": 1.0, "on-host": 0.0}, rewards
    # the agent's own commands run in the image too, with the workspace at the workdir
    task, _ = harbor.read_task(with_image)
    out = Workspace(tmp_path / "ws-in-image", sandbox.for_task(task)).run(
        "cat /etc/debian_version; tree --version | cut -d' ' -f1-2; pwd; ls / | grep -c work || true", 30
    )
    assert out.exit_code == 0 and out.output.split()[1:4] == ["tree", "v2.1.0", "/app"], out.output
    assert out.output.split()[4] == "0", out.output  # nothing of the host's /work: only the image


def test_an_image_s_files_at_the_workdir_seed_the_workspace_and_a_tarball_unpacks_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr" / "bin").mkdir(parents=True)
    (rootfs / "app" / "src").mkdir(parents=True)
    (rootfs / "app" / "src" / "main.c").write_text("int main(void) { return 1; }\n")
    (rootfs / "app" / "keep.txt").write_text("from the image\n")
    tarball = tmp_path / "rootfs.tar.gz"
    subprocess.run(["tar", "-czf", str(tarball), "-C", str(rootfs), "."], check=True)
    monkeypatch.setenv("GYRE_IMAGE_CACHE", str(tmp_path / "cache"))
    sandbox = Sandbox("bwrap")
    task = Task(id="t", spec="s", workdir="/app", image=str(tarball))
    boxed = sandbox.for_task(task)
    root = boxed.rooted
    assert (
        root is not None and root.is_relative_to(tmp_path / "cache") and (root / "app" / "keep.txt").exists()
    )
    mtime = root.stat().st_mtime_ns
    assert Sandbox("bwrap").for_task(task).rooted == root and root.stat().st_mtime_ns == mtime  # once
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "keep.txt").write_text("the task's own seed wins\n")
    boxed.seed(ws)
    assert (ws / "src" / "main.c").exists() and (ws / "keep.txt").read_text() == "the task's own seed wins\n"


@pytest.mark.parametrize(
    ("kind", "image", "expected"),
    [
        ("bwrap", "python:3.11-slim", "nothing is pulled here: export it to a tarball"),
        ("bwrap", "docker://python:3.11-slim", "this one needs agent.sandbox = apptainer"),
        ("none", "/srv/rootfs", "needs agent.sandbox = bwrap"),
    ],
)
def test_an_image_a_sandbox_cannot_run_is_one_line_saying_what_would(
    kind: str, image: str, expected: str
) -> None:
    with pytest.raises(GyreError) as err:
        Sandbox(kind).for_task(Task(id="t", spec="s", image=image))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_under_apptainer_a_task_s_image_is_the_one_it_runs(tmp_path: Path) -> None:
    task = Task(id="t", spec="s", workdir="/testbed", image="docker://swebench/sweb.eval.x86_64.calc:v1")
    boxed = Sandbox("apptainer", image="/images/default.sif").for_task(task)
    with boxed.group("t") as group:
        launch = boxed.launch(tmp_path, ["bash", "-c", "ls"], {"PATH": "/usr/bin"}, group=group, cpu_s=5)
    argv = launch.argv[launch.argv.index("apptainer") :]
    assert argv[argv.index("--home") + 1] == f"{tmp_path.resolve()}:/testbed" and "--pwd" in argv
    assert argv[-4:] == ["docker://swebench/sweb.eval.x86_64.calc:v1", "bash", "-c", "ls"], argv
