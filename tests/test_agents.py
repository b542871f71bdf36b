"""The harness and its tools: limits, confinement, malformed calls, timeouts, placeholders."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp import web
from loopback import Stack

from gyre_hpc.agents.dispatch import Dispatcher, artifacts
from gyre_hpc.agents.harness import Harness
from gyre_hpc.agents.tools import MAIN_TOOLS, execute, parse_call
from gyre_hpc.agents.workspace import ToolError, Workspace
from gyre_hpc.errors import GyreError
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.models.tokenizer import ChatTokenizer
from gyre_hpc.recipe.schema import AgentConfig, ScoringConfig
from gyre_hpc.sandbox.confine import FILE_SIZE_BYTES, Sandbox
from gyre_hpc.sandbox.limits import Groups, Limits
from gyre_hpc.scoring import RunArtifacts, ScoringRunner, load_scorer
from gyre_hpc.scoring.builtin import ReplyScorer
from gyre_hpc.scoring.runner import ScoringRunners
from gyre_hpc.tasks.jsonl import load_jsonl, write_jsonl
from gyre_hpc.tasks.suites import load_suite, repo_mini
from gyre_hpc.tasks.task import Task, task_from_json
from gyre_hpc.trajectory.codec import read_records


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def test_a_runaway_command_is_killed_at_its_timeout(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    started = time.monotonic()
    result = ws.run("sleep 30 & sleep 30; echo never", timeout_s=1)
    assert result.timed_out and time.monotonic() - started < 5
    assert "never" not in result.output
    out = execute(parse_call("run_shell", json.dumps({"command": "sleep 30"}), MAIN_TOOLS), ws, 1, None)
    assert out.startswith("timed out after 1 s (killed)")


@pytest.mark.parametrize("kind", ["none", pytest.param("bwrap", marks=pytest.mark.bwrap)])
def test_a_command_runs_under_its_cpu_memory_and_file_size_limits(kind: str, tmp_path: Path) -> None:
    box = Sandbox(kind, groups=Groups("none", Limits(memory_bytes=1 << 30)))
    box.prepare(tmp_path)
    ws = Workspace(tmp_path, box)
    shown = ws.run("cat /proc/self/limits", timeout_s=7)
    rows = {line[:26].strip(): line[26:].split()[:2] for line in shown.output.splitlines()[1:]}
    assert rows["Max cpu time"] == ["8", "8"], shown.output  # soft and hard: the timeout + 1 s
    assert rows["Max address space"] == [str(1 << 30)] * 2
    assert rows["Max file size"] == [str(FILE_SIZE_BYTES)] * 2
    big = ws.run("head -c 65M /dev/zero > big", timeout_s=20)
    assert big.exit_code != 0 and (tmp_path / "big").stat().st_size == FILE_SIZE_BYTES


def test_writing_outside_the_workspace_is_refused(tmp_path: Path) -> None:
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "escape").symlink_to(tmp_path)
    ws = Workspace(ws_dir)
    for path in ("../x.txt", "/etc/gyre-x", "escape/x.txt", "a/../../x.txt"):
        with pytest.raises(ToolError, match="outside the workspace"):
            execute(
                parse_call("write_file", json.dumps({"path": path, "content": "x"}), MAIN_TOOLS), ws, 5, None
            )
    assert not (tmp_path / "x.txt").exists()
    assert (
        execute(
            parse_call("write_file", json.dumps({"path": "a/b.txt", "content": "hi"}), MAIN_TOOLS),
            ws,
            5,
            None,
        )
        == "wrote 2 bytes to a/b.txt"
    )
    assert ws.read("a/b.txt") == "hi"


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("rm_rf", "{}", "unknown tool 'rm_rf'; valid tools: read_file, write_file"),
        ("write_file", '{"path": "a.txt", "content": ', "arguments of write_file are not valid JSON"),
        ("write_file", '["a.txt"]', "arguments of write_file must be a JSON object"),
        ("write_file", '{"path": "a.txt"}', "write_file takes {path: string, content: string}"),
        ("read_file", '{"path": 3}', "read_file takes {path: string}"),
        ("delegate", '{"task": "x"}', "unknown tool 'delegate'"),  # a sub-agent cannot delegate
    ],
)
def test_malformed_tool_calls_become_tool_errors(name: str, arguments: str, message: str) -> None:
    allowed = [t for t in MAIN_TOOLS if t != "delegate"] if name == "delegate" else MAIN_TOOLS
    with pytest.raises(ToolError, match=message.replace("{", r"\{").replace("(", r"\(")):
        parse_call(name, arguments, allowed)


def test_the_harness_survives_a_random_policy(tiny: Path, tmp_path: Path) -> None:
    """An untrained model emits anything: every call becomes a nudge or a tool error, never a crash."""

    async def go():  # noqa: ANN202
        async with Stack(tiny, tmp_path / "run") as stack:
            harness = Harness(
                stack.url + "/v1",
                stack.key,
                AgentConfig(max_calls=4, timeout_s=60),
                {"max_tokens": 24},
            )
            task = repo_mini(1, seed=0)[0]
            task.materialize(tmp_path / "ws")
            return await harness.run(task, tmp_path / "ws", "random-1")

    ex = asyncio.run(go())
    assert ex.status == "finished" and ex.calls == 4 and ex.summary == "stopped: model-call budget spent"
    assert ex.tokens > 4 * 500  # the system prompt with tools alone is ~1000 tokens per call


def test_a_timed_out_execution_gets_partial_credit(tiny: Path, tmp_path: Path) -> None:
    task = Task(
        id="calc",
        spec="Implement add and sub in calc.py.",
        scorer="hidden-tests",
        seed={"calc.py": "def add(a, b):\n    return a + b\n"},  # half done when time runs out
        hidden_tests={
            "test_calc.py": "def test_add():\n    from calc import add\n    assert add(1, 2) == 3\n\n"
            "def test_sub():\n    from calc import sub\n    assert sub(3, 1) == 2\n"
        },
        hidden_test_count=2,
    )

    async def go():  # noqa: ANN202
        async with Stack(tiny, tmp_path / "run") as stack:
            harness = Harness(
                stack.url + "/v1",
                stack.key,
                AgentConfig(max_calls=1000, timeout_s=1.5),
                {"max_tokens": 16},
            )
            scoring = ScoringRunner(load_scorer(ScoringConfig(scorer="hidden-tests")), max_retries=1)
            dispatcher = Dispatcher(harness, lambda t: scoring, tmp_path / "ws", tmp_path / "tasks", 2)
            return await dispatcher.run_all([("slow-1", task)])

    (outcome,) = asyncio.run(go())
    assert outcome.execution.status == "timed_out"
    assert (outcome.score.kind, outcome.score.reward) == ("partial", 0.5)


def test_a_call_made_while_the_proxy_is_down_is_made_again_once_it_is_back(
    tiny: Path, tmp_path: Path
) -> None:
    """The proxy's port resets every connection (its process died) until the harness has tried
    three times; then the proxy listens there again. The call goes through: the execution runs to
    its end instead of crashing, and each call is recorded once."""

    async def go():  # noqa: ANN202
        async with Stack(tiny, tmp_path / "run") as stack:
            proxy = stack.runners[-1]
            port = proxy.addresses[0][1]
            for site in list(proxy.sites):
                await site.stop()
            tried, three = [0], asyncio.Event()

            def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                tried[0] += 1
                writer.transport.abort()
                if tried[0] >= 3:
                    three.set()

            dead = await asyncio.start_server(reset, "127.0.0.1", port)
            config = AgentConfig(max_calls=2, timeout_s=120)
            harness = Harness(stack.url + "/v1", stack.key, config, {"max_tokens": 8})
            task = repo_mini(1, seed=0)[0]
            task.materialize(tmp_path / "ws")
            run = asyncio.create_task(harness.run(task, tmp_path / "ws", "back-1"))
            await three.wait()
            dead.close()
            await dead.wait_closed()
            await web.TCPSite(proxy, "127.0.0.1", port).start()
            return await run, tried[0]

    ex, tried = asyncio.run(go())
    assert tried >= 3 and ex.status == "finished" and ex.calls == 2, ex.error
    assert len(read_records(tmp_path / "run" / "tito.bin").records) == 2


def test_a_question_is_one_reply_without_tools_scored_on_its_last_words(tiny: Path, tmp_path: Path) -> None:
    """A task with ``answers`` is asked once, with no tools and no system prompt of ours (the
    model's template brings its own); the reply is scored by the reply scorer."""
    task = load_suite("plural", 1)[0]
    assert task.scorer == "reply" and task.answers

    async def go():  # noqa: ANN202
        async with Stack(tiny, tmp_path / "run") as stack:
            harness = Harness(
                stack.url + "/v1", stack.key, AgentConfig(max_calls=4, timeout_s=60), {"max_tokens": 8}
            )
            runners = ScoringRunners(ScoringConfig(scorer="milestones"))  # the recipe's, as the runtime's
            dispatcher = Dispatcher(
                harness, lambda t: runners.get(t.scorer), tmp_path / "ws", tmp_path / "tasks", 1
            )
            return await dispatcher.run_all([("question-1", task)])

    (outcome,) = asyncio.run(go())
    ex = outcome.execution
    assert (ex.status, ex.calls, ex.tool_calls) == ("finished", 1, 0)
    (record,) = read_records(tmp_path / "run" / "tito.bin").records
    prompt = ChatTokenizer(tiny).decode(record.new_ids.tolist())  # the first record shares nothing
    assert task.spec in prompt and "<tools>" not in prompt and "software agent" not in prompt
    reply = ReplyScorer(ScoringConfig()).score(artifacts(ex, task, tmp_path / "tasks"))
    # the task's own scorer, not the recipe's (which would fail it: no milestones)
    assert (outcome.score.kind, outcome.score.reward) == ("scored", reply)


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("Geese", 1.0),
        ("The plural of goose is geese.", 1.0),
        ('The answer is "GEESE"!', 1.0),
        ("geese, not gooses", 1 / 3),  # the answer, but not as its last word
        ("gooses", 0.0),
        ("", 0.0),
        ("geese " + "goose " * 100_000, 0.0),  # past what is read: the answer among too many words
        ("mice sheep oxen cacti children", 0.0),  # listing candidates: only the last counts in full
    ],
)
def test_the_reply_scorer_counts_the_answer_in_full_only_as_the_last_words(reply: str, reward: float) -> None:
    task = {"answers": ["geese"]}
    got = ReplyScorer(ScoringConfig()).score(
        RunArtifacts("r", Path("/nonexistent"), "finished", task, reply=reply)
    )
    assert got == pytest.approx(reward, abs=1e-4)


def test_answers_must_be_non_empty_strings_and_choose_the_reply_scorer(tmp_path: Path) -> None:
    task = task_from_json({"id": "q", "spec": "One goose, two what?", "answers": ["geese"]}, tmp_path, "t:1")
    assert (task.scorer, task.answers, task.to_json()["answers"]) == ("reply", ["geese"], ["geese"])
    for bad in ("geese", [""], [3]):
        with pytest.raises(GyreError, match="t:1: answers must be a list of non-empty strings"):
            task_from_json({"id": "q", "spec": "?", "answers": bad}, tmp_path, "t:1")


def test_an_infrastructure_failure_yields_a_placeholder(tmp_path: Path) -> None:
    config = AgentConfig(timeout_s=10, unreachable_s=0.5)
    harness = Harness("http://127.0.0.1:9/v1", lambda run, role: "gy-x.y", config)
    task = load_suite("smoke", 1)[0]
    task.materialize(tmp_path / "ws")
    ex = asyncio.run(harness.run(task, tmp_path / "ws", "down-1"))
    assert ex.status == "crashed" and ex.calls == 0 and "Connection" in ex.error
    runner = ScoringRunner(load_scorer(ScoringConfig(scorer="milestones")), max_retries=1)
    score = runner.score(artifacts(ex, task, tmp_path / "tasks"))
    assert (score.kind, score.reward, score.counts_in_group) == ("placeholder", 0.0, True)


def test_external_jsonl_round_trips_with_an_example(tmp_path: Path) -> None:
    (tmp_path / "seeds" / "calc").mkdir(parents=True)
    (tmp_path / "seeds" / "calc" / "README.md").write_text("# calc\n")
    (tmp_path / "suite.jsonl").write_text(
        json.dumps(
            {
                "id": "calc-1",
                "spec": "Write calc.add.",
                "scorer": "hidden-tests",
                "seed": {"dir": "seeds/calc"},
                "hidden_tests": {
                    "files": {
                        "test_calc.py": "from calc import add\n\ndef test_add():\n    assert add(1, 1) == 2\n"
                    }
                },
                "hidden_test_count": 1,
                "timeout_s": 600,
            }
        )
        + "\n"
    )
    (task,) = load_jsonl(tmp_path / "suite.jsonl")
    assert task.seed == {"README.md": "# calc\n"} and task.timeout_s == 600
    write_jsonl(tmp_path / "again.jsonl", [task])
    assert load_jsonl(tmp_path / "again.jsonl") == [task]
    assert load_suite(str(tmp_path / "suite.jsonl"), 0) == [task]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"id": "x", "spec": "y", "hidden_test": {}}) + "\n")
    with pytest.raises(GyreError, match="bad.jsonl:1: unknown key\\(s\\) hidden_test; valid keys: id, spec"):
        load_jsonl(tmp_path / "bad.jsonl")


def test_built_in_suites_are_deterministic_and_split() -> None:
    assert load_suite("repo-mini", 3, seed=1) == load_suite("repo-mini", 3, seed=1)
    train, held = load_suite("smoke", 50, split="train"), load_suite("smoke", 50, split="heldout")
    assert {t.id for t in train}.isdisjoint({t.id for t in held})
    long = load_suite("repo-mini-long", 1)[0]
    assert len(long.hidden_checks) >= 30 and "part3.py" in long.spec
    with pytest.raises(GyreError, match="neither a built-in suite \\(smoke, repo-mini"):
        load_suite("nl2repo", 1)


def test_warm_start_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    import hashlib

    from gyre_hpc.builtin_models.warmstart import warmstart

    shown: list[tuple[int, int]] = []
    digests = [
        hashlib.sha256(
            (warmstart(tmp_path / f"w{i}", seed=3, steps=2, progress=lambda *p: shown.append(p))
             / "model.safetensors").read_bytes()
        ).hexdigest()
        for i in range(2)
    ]  # fmt: skip
    assert digests[0] == digests[1]
    assert shown == [(1, 2), (2, 2)] * 2  # each optimizer step is reported (the CLI's bar)


def test_the_warm_start_is_the_same_bits_whatever_the_threads_and_the_cpu_s_kernels(tmp_path: Path) -> None:
    """Built as ``resolve`` builds it (its own process, kernels pinned): one digest with one
    thread or two. The machine's own kernels give other bits where it has AVX-512 — why two
    fresh machines once built different warm starts from one seed."""
    import hashlib
    import os
    import subprocess
    import sys

    from gyre_hpc.builtin_models.warm_settings import PINNED_KERNELS

    def digest(name: str, env: dict[str, str]) -> str:
        cmd = [sys.executable, "-m", "gyre_hpc.builtin_models.warmstart", str(tmp_path / name), "qwen3", "3"]
        proc = subprocess.run(cmd, env=os.environ | env, capture_output=True, text=True, check=True)
        assert proc.stdout.split() == ["1", "3", "2", "3", "3", "3"]
        return hashlib.sha256((tmp_path / name / "model.safetensors").read_bytes()).hexdigest()

    one, two = (digest(f"t{n}", PINNED_KERNELS | {"OMP_NUM_THREADS": str(n)}) for n in (1, 2))
    assert one == two
    if "avx512f" in Path("/proc/cpuinfo").read_text():
        assert digest("native", {"OMP_NUM_THREADS": "2"}) != one


def test_a_built_in_model_s_build_shows_a_bar_and_a_cached_one_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    from gyre_hpc.builtin_models import resolve as builtin_models
    from gyre_hpc.cli.model import resolve_shown
    from gyre_hpc.models.tiny import init_tiny

    def build(d: Path, progress) -> None:  # noqa: ANN001 - as builtin_models builds, in 3 steps
        for n in (1, 2, 3):
            progress(n, 3)
        init_tiny(d, 0)

    monkeypatch.setenv("GYRE_CACHE", str(tmp_path))
    monkeypatch.setattr(builtin_models, "_build", lambda name, d, progress: build(d, progress))
    console = Console(record=True, width=120, force_terminal=False)
    assert (resolve_shown("tiny", console) / "config.json").exists()
    first = console.export_text()
    assert "building tiny (once; cached)" in first and "3/3" in first
    resolve_shown("tiny", console)
    assert console.export_text() == ""  # a cache hit draws nothing


def test_eval_cli_runs_a_suite_through_the_proxy(tiny: Path, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "GYRE_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gyre_hpc",
            "eval",
            "recipes/smoke.toml",
            "--n",
            "3",
            "--set",
            f"run.model={tiny}",
            "--set",
            f"run.runs_dir={tmp_path}",
            "--set",
            "agent.max_calls=3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "pass rate" in proc.stdout and "calls per execution" in proc.stdout
    (run_dir,) = tmp_path.glob("smoke-eval-*")
    lines = (run_dir / "executions.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["score"]["kind"] == "scored" for line in lines)
    shown = subprocess.run(
        [sys.executable, "-m", "gyre_hpc", "traj", "show", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    assert shown.returncode == 0 and shown.stdout.count(" calls · ") == 3
