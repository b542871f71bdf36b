"""The RL loop end to end under mpirun: colocate and elastic steps, checkpoints, resume. The
colocate and elastic runs are the session's (``conftest.COLOCATE``, ``conftest.ELASTIC``); async's
fixed split and staleness are ``test_local_run.test_multi_rank_cells_pool_and_async_roles``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import NO_EVAL, gyre
from safetensors.torch import load_file

from gyre_hpc.builtin_models.resolve import resolve_model
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.observability.events import read_events
from gyre_hpc.rundir import RunDir

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(900)]
SMOKE = "recipes/smoke.toml"


@pytest.fixture(scope="module")
def policy() -> Path:
    """The warm-started tiny model (built once into the cache): its smoke rollouts differ in
    reward, so steps have something to learn."""
    return resolve_model("tiny-warm")


def run(tmp_path: Path, policy: Path, *sets: str, resume: Path | None = None) -> RunDir:
    args = ["run", "--resume", str(resume)] if resume else ["run", SMOKE]
    base = [f"run.runs_dir={tmp_path}", f"run.model={policy}", "tasks.prompts_per_step=2", NO_EVAL]
    for s in ([] if resume else base) + list(sets):
        args += ["--set", s]
    proc = gyre(*args, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return resume and RunDir(resume) or RunDir(next(p for p in tmp_path.iterdir() if p.is_dir()))


def steps(run_dir: RunDir) -> list[dict]:
    return [e for e in read_events(run_dir.events) if e.kind == "step"]


def test_colocate_steps_train_on_every_cell_and_checkpoint(colocate_run: Path, policy: Path) -> None:
    """The session's colocate run (``conftest.COLOCATE``: 3 steps, a checkpoint at the last)."""
    rd = RunDir(colocate_run)
    done = steps(rd)
    assert [e.step for e in done] == [1, 2, 3]
    trained = [e for e in done if not e.skipped]
    assert trained, "no step had a reward spread to learn from"
    assert [e.version for e in done] == sorted(e.version for e in done) and done[-1].version >= 1
    for e in trained:
        assert set(e.claims) == {"0", "1"} and sum(e.claims.values()) == e.micro_steps
        went = [(sw["cell"], sw["direction"]) for sw in e.switches]
        # Both train once the burst is over, both sample again once the step is applied.
        assert went == [(0, "sampling→training"), (1, "sampling→training")] + [
            (0, "training→sampling"),
            (1, "training→sampling"),
        ]
        assert e.roles == {"0": "sampling", "1": "sampling"} and e.staleness == {"0": e.calls}
    events = read_events(rd.events)
    loaded = [e.version for e in events if e.kind == "weights_loaded"]
    assert loaded == [0, *(e.version for e in done)]  # every engine serves the newest version
    # A checkpoint is a plain model directory the engines load, holding the trained weights.
    assert [p.name for p in rd.checkpoints.iterdir()] == ["step-000003"]  # trainer.checkpoint_every = 100
    trained_model = CausalLM.from_pretrained(rd.checkpoints / "step-000003")
    before = CausalLM.from_pretrained(policy)
    delta = max(
        (a - b).abs().max().item()
        for a, b in zip(trained_model.parameters(), before.parameters(), strict=True)
    )
    assert delta > 0
    assert (rd.path / "metrics.png").stat().st_size > 10_000


def test_resume_continues_with_the_same_next_step(tmp_path: Path, policy: Path) -> None:
    # One cell serving one call at a time without a prefix cache: every call is bit-reproducible.
    exact = [
        "cells.count=1",
        "cells.capacity=1",
        "engine.prefix_cache=false",
        "tasks.group_size=3",
        "agent.max_calls=3",
    ]
    straight = run(tmp_path / "a", policy, "run.steps=2", *exact)
    first = run(tmp_path / "b", policy, "run.steps=1", *exact)
    resumed = run(tmp_path / "b", policy, "run.steps=2", resume=first.path)
    assert [e.step for e in steps(resumed)] == [1, 2]
    assert any(e.kind == "resumed" and e.step == 2 for e in read_events(resumed.events))
    a = load_file(straight.path / "checkpoints" / "step-000002" / "model.safetensors")
    b = load_file(resumed.path / "checkpoints" / "step-000002" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert steps(straight)[-1].version == steps(resumed)[-1].version
    assert steps(straight)[-1].reward_mean == steps(resumed)[-1].reward_mean


def test_elastic_cells_switch_during_the_burst_and_no_execution_fails(elastic_run: Path) -> None:
    """The session's elastic run (``conftest.ELASTIC``: 3 cells, 4 prompts, 2 steps)."""
    rd = RunDir(elastic_run)
    events = read_events(rd.events)
    done = steps(rd)
    assert [e.step for e in done] == [1, 2]
    assert all(e.statuses == {"finished": e.executions} for e in done), "a switch failed an execution"
    to_training = [e for e in events if e.kind == "switch" and e.direction == "sampling→training"]
    assert to_training[0].cell == 0, "the core switches first"
    assert any(e.w > 0 for e in to_training), "a cell switched while executions were running"
    assert any((e.train_before_burst_end_s or 0) > 0 for e in done), "training began before the burst ended"
    back = [e for e in events if e.kind == "switch" and e.direction == "training→sampling"]
    assert back and all(e.load_s >= 0 for e in back)
    for e in done:
        assert sum(e.claims.values()) == e.micro_steps  # every micro-step trained exactly once
