"""Harnesses we do not write (agents.external): a program or a Python function per execution,
talking to the real proxy on loopback, scored like the built-in harness."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import MINI_SWE_AGENT, REPO, gyre
from loopback import Stack
from test_local_run import SMOKE

from gyre_hpc.agents.dispatch import Dispatcher, make_harness
from gyre_hpc.agents.external import Endpoint, load_entry
from gyre_hpc.errors import GyreError, RecipeError
from gyre_hpc.execution.outcome import Outcome
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.observability import events as ev
from gyre_hpc.recipe import load_recipe
from gyre_hpc.recipe.schema import AgentConfig, ScoringConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.scoring import ScoringRunners
from gyre_hpc.tasks.jsonl import write_jsonl
from gyre_hpc.tasks.suites import repo_mini
from gyre_hpc.tasks.task import Task
from gyre_hpc.trajectory.codec import by_run, read_records
from gyre_hpc.trajectory.records import TitoRecord
from gyre_hpc.trajectory.tree import TrajectoryTree

EXAMPLES = REPO / "examples"
HALF_DONE = Task(
    id="calc",
    spec="Implement add and sub in calc.py.",
    scorer="hidden-tests",
    seed={"calc.py": "def add(a, b):\n    return a + b\n"},
    hidden_tests={
        "test_calc.py": "def test_add():\n    from calc import add\n    assert add(1, 2) == 3\n\n"
        "def test_sub():\n    from calc import sub\n    assert sub(3, 1) == 2\n"
    },
    hidden_test_count=2,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def run_one(tiny: Path, tmp_path: Path, config: AgentConfig, task: Task = HALF_DONE) -> tuple[Outcome, list]:
    """One execution through a real proxy and engine; its outcome and TITO records."""

    async def go() -> tuple[Outcome, list]:
        async with Stack(tiny, tmp_path / "run") as stack:
            endpoint = Endpoint(stack.proxy_url, stack.key, tiny.name, stack.proxy.usage)
            harness = make_harness(config, endpoint, {}, 0, tmp_path / "logs")
            scoring = ScoringRunners(ScoringConfig(scorer="hidden-tests", max_retries=0))
            dispatcher = Dispatcher(
                harness, lambda t: scoring.get(t.scorer), tmp_path / "ws", tmp_path / "tasks", 2
            )
            (outcome,) = await dispatcher.run_all([("ext-1", task)])
            tree = stack.proxy.tito.trees.get("ext-1")
            records = [tree.record(i) for i in range(tree.num_records)] if tree else []
            return outcome, records

    return asyncio.run(go())


def one_path(records: list[TitoRecord]) -> None:
    """Every call's input begins with the previous call's input and output, token for token."""
    assert len(records) >= 2
    for before, after in zip(records, records[1:], strict=False):
        context = [*before.input_ids, *before.output_ids]
        assert list(after.input_ids[: len(context)]) == context


def test_a_hanging_program_is_killed_at_its_timeout_with_its_group_and_partially_scored(
    tiny: Path, tmp_path: Path
) -> None:
    config = AgentConfig(kind="command", command=["sh", "-c", "sleep 307 & sleep 307"], timeout_s=1.5)
    started = time.monotonic()
    outcome, _ = run_one(tiny, tmp_path, config)
    assert time.monotonic() - started < 30
    assert outcome.execution.status == "timed_out"
    assert (outcome.score.kind, outcome.score.reward) == ("partial", 0.5)  # what the workspace holds
    left = subprocess.run(["pgrep", "-f", "sleep 307"], capture_output=True, text=True).stdout
    assert left == "", "the program's process group outlived it"


def test_a_crashing_program_is_scored_as_crashed_and_its_output_kept(tiny: Path, tmp_path: Path) -> None:
    config = AgentConfig(kind="command", command=["sh", "-c", "echo boom on {task_id}; exit 3"])
    outcome, _ = run_one(tiny, tmp_path, config)
    assert outcome.execution.status == "crashed" and "exit code 3" in outcome.execution.error
    assert outcome.score.kind == "placeholder"  # it never reached the model: nothing of its own
    assert (tmp_path / "logs" / "ext-1.log").read_text() == "boom on calc\n"


def test_the_example_program_trains_through_the_proxy_exactly(tiny: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(EXAMPLES / "command_agent.py"), "{instruction}"]
    outcome, records = run_one(tiny, tmp_path, AgentConfig(kind="command", command=command, timeout_s=120))
    ex = outcome.execution
    assert ex.status == "finished", (tmp_path / "logs" / "ext-1.log").read_text()
    assert ex.calls == len(records) and ex.tokens > 0
    one_path(records)  # the program re-sent its history; the proxy reused the recorded ids
    assert {r.role for r in records} == {"main"}


def test_the_python_entry_point_example_end_to_end(tiny: Path, tmp_path: Path) -> None:
    entry = f"{EXAMPLES / 'python_agent.py'}:agent"
    outcome, records = run_one(tiny, tmp_path, AgentConfig(kind="python", entry=entry, timeout_s=120))
    assert outcome.execution.status == "finished", outcome.execution.error
    assert outcome.execution.calls == len(records) == 4
    one_path(records)


def test_a_python_agent_that_raises_is_crashed_and_one_that_hangs_times_out(
    tmp_path: Path, tiny: Path
) -> None:
    (tmp_path / "agents.py").write_text(
        "import asyncio\n"
        "async def broken(ctx):\n    raise ValueError('bug in the agent')\n"
        "async def stuck(ctx):\n    await asyncio.sleep(300)\n"
    )
    broken, _ = run_one(
        tiny, tmp_path / "a", AgentConfig(kind="python", entry=f"{tmp_path}/agents.py:broken")
    )
    assert broken.execution.status == "crashed" and broken.execution.error == "ValueError: bug in the agent"
    stuck, _ = run_one(
        tiny, tmp_path / "b", AgentConfig(kind="python", entry=f"{tmp_path}/agents.py:stuck", timeout_s=1)
    )
    assert stuck.execution.status == "timed_out" and stuck.score.kind == "partial"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["agent.kind=command"], 'agent.kind = "command" needs agent.command'),
        (["agent.kind=python"], 'agent.kind = "python" needs agent.entry'),
        (['agent.command=["x", "{workdir}"]'], "names 'workdir'; valid fields: workspace, instruction"),
    ],
)
def test_a_misconfigured_agent_is_one_line(sets: list[str], message: str) -> None:
    with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
        load_recipe(None, sets)


def test_a_bad_entry_names_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "sync.py").write_text("def agent(ctx):\n    return 'x'\n")
    for entry, message in [
        ("nocolon", "expected module:function"),
        ("no_such_module_xyz:agent", "No module named 'no_such_module_xyz'"),
        (f"{tmp_path}/sync.py:agent", "not an async function"),
    ]:
        with pytest.raises(GyreError, match=message):
            load_entry(entry)


COIN_AGENT = """
import os, sys
from openai import OpenAI
client = OpenAI(max_retries=0)
messages = [{"role": "user", "content": sys.argv[1]}]
for _ in range(3):
    reply = client.chat.completions.create(model=os.environ["GYRE_MODEL"], messages=messages, max_tokens=24)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    messages.append({"role": "user", "content": "more"})
if len(messages[-2]["content"]) % 2:  # the sampled words decide: rewards differ within a group
    open("heads.txt", "w").write("1")
"""


@pytest.mark.mpi
def test_gyre_run_trains_a_black_box_program_in_elastic_mode(tmp_path: Path) -> None:
    (tmp_path / "coin.py").write_text(COIN_AGENT)
    tmp_path.chmod(0o755)  # the sandbox shows the program's directory to a uid that is not root
    tasks = [Task(id=f"coin-{i}", spec=f"Flip coin {i}.", scorer="milestones",
                  milestones=[{"weight": 1, "file_exists": "heads.txt"}]) for i in range(4)]  # fmt: skip
    write_jsonl(tmp_path / "coins.jsonl", tasks)
    command = f'["{sys.executable}", "{tmp_path / "coin.py"}", "{{instruction}}"]'
    sets = [
        f"run.runs_dir={tmp_path / 'runs'}", "run.model=tiny", "run.steps=2", "scheduler.mode=elastic",
        f"tasks.suite={tmp_path / 'coins.jsonl'}", "tasks.prompts_per_step=2", "tasks.eval_every=0",
        "agent.kind=command", f"agent.command={command}",
    ]  # fmt: skip
    proc = gyre("run", SMOKE, *(a for s in sets for a in ("--set", s)), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunDir(next((tmp_path / "runs").iterdir()))
    steps = [e for e in run.read_events() if isinstance(e, ev.Step)]
    assert [s.executions for s in steps] == [8, 8]
    assert steps[-1].version >= 1 and any(s.micro_steps for s in steps)  # the black box's calls trained
    trees = {r: TrajectoryTree.from_encoded(recs) for r, recs in by_run(read_records(run.tito_log).records)}
    assert len(trees) == 16
    for tree in trees.values():  # each execution: 3 calls, one path with exact prefix reuse
        one_path([tree.record(i) for i in range(tree.num_records)])
    shown = gyre("traj", "show", str(run.path), "--run", min(trees))
    assert "3 calls" in shown.stdout and "main ×3" in shown.stdout, shown.stdout


def test_a_suite_for_black_box_harnesses_sets_up_and_verifies_in_the_workspace(
    tiny: Path, tmp_path: Path
) -> None:
    from gyre_hpc.tasks.jsonl import load_jsonl

    greet, count = load_jsonl(EXAMPLES / "verifier-tasks.jsonl")
    assert (greet.scorer, greet.spec) == ("verifier", "Write a script hello.sh that prints hello.")
    solve = AgentConfig(
        kind="command", command=["sh", "-c", "test -d .git && printf 'echo hello' > hello.sh"]
    )
    solved, _ = run_one(tiny, tmp_path / "a", solve, greet)  # setup ran first: .git is there
    assert (solved.execution.status, solved.score.kind, solved.score.reward) == ("finished", "scored", 1.0)
    idle, _ = run_one(tiny, tmp_path / "b", AgentConfig(kind="command", command=["true"]), count)
    assert (idle.score.kind, idle.score.reward) == ("scored", 0.0)
    partial = AgentConfig(kind="command", command=["sh", "-c", "wc -l < data.txt > count.txt"])
    assert run_one(tiny, tmp_path / "c", partial, count)[0].score.reward == 1.0
    broken = Task(id="b", spec="x", setup="echo no network; exit 4", verifier="true")
    failed, _ = run_one(tiny, tmp_path / "d", AgentConfig(kind="command", command=["true"]), broken)
    assert failed.execution.status == "crashed" and failed.execution.error == "setup exited 4: no network"


def mini_swe_agent_command(step_limit: int = 3) -> str:
    """agent.command running mini-swe-agent non-interactively against the proxy (OPENAI_BASE_URL)."""
    argv = [
        "env", "MSWEA_CONFIGURED=1", "MSWEA_COST_TRACKING=ignore_errors", "MSWEA_SILENT_STARTUP=1",
        str(MINI_SWE_AGENT), "-t", "{instruction}", "--yolo", "--exit-immediately", "-m", "openai/gyre",
        "-l", "0", "-o", "{workspace}/.mini.traj.json",  # a sandbox writes its workspace only
        "-c", "mini.yaml", "-c", f"agent.step_limit={step_limit}", "-c", "model.model_kwargs.max_tokens=48",
    ]  # fmt: skip
    return json.dumps(argv)


@pytest.mark.agents
def test_mini_swe_agent_calls_through_the_proxy_and_its_calls_keep_their_exact_ids(
    tiny: Path, tmp_path: Path
) -> None:
    """mini-swe-agent, a third-party program, against the real proxy and engine on a repo-mini task
    (scored by a coin verifier: the tiny model solves none in its format). Training a black-box
    program's calls is ``test_gyre_run_trains_a_black_box_program_in_elastic_mode``'s."""
    coin = "python3 -c 'import random; print(random.random())'"
    (task,) = [
        Task(id=t.id, spec=t.spec, seed=t.seed, verifier=coin, scorer="verifier") for t in repo_mini(1, 0)
    ]
    config = AgentConfig(kind="command", command=json.loads(mini_swe_agent_command()), timeout_s=120)
    outcome, records = run_one(tiny, tmp_path, config, task)
    assert (outcome.execution.status, outcome.score.kind) == ("finished", "scored"), outcome
    assert len(records) == 3  # agent.step_limit
    # mini-swe-agent drops a malformed reply from its history (the tiny model never makes its
    # bash call), so its calls branch after the shared prompt; that prompt's ids are reused
    # exactly, never re-tokenised.
    head = records[0].input_ids
    n = min(len(head), len(records[1].input_ids))
    shared = next((i for i in range(n) if head[i] != records[1].input_ids[i]), n)
    assert shared > len(head) // 2
    for r in records[1:]:
        assert np.array_equal(r.input_ids[:shared], head[:shared])
    shown = gyre("traj", "show", str(tmp_path / "run"), "--run", "ext-1")
    assert "3 calls" in shown.stdout and "main ×1" in shown.stdout, shown.stdout


def test_a_program_marks_its_summary_and_sub_agent_calls_with_their_roles_keys(
    tiny: Path, tmp_path: Path
) -> None:
    program = tmp_path / "roles.py"
    program.write_text(
        "import os\nfrom openai import OpenAI\n"
        "keys = ('OPENAI_API_KEY', 'GYRE_KEY_MAIN_SUMMARY', 'GYRE_KEY_SUB_AGENT',\n"
        "        'GYRE_KEY_SUB_AGENT_SUMMARY')\n"
        "for var in keys:\n"
        "    client = OpenAI(api_key=os.environ[var], max_retries=0)\n"
        "    client.chat.completions.create(model=os.environ['GYRE_MODEL'], max_tokens=4,\n"
        "                                   messages=[{'role': 'user', 'content': var}])\n"
    )
    config = AgentConfig(kind="command", command=[sys.executable, str(program)])
    outcome, records = run_one(tiny, tmp_path, config)
    assert outcome.execution.status == "finished", (tmp_path / "logs" / "ext-1.log").read_text()
    assert [r.role for r in records] == ["main", "main-summary", "sub-agent", "sub-agent-summary"]


def test_a_stopped_program_is_killed_with_its_group_and_scored_on_what_it_left(
    tiny: Path, tmp_path: Path
) -> None:
    """``max_staleness`` stops an execution through the dispatcher's stop event: it ends at once
    as "stopped", and is scored as a timed-out one is."""
    config = AgentConfig(kind="command", command=["sh", "-c", "echo started; sleep 308 & sleep 308"])

    async def go() -> Outcome:
        async with Stack(tiny, tmp_path / "run") as stack:
            endpoint = Endpoint(stack.proxy_url, stack.key, tiny.name, stack.proxy.usage)
            harness = make_harness(config, endpoint, {}, 0, tmp_path / "logs")
            scoring = ScoringRunners(ScoringConfig(scorer="hidden-tests", max_retries=0))
            stops: dict[str, asyncio.Event] = {}
            dispatcher = Dispatcher(
                harness, lambda t: scoring.get(t.scorer), tmp_path / "ws", tmp_path / "tasks", 2, stops=stops
            )
            running = asyncio.ensure_future(dispatcher.run_all([("ext-1", HALF_DONE)]))
            log = tmp_path / "logs" / "ext-1.log"
            deadline = time.monotonic() + 60
            while not (log.exists() and "started" in log.read_text()):  # the program is up
                assert time.monotonic() < deadline and not running.done()
                await asyncio.sleep(0.05)
            stops["ext-1"].set()
            (outcome,) = await running
            assert stops == {}  # an ended execution leaves no stop behind
            return outcome

    started = time.monotonic()
    outcome = asyncio.run(go())
    assert time.monotonic() - started < 60
    assert outcome.execution.status == "stopped" and "max_staleness" in outcome.execution.error
    assert (outcome.score.kind, outcome.score.reward) == ("partial", 0.5)  # what the workspace holds
    left = subprocess.run(["pgrep", "-f", "sleep 308"], capture_output=True, text=True).stdout
    assert left == "", "the program's process group outlived it"
