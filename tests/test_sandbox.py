"""Sandboxed executions (gyre_hpc.sandbox): real bubblewrap, a real proxy, the real tool path.

From inside an execution's sandbox the run directory (its key-signing secret, its task files),
other workspaces, the runtime's processes and the network are out of reach; the workspace works
as it did. The command lines are pure functions, checked against golden files.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_golden, gyre
from loopback import Stack

from gyre_hpc.agents.dispatch import Dispatcher, make_harness
from gyre_hpc.agents.external import Endpoint
from gyre_hpc.agents.tools import MAIN_TOOLS, execute, parse_call
from gyre_hpc.agents.workspace import Workspace
from gyre_hpc.errors import GyreError
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.recipe.schema import AgentConfig, ScoringConfig, TasksConfig
from gyre_hpc.sandbox import apptainer, bwrap
from gyre_hpc.sandbox.confine import Sandbox, for_run
from gyre_hpc.sandbox.spec import Mount, Policy, ProxyReach, System, policy
from gyre_hpc.scoring import RunArtifacts, ScoringRunners, load_scorer
from gyre_hpc.tasks.data_order import DataOrder
from gyre_hpc.tasks.suites import find_task, load_suite
from gyre_hpc.tasks.task import Task

pytestmark = pytest.mark.bwrap


def run_tree(root: Path) -> dict[str, Path]:
    """A run directory as the runtime lays it out: secret, task files, two executions' workspaces."""
    run = root / "runs" / "smoke-20261201-120000"
    paths = {
        "run": run,
        "secret": run / "proxy.secret",
        "hidden": run / "tasks" / "calc" / "hidden" / "test_calc.py",
        "mine": run / "workspaces" / "step-0001" / "calc-0-g0",
        "other": run / "workspaces" / "step-0001" / "calc-0-g1",
        "suite": root / "suite.jsonl",
        "suite_tests": root / "suite-hidden" / "calc" / "test_calc.py",  # a JSONL's hidden tests
    }
    for key in ("secret", "hidden", "suite", "suite_tests"):
        paths[key].parent.mkdir(parents=True, exist_ok=True)
        paths[key].write_text(f"{key} contents\n")
    line = {"id": "calc", "spec": "suite contents", "hidden_tests": {"dir": "suite-hidden/calc"}}
    paths["suite"].write_text(json.dumps(line) + "\n")
    paths["secret"].chmod(0o600)
    paths["mine"].mkdir(parents=True)
    paths["other"].mkdir(parents=True)
    (paths["other"] / "solution.py").write_text("ANSWER = 42\n")
    return paths


def shell(ws: Workspace, command: str) -> str:
    """``command`` exactly as a model's ``run_shell`` tool call runs it; the tool's result text."""
    return execute(parse_call("run_shell", json.dumps({"command": command}), MAIN_TOOLS), ws, 20, None)


def sandbox_for(paths: dict[str, Path], scoring_binds: list[str] | None = None, **agent: object) -> Sandbox:
    config = AgentConfig(sandbox="bwrap", **agent)  # type: ignore[arg-type]
    return for_run(config, paths["run"], str(paths["suite"]), pytest.fail, scoring_binds=scoring_binds)


def test_an_execution_cannot_reach_the_run_other_workspaces_the_runtime_or_the_network(
    tmp_path: Path,
) -> None:
    paths = run_tree(tmp_path)
    box = sandbox_for(paths)
    box.prepare(paths["mine"])
    ws = Workspace(paths["mine"], box)
    run, me = paths["run"], os.getpid()  # this process plays the runtime (controller and proxy)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # a service on the host's loopback
        port = listener.getsockname()[1]
        refused = {
            "the proxy secret (relative)": "cat ../../../proxy.secret",
            "the proxy secret (absolute)": f"cat {paths['secret']}",
            "another workspace": f"cat ../calc-0-g1/solution.py; cat {paths['other']}/solution.py",
            "the task directory": f"ls {run}/tasks/calc/hidden",
            "the runtime's /proc": f"cat /proc/{me}/environ",
            "a signal to the runtime": f"kill -9 {me}",
            "writing the run directory": f"echo forged > {run}/proxy.secret",
            "writing the system": "echo x > /usr/gyre-x",
            "a host port": f"exec 3<>/dev/tcp/127.0.0.1/{port}",
        }
        results = {what: shell(ws, command) for what, command in refused.items()}
    for what, result in results.items():
        assert result.startswith("exit code ") and not result.startswith("exit code 0"), (what, result)
        assert "contents" not in result and "ANSWER" not in result, (what, result)
    assert paths["secret"].read_text() == "secret contents\n"
    assert not Path("/usr/gyre-x").exists()
    # What it does see of the host: only the system, no other process, a uid that is not root.
    assert shell(ws, f"ls {run}") == "exit code 0\nworkspaces\n"  # the way to its own workspace only
    assert shell(ws, "ls /proc | grep -c '^[0-9]'").split("\n")[1] in ("3", "4")  # bwrap, bash, ls, grep
    assert shell(ws, "id -u") != "exit code 0\n0\n"
    if os.getuid() == 0:  # in a user namespace made by root, "uid 65534" would still read this
        assert shell(ws, "cat /etc/shadow").startswith("exit code 1\ncat: /etc/shadow: Permission denied")


def test_the_workspace_works_as_before(tmp_path: Path) -> None:
    paths = run_tree(tmp_path)
    box = sandbox_for(paths)
    box.prepare(paths["mine"])
    ws = Workspace(paths["mine"], box)
    ws.write("pkg/calc.py", "def add(a, b):\n    return a + b\n")  # a file tool, then the shell edits it
    probe = f"/tmp/gyre-probe-{tmp_path.name}"  # a name nothing on the host holds
    script = (
        "sed -i 's/a + b/b + a/' pkg/calc.py && echo more > notes.txt && mkdir -p d && touch d/e && "
        'cd "$HOME" && python -c \'import sys; sys.path.insert(0, "pkg"); import calc; '
        "print(calc.add(2, 3))' "
        f"&& echo tmp > {probe} && cat {probe} && pwd"
    )
    assert shell(ws, script) == f"exit code 0\n5\ntmp\n{paths['mine']}\n"
    assert ws.read("pkg/calc.py") == "def add(a, b):\n    return b + a\n"
    assert sorted(p.name for p in paths["mine"].rglob("*")) == ["calc.py", "d", "e", "notes.txt", "pkg"]
    assert not Path(probe).exists()  # its /tmp is its own
    task = Task(id="t", spec="s", visible_tests={"test_v.py": "def test_v():\n    assert 1\n"})
    task.materialize(paths["mine"])
    box.prepare(paths["mine"])
    tested = execute(parse_call("run_tests", "{}", MAIN_TOOLS), ws, 60, task.test_command)
    assert tested.startswith("exit code 0") and "1 passed" in tested


def test_a_command_and_all_it_started_end_with_the_tool_call(tmp_path: Path) -> None:
    paths = run_tree(tmp_path)
    box = sandbox_for(paths)
    box.prepare(paths["mine"])
    ws = Workspace(paths["mine"], box)
    assert shell(ws, "sleep 311 > /dev/null 2>&1 & echo started") == "exit code 0\nstarted\n"
    left = subprocess.run(["pgrep", "-f", "sleep 311"], capture_output=True, text=True).stdout
    assert left == "", "a background process outlived its command"
    result = ws.run("sleep 312", timeout_s=0.5)
    assert result.timed_out
    assert subprocess.run(["pgrep", "-f", "sleep 312"], capture_output=True).returncode == 1


def test_a_bind_shows_its_directory_but_never_the_run_or_the_suite(tmp_path: Path) -> None:
    paths = run_tree(tmp_path)
    (tmp_path / "toolchain.txt").write_text("shared tool\n")
    tmp_path.chmod(0o755)  # what a bind shows, the sandbox's uid may read only as the host allows
    box = sandbox_for(paths, sandbox_binds=[str(tmp_path)])  # the whole tree, run directory included
    box.prepare(paths["mine"])
    ws = Workspace(paths["mine"], box)
    assert shell(ws, f"cat {tmp_path}/toolchain.txt") == "exit code 0\nshared tool\n"
    assert "suite contents" not in shell(ws, f"cat {paths['suite']}")
    assert shell(ws, f"ls {paths['suite_tests'].parent}") == "exit code 0\n"  # the suite's hidden tests
    assert shell(ws, f"ls {paths['run']}") == "exit code 0\nworkspaces\n"
    assert shell(ws, "echo y > y.txt && cat y.txt") == "exit code 0\ny\n"
    with pytest.raises(GyreError, match="is inside .*which a sandbox never shows"):
        Workspace(paths["mine"], sandbox_for(paths, sandbox_binds=[str(paths["run"] / "tasks")]))


def test_scoring_runs_the_policy_code_in_a_sandbox_of_its_own(tmp_path: Path) -> None:
    """Hidden tests import the agent's code: at scoring time it may not reach the run either."""
    paths = run_tree(tmp_path)
    box = sandbox_for(paths)
    hidden_dir = paths["hidden"].parent
    hidden_dir.joinpath("test_calc.py").write_text(
        "def test_add():\n    from calc import add\n    assert add(1, 2) == 3\n"
    )
    paths["mine"].joinpath("calc.py").write_text(
        "import pathlib\n"
        f"for p in [{str(paths['secret'])!r}, {str(paths['hidden'])!r}]:\n"
        "    try:\n"
        "        pathlib.Path(p).write_text('def test_add():\\n    pass\\n')  # forge the secret, the tests\n"
        "    except OSError:\n"
        "        pass\n"
        "def add(a, b):\n    return a - b\n"
    )
    task = {"hidden_tests": str(hidden_dir), "hidden_test_count": 1}
    scorer = load_scorer(ScoringConfig(scorer="hidden-tests"))
    assert scorer.score(RunArtifacts("r", paths["mine"], "finished", task, box)) == 0.0
    assert paths["secret"].read_text() == "secret contents\n"
    assert "a + b" not in paths["hidden"].read_text() and "pass" not in paths["hidden"].read_text()


def test_a_verifiers_own_files_are_shown_to_scoring_only(tmp_path: Path) -> None:
    """``scoring.sandbox_binds``: the verifier's script is there when it scores, never in a tool call,
    not even under a bind that shows its directory."""
    paths = run_tree(tmp_path)
    tmp_path.chmod(0o755)
    verifiers = tmp_path / "verifiers"
    verifiers.mkdir()
    (verifiers / "check.sh").write_text('test "$(cat answer.txt)" = 42 && echo 1.0 || echo 0.0\n')
    binds = [str(verifiers)]
    box = sandbox_for(paths, scoring_binds=binds, sandbox_binds=[str(tmp_path)])
    paths["mine"].joinpath("answer.txt").write_text("42\n")
    box.prepare(paths["mine"])
    assert shell(Workspace(paths["mine"], box), f"ls {verifiers}") == "exit code 0\n"
    task = {"verifier": f"bash {verifiers}/check.sh"}
    artifacts = RunArtifacts("r", paths["mine"], "finished", task, box)
    shown = ScoringRunners(ScoringConfig(scorer="verifier", sandbox_binds=binds))
    assert shown.get(None).score(artifacts).reward == 1.0
    assert ScoringRunners(ScoringConfig(scorer="verifier")).get(None).score(artifacts).reward == 0.0  # absent
    with pytest.raises(GyreError, match=r"^scoring.sandbox_binds: .*nope does not exist$"):
        ScoringRunners(ScoringConfig(scorer="verifier", sandbox_binds=[str(tmp_path / "nope")]))


def test_auto_falls_back_to_none_with_one_line_and_a_named_sandbox_is_required(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without bubblewrap
    warnings: list[str] = []
    box = Sandbox.from_config(AgentConfig(sandbox="auto"), (), warnings.append)
    assert box.kind == "none"
    assert warnings == [
        "agent.sandbox = auto: bwrap is not installed (Debian: apt-get install bubblewrap); "
        "executions run unconfined (agent.sandbox = none)"
    ]
    with pytest.raises(
        GyreError, match=r"^agent.sandbox = bwrap: bwrap is not installed .*agent.sandbox = none"
    ):
        Sandbox.from_config(AgentConfig(sandbox="bwrap"), (), warnings.append)
    with pytest.raises(GyreError, match=r"^agent.sandbox = apptainer: apptainer is not installed"):
        Sandbox.from_config(AgentConfig(sandbox="apptainer", sandbox_image="x.sif"), (), warnings.append)


# -- the command lines, golden ------------------------------------------------------------------

POLICY = Policy(
    workspace=Path("/scratch/runs/r-20261201/workspaces/step-0003/calc-0-g1"),
    readonly=(Path("/opt/toolchain"), Path("/scratch")),
    hidden=(Path("/scratch/runs/r-20261201"),),
    hidden_files=(Path("/scratch/suite.jsonl"),),
    uid=65534,
    proxy=ProxyReach(Path("/tmp/gyre-proxy-x/proxy.sock"), 8642),
)
SYSTEM = System(("/usr", "/etc", "/home/me/.venv"), (("/bin", "usr/bin"), ("/lib", "usr/lib")))


def golden(name: str, argv: list[str]) -> None:
    assert_golden(name, "\n".join(argv).replace(str(bwrap.RELAY), "{gyre_hpc}/sandbox/relay.py") + "\n")


@pytest.mark.parametrize("privileged", [True, False], ids=["root", "user"])
def test_the_bwrap_command_line_is_golden(privileged: bool) -> None:
    argv = bwrap.argv(POLICY, ["my-agent", "--task", "x"], SYSTEM, "/home/me/.venv/bin/python", privileged)
    golden(f"sandbox-bwrap-{'root' if privileged else 'user'}.txt", argv)


def test_a_python_under_tmp_is_bound_over_the_private_tmp() -> None:
    """A checkout in /tmp (CI's, say) holds the interpreter: the private /tmp must not cover it."""
    system = System(("/usr", "/tmp/ci/.venv"))
    argv = bwrap.argv(Policy(Path("/scratch/ws")), ["true"], system, "/tmp/ci/.venv/bin/python", True)
    assert argv.index("--tmpfs") < argv.index("/tmp/ci/.venv")


def test_the_apptainer_command_line_is_golden() -> None:
    plain = Policy(POLICY.workspace, readonly=(Path("/opt/toolchain"),), proxy=POLICY.proxy)
    golden("sandbox-apptainer.txt", apptainer.argv(plain, "/images/agent.sif", ["my-agent", "--task", "x"]))
    tool = Policy(POLICY.workspace)
    assert apptainer.argv(tool, "docker://python:3.11", ["bash", "-c", "ls"])[-4:] == [
        "docker://python:3.11", "bash", "-c", "ls",
    ]  # fmt: skip
    with pytest.raises(GyreError, match="cannot hide a path under a bind"):
        apptainer.argv(POLICY, "/images/agent.sif", ["x"])


HARBOR_POLICY = Policy(
    workspace=Path("/scratch/score/work-1"),
    uid=65534,
    workdir=Path("/app"),
    mounts=(
        Mount(Path("/scratch/score/inputs/tests"), Path("/tests")),
        Mount(Path("/scratch/score/logs"), Path("/logs/verifier"), writable=True),
    ),
)
"""A Harbor task's verifier: its workspace at /app, its tests at /tests, its log directory."""


def test_a_task_s_workdir_and_its_verifier_s_directories_are_golden() -> None:
    tests = ["bash", "/tests/test.sh"]
    golden("sandbox-bwrap-workdir.txt", bwrap.argv(HARBOR_POLICY, tests, SYSTEM, "py", True))
    golden("sandbox-apptainer-workdir.txt", apptainer.argv(HARBOR_POLICY, "/images/task.sif", tests))
    with pytest.raises(GyreError, match="outside usr, bin"):
        policy(Path("/scratch/ws"), uid=1, workdir=Path("/usr/app"))


# -- a command harness in the sandbox, through the real proxy ---------------------------------

PROBE = """\
import json, os, socket, sys, urllib.request
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "reached"
    except Exception as err:
        out[name] = type(err).__name__
attempt("secret", lambda: open(sys.argv[1]).read())
attempt("kill runtime", lambda: os.kill(int(sys.argv[2]), 0))
attempt("engine", lambda: socket.create_connection(("127.0.0.1", int(sys.argv[3])), timeout=2))
base = os.environ["OPENAI_BASE_URL"]
req = urllib.request.Request(
    base + "/chat/completions",
    data=json.dumps({"model": os.environ["GYRE_MODEL"], "max_tokens": 4,
                     "messages": [{"role": "user", "content": "hi"}]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
)
out["proxy"] = json.load(urllib.request.urlopen(req, timeout=60))["object"]
out["env"] = sorted(k for k in os.environ if not k.startswith(("GYRE_", "OPENAI_", "ANTHROPIC_")))
out["base"] = base
open("probe.json", "w").write(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def test_a_command_harness_runs_sandboxed_and_reaches_the_proxy_only(tiny: Path, tmp_path: Path) -> None:
    programs = tmp_path / "programs"
    programs.mkdir(mode=0o755)
    (programs / "probe.py").write_text(PROBE)  # its directory is shown to the sandbox, read-only
    task = Task(id="probe", spec="probe", scorer="milestones", milestones=[{"file_exists": "probe.json"}])

    async def go():  # noqa: ANN202
        async with Stack(tiny, tmp_path / "run") as stack:
            engine_port = stack.urls[0].rsplit(":", 1)[1]
            secret = tmp_path / "run" / "proxy.secret"
            assert secret.exists()
            argv = [sys.executable, str(programs / "probe.py"), str(secret), str(os.getpid()), engine_port]
            config = AgentConfig(kind="command", command=argv, sandbox="bwrap")
            box = for_run(config, tmp_path / "run", "smoke", lambda line: pytest.fail(line))
            endpoint = Endpoint(stack.proxy_url, stack.key, tiny.name, stack.proxy.usage)
            harness = make_harness(config, endpoint, {}, 0, tmp_path / "run" / "logs", box)
            scoring = ScoringRunners(ScoringConfig(scorer="milestones", max_retries=0))
            dispatcher = Dispatcher(
                harness,
                lambda t: scoring.get(t.scorer),
                tmp_path / "run" / "ws",
                tmp_path / "run" / "tasks",
                1,
            )
            (outcome,) = await dispatcher.run_all([("probe-1", task)])
            return outcome, int(stack.proxy_url.rsplit(":", 1)[1])

    outcome, proxy_port = asyncio.run(go())
    log = tmp_path / "run" / "logs" / "probe-1.log"
    assert outcome.execution.status == "finished", log.read_text() if log.exists() else outcome
    assert outcome.execution.calls == 1 and outcome.score.reward == 1.0  # the call went through, recorded
    probe = json.loads((tmp_path / "run" / "ws" / "probe-1" / "probe.json").read_text())
    assert probe["proxy"] == "chat.completion"
    assert probe["base"] == f"http://127.0.0.1:{proxy_port}/v1"
    assert probe["secret"] == "FileNotFoundError"
    assert probe["kill runtime"] == "ProcessLookupError"
    assert probe["engine"] in ("ConnectionRefusedError", "TimeoutError", "OSError")
    assert probe["env"] == ["HOME", "LANG", "PATH", "TMPDIR"] or set(probe["env"]) <= {
        "HOME", "LANG", "LC_ALL", "PATH", "TERM", "TMPDIR", "PWD", "SHLVL", "_", "LC_CTYPE",
    }  # fmt: skip


def test_a_program_inside_the_run_directory_is_refused(tmp_path: Path) -> None:
    paths = run_tree(tmp_path)
    planted = paths["run"] / "agent.py"
    planted.write_text("print(1)\n")
    config = AgentConfig(kind="command", command=[sys.executable, str(planted)], sandbox="bwrap")
    endpoint = Endpoint("http://127.0.0.1:9", lambda r, role: "k", "m")
    with pytest.raises(GyreError, match=f"agent.command names {planted}, inside {paths['run']}, which"):
        make_harness(config, endpoint, {}, 0, tmp_path / "logs", sandbox_for(paths))


# -- gyre-hpc sandbox exec ----------------------------------------------------------------------


def test_sandbox_exec_runs_one_command_as_a_tool_call_would(tmp_path: Path) -> None:
    paths = run_tree(tmp_path)
    ws = str(paths["mine"])
    ok = gyre("sandbox", "exec", "--workspace", ws, "--", "bash", "-c", "echo hi > f && cat f && id -u")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0] == "hi"
    refused = gyre("sandbox", "exec", "--workspace", ws, "--", "cat", "../../../proxy.secret")
    assert refused.returncode == 1 and "No such file or directory" in refused.stdout + refused.stderr
    bad = gyre("sandbox", "exec", "--workspace", str(tmp_path / "nope"), "--", "true")
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.root  # only root hands workspaces to another uid
def test_handing_a_workspace_to_the_sandbox_never_follows_its_links(tmp_path: Path) -> None:
    """Scoring hands over a workspace the policy wrote: a link in it must not give it the host."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f").write_text("y")
    (ws / "to-dir").symlink_to(outside)
    (ws / "to-file").symlink_to(outside / "precious")
    Sandbox("bwrap").prepare(ws)
    assert (ws / "d" / "f").stat().st_uid == 65534 and (ws / "to-dir").lstat().st_uid == 65534
    assert outside.stat().st_uid == 0 and (outside / "precious").stat().st_uid == 0


def test_a_python_agent_runs_its_commands_in_the_sandbox(tmp_path: Path) -> None:
    """A Python harness runs in the runtime; ``ctx.shell`` runs what it runs as ``run_shell`` does."""
    paths = run_tree(tmp_path)
    (tmp_path / "agent.py").write_text(
        "async def agent(ctx):\n"
        f"    r = await ctx.shell('id -u; cat {paths['secret']}')\n"
        "    return f'{r.exit_code}|{r.output}'\n"
    )
    config = AgentConfig(kind="python", entry=f"{tmp_path / 'agent.py'}:agent", sandbox="bwrap")
    box = sandbox_for(paths)
    harness = make_harness(
        config, Endpoint("http://127.0.0.1:9", lambda r, role: "k", "m"), {}, 0, tmp_path, box
    )
    box.prepare(paths["mine"])
    ex = asyncio.run(harness.run(Task(id="t", spec="s"), paths["mine"], "py-1"))
    code, output = ex.summary.split("|", 1)
    assert ex.status == "finished" and code == "1" and "No such file or directory" in output
    assert output.splitlines()[0] != "0" and "secret contents" not in output


def test_a_run_s_task_is_found_by_its_id_whichever_step_or_split_drew_it() -> None:
    """``sandbox exec|score --task`` on a run's workspace: the task of any step (its own seed) or
    of the held-out split is rebuilt from its id; an id no suite makes is one line."""
    tasks = TasksConfig(suite="smoke", prompts_per_step=4)
    drawn = [task for step in (1, 7) for _, task in DataOrder(tasks, seed=3).jobs(step)]
    drawn += load_suite("smoke", 2, seed=3, split="heldout")
    assert [find_task("smoke", 3, t.id) for t in drawn] == drawn
    with pytest.raises(GyreError, match="no such task in tasks.suite = 'smoke'; ids end with"):
        find_task("smoke", 3, "smoke-1-999999999")
