"""An engine that shares its GPUs with the trainer: the colocation table, and the verbs a cell's
SGLang host sends for every transition, at the HTTP boundary (the memory verbs need CUDA, so
the server is a stand-in that keeps SGLang's rules: ``sglang_memory_fake.py``)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gyre_hpc.engines.client import EngineError
from gyre_hpc.engines.colocation import (
    CONTINUE,
    LOAD,
    PAUSE,
    RELEASE,
    RESUME,
    START,
    State,
    VerbNotAllowed,
    step,
)
from gyre_hpc.engines.hosted import SGLangHost
from gyre_hpc.engines.sglang import SGLangServer
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.flat import FlatLayout
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.recipe.schema import EngineConfig

FAKE = Path(__file__).parent / "sglang_memory_fake.py"
S, P, R = State.SERVING, State.PAUSED, State.RELEASED


@pytest.mark.parametrize(
    ("state", "verb", "saver", "after", "verbs"),
    [
        (S, "train", True, R, (PAUSE, RELEASE)),
        (S, "train", False, P, (PAUSE,)),
        (P, "train", False, P, ()),
        (R, "train", True, R, ()),
        (S, "sample", True, S, ()),
        (P, "sample", False, S, (CONTINUE,)),
        (R, "sample", True, S, (RESUME, CONTINUE)),
        (S, "load", True, S, (LOAD,)),
        (P, "load", False, P, (LOAD,)),
        (S, "restarted", True, S, (LOAD,)),
        (R, "restarted", True, R, (LOAD, PAUSE, RELEASE)),
        (P, "restarted", False, P, (LOAD, PAUSE)),
        (S, "died", True, S, (START,)),
        (P, "died", False, P, (START,)),
        (R, "died", True, State.DOWN, ()),  # it would size its pool around the trainer
        (State.DOWN, "train", True, State.DOWN, ()),
        (State.DOWN, "sample", True, S, (START,)),
    ],
)
def test_the_colocation_table(state: State, verb: str, saver: bool, after: State, verbs: tuple) -> None:
    assert step(state, verb, saver) == (after, verbs)


def test_a_load_into_released_memory_and_an_unknown_verb_are_refused() -> None:
    with pytest.raises(VerbNotAllowed, match="a load into a released server"):
        step(R, "load", True)
    with pytest.raises(VerbNotAllowed, match="a load into a down server"):
        step(State.DOWN, "load", True)
    with pytest.raises(ValueError, match="valid: train, sample, load, died, restarted"):
        step(S, "evict", True)


@pytest.fixture
def host(tmp_path: Path):  # noqa: ANN201
    """An SGLang host of a GPU server with the memory saver, its process the stand-in."""
    model = init_tiny(tmp_path / "tiny")
    engine = EngineConfig(backend="sglang", weight_sync="disk", start_timeout_s=60)
    server = SGLangServer(engine, model, tmp_path / "work", device="cuda")
    log = tmp_path / "verbs.log"
    server.cmd = [sys.executable, str(FAKE), str(log), str(server.port)]
    flat = np.zeros(FlatLayout.of(ModelConfig.load(model)).numel, dtype=np.float32)
    h = SGLangHost(server, lambda: (flat, 3))
    h.start()
    yield h, log, flat
    h.stop()


def said(log: Path) -> list[str]:
    """The verbs the server got since the last look, each with its status."""
    lines = log.read_text().split()
    log.write_text("")
    return [f"{lines[i]} {lines[i + 1]}" for i in range(0, len(lines), 2)]


def back(h: SGLangHost) -> None:
    """The cell's loop while its server restarts: supervise between messages, until it is back."""
    deadline = time.monotonic() + 60
    while h.restarting:
        assert time.monotonic() < deadline, "no restart within 60 s"
        h.supervise()
        time.sleep(0.05)


def test_a_cell_that_trains_releases_its_server_s_memory_and_takes_it_back(host) -> None:  # noqa: ANN001
    h, log, flat = host
    h.load(flat, 1)
    h.pause()
    assert h.state == R and said(log) == [
        "update_weights_from_disk 200", "pause_generation 200", "release_memory_occupation 200"
    ]  # fmt: skip
    h.pause()  # again: nothing to do
    with pytest.raises(VerbNotAllowed):
        h.load(flat, 2)
    assert said(log) == []
    h.resume()
    h.load(flat, 2)
    assert h.state == S and said(log) == [
        "resume_memory_occupation 200", "continue_generation 200", "update_weights_from_disk 200"
    ]  # fmt: skip


def test_a_server_that_dies_while_its_cell_trains_starts_again_when_the_cell_samples(host) -> None:  # noqa: ANN001
    """A server sizes its KV pool by the memory free when it starts: started beside the resident
    trainer it would keep a pool sized around it for good. So it stays down while the cell trains
    and starts when the cell samples, loading the newest weights."""
    h, log, _ = host
    h.pause()
    said(log)
    os.killpg(h.server.proc.pid, signal.SIGKILL)
    h.server.proc.wait()
    h.supervise()
    assert h.state == State.DOWN and not h.restarting and not h.server.alive()
    h.pause()  # the cell trains on: nothing to do
    assert h.state == State.DOWN and not h.restarting and h.restarts == []
    h.resume()
    back(h)
    h.supervise()
    assert [r.cause for r in h.restarts] == ["died (code -9)"] and h.state == S
    assert [r.version for r in h.restarts] == [3]  # the newest weights the cell held
    assert said(log) == ["update_weights_from_disk 200"]  # a fresh server holds its memory


@pytest.mark.parametrize("verb", ["/release_memory_occupation", "/resume_memory_occupation"])
def test_a_server_killed_as_a_release_or_a_resume_reaches_it_serves_when_its_cell_samples(
    host,  # noqa: ANN001
    verb: str,
) -> None:
    """The memory verbs of the fault matrix (the stand-in: SGLang on the CPU has no memory saver).
    Killed as the release arrives, the cell trains on with no server (none is started beside the
    trainer) and the resume starts one; killed as the resume arrives, it starts at once. Either
    way it comes back at the newest weights, serving."""
    h, log, _ = host
    armed = {verb}

    def kill_on_arrival(path: str) -> None:
        if path in armed and h.server.proc is not None:
            armed.discard(path)
            os.killpg(h.server.proc.pid, signal.SIGKILL)

    h.server.sent = kill_on_arrival
    h.pause()
    if verb == "/release_memory_occupation":
        assert h.state == State.DOWN and not h.restarting and not armed
    h.resume()
    back(h)
    h.supervise()
    cause = "died during pause" if verb == "/release_memory_occupation" else "died during resume"
    assert not armed and h.state == S and [(r.cause, r.version) for r in h.restarts] == [(cause, 3)]
    assert said(log)[-1] == "update_weights_from_disk 200"  # the fresh server holds the newest weights


def test_a_server_that_dies_while_it_samples_is_started_again_at_once(host) -> None:  # noqa: ANN001
    h, log, _ = host
    os.killpg(h.server.proc.pid, signal.SIGKILL)
    h.server.proc.wait()
    h.supervise()
    assert h.restarting
    back(h)
    assert h.state == S and said(log) == ["update_weights_from_disk 200"]


def test_without_the_memory_saver_a_training_cell_s_server_is_only_paused(tmp_path: Path) -> None:
    model = init_tiny(tmp_path / "tiny")
    engine = EngineConfig(backend="sglang", weight_sync="disk", enable_memory_saver=False, start_timeout_s=60)
    server = SGLangServer(engine, model, tmp_path / "work", device="cuda")
    log = tmp_path / "verbs.log"
    server.cmd = [sys.executable, str(FAKE), str(log), str(server.port)]
    h = SGLangHost(server, lambda: (np.zeros(1, np.float32), 0))
    h.start()
    try:
        h.pause()
        h.resume()
        assert said(log) == ["pause_generation 200", "continue_generation 200"]
    finally:
        h.stop()


def test_the_stand_in_refuses_what_sglang_refuses(host) -> None:  # noqa: ANN001
    """The rules the stand-in keeps, so the tests above could fail: resuming memory never
    released, and releasing a server that still generates."""
    h, log, _ = host
    with pytest.raises(EngineError):
        h.server.send(RESUME)
    with pytest.raises(EngineError):
        h.server.send(RELEASE)
    assert said(log) == ["resume_memory_occupation 500", "release_memory_occupation 500"]


class Recorder:
    """Records the verbs a cell calls on what it owns, in order."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def __getattr__(self, verb: str):  # noqa: ANN204
        return lambda *args: self.calls.append(f"{self.name}.{verb}")


def test_the_gpus_change_hands_in_an_order_that_never_needs_both_at_once() -> None:
    """To sample: the core's snapshot taken, every member's trainer released (they acknowledge
    the forwarded switch only once released), the leader's, then the engine resumes. To train:
    the engine lets go first, then every trainer takes its memory back."""
    from gyre_hpc.recipe.schema import CellsConfig
    from gyre_hpc.runtime.cell_leader import Leader
    from gyre_hpc.runtime.protocol import TakeRole
    from gyre_hpc.scheduler.policy import Role

    calls: list[str] = []

    class Members:
        """The cell's channel to its members: member 1 hosts engine replica 1."""

        def send(self, msg: object, dest: int) -> None:
            calls.append(f"member {dest} told {msg.verb}")  # type: ignore[attr-defined]
            self.last = msg

        def recv(self, timeout: float, source: int, what: str) -> tuple[int, object]:
            calls.append(f"member {source} done")
            return source, self.last

    cell = Leader.__new__(Leader)  # the switch alone: no world, no ranks
    cell.unit, cell.session, cell.role, cell.cells = 0, None, Role.IDLE, CellsConfig()
    cell.setup = None  # a whole snapshot: the core's leader gathers it before it lets go
    cell.engine, cell.trainer = Recorder("engine", calls), Recorder("trainer", calls)
    cell._forward = lambda msg: calls.append(f"members told {msg.role}")
    cell._await_members = lambda seq: calls.append("members acknowledged")
    cell._hosting_members = lambda: []  # one replica: the leader's
    cell.switch(TakeRole(cell=0, role=Role.SAMPLING, seq=1))
    assert calls == [
        "trainer.weights", "members told sampling", "members acknowledged",
        "trainer.release_memory", "engine.resume",
    ]  # fmt: skip
    calls.clear()
    cell.switch(TakeRole(cell=0, role=Role.TRAINING, seq=2))
    assert calls == ["engine.pause", "members told training", "members acknowledged", "trainer.resume_memory"]
    # Two replicas: every replica lets go before any trainer takes memory back, and every
    # trainer lets go before any replica resumes.
    cell.in_cell, cell._hosting_members = Members(), lambda: [1]
    calls.clear()
    cell.switch(TakeRole(cell=0, role=Role.SAMPLING, seq=3))
    assert calls == [
        "trainer.weights", "members told sampling", "members acknowledged", "trainer.release_memory",
        "member 1 told resume", "member 1 done", "engine.resume",
    ]  # fmt: skip
    calls.clear()
    cell.switch(TakeRole(cell=0, role=Role.TRAINING, seq=4))
    assert calls == [
        "member 1 told pause", "member 1 done", "engine.pause",
        "members told training", "members acknowledged", "trainer.resume_memory",
    ]  # fmt: skip


def test_the_gpu_checks_run_at_tiny_size_on_the_cpu(tmp_path: Path) -> None:
    """``tools/bench_colocation.py`` (the first call of ``tools/gpu_bench.sh run``) end to end on
    the CPU: by reference through a shared-memory file, broadcast over gloo, forward-only
    attention, the release and resume of a rank's state; so a lent GPU's few minutes are not
    spent on a script that never ran."""
    import json
    import subprocess

    def bench(phases: str) -> dict:
        proc = subprocess.run(
            [sys.executable, "tools/bench_colocation.py", "--device", "cpu", "--out", str(tmp_path),
             "--push-gb", "0.01", "--bucket-mb", "1", "--rank-params", "1e6", "--phases", phases],
            capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1],
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((tmp_path / "bench_colocation.json").read_text())

    # Two calls, as tools/gpu_bench.sh makes them, each under its own limit: the file keeps both.
    first = bench("push,broadcast,cycle")
    assert set(first) == {"device", "push_by_reference", "push_by_broadcast", "cycle"}
    got = bench("flex")
    assert got == {**first, "flex": got["flex"]}
    assert [p["dtype"] for p in got["push_by_reference"]] == ["bfloat16", "float32"]
    assert all(p["sender_peak_mb"] <= 1.0 for p in got["push_by_reference"])
    assert all("seconds" in r for r in got["push_by_broadcast"]["ranks"])
    rows = got["flex"]
    assert len(rows) == 12 and sum(r["new_graphs"] for r in rows) <= 2 * len({r["padded"] for r in rows})
    assert all("no_grad_new_graphs" in r for r in rows)
    # weights, master, its gradient and Adam: what a core rank hands back (GB, rounded to 0.01)
    assert got["cycle"]["trainer_state_gb"] == pytest.approx(1e6 * (2 + 4 + 4 + 8) / 1e9, abs=0.005)


def test_the_gpu_call_s_steps_fit_one_device_call_and_carry_no_sglang() -> None:
    """A lent GPU gives one call of 600 s: the steps' limits together leave room for the wheels'
    install and the machine's start, and nothing waits on SGLang (not carriable there)."""
    import re

    script = (Path(__file__).parents[1] / "tools" / "gpu_bench.sh").read_text()
    limits = [int(n) for n in re.findall(r"timeout (\d+) ", script)]
    assert len(limits) == 5 and sum(limits) <= 540, limits
    assert "sglang" not in script.split("run)", 1)[1].lower()
