"""The controller's side of the control protocol (``runtime.fleet.MpiFleet``) against a scripted
cell on a scripted clock: how long it waits for an answer, and when it declares a cell lost.

The channel is faked at its two methods (``send``, ``poll``); everything above them is the real
fleet. Each poll advances the clock by one second.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre_hpc.observability import events as ev
from gyre_hpc.plan.ranks import RankLayout
from gyre_hpc.recipe.schema import CellsConfig, EngineConfig
from gyre_hpc.runtime.fleet import CellLost, MpiFleet, Waits
from gyre_hpc.runtime.protocol import Heartbeat, Hello, Message, ProtocolError, RoleTaken, TakeRole
from gyre_hpc.scheduler.policy import Role

CELLS = CellsConfig(count=1, ranks_per_cell=1, heartbeat_timeout_s=60, hello_timeout_s=120)


class ScriptedCell:
    """Cell 0: heartbeats every second until ``silent_at``; answers a TakeRole ``answer_after``
    seconds after it was sent (as a cell does once its restarting server is back)."""

    def __init__(self, answer_after: float, silent_at: float = float("inf"), hello_at: float = 0) -> None:
        self.now, self.answer_after, self.silent_at, self.hello_at = 0.0, answer_after, silent_at, hello_at
        self.outbox: list[Message] = [
            Hello(cell=0, rank=1, host="node-a", pid=1, addresses=("http://node-a:1",), capacity=4)
        ]
        self.answer: tuple[float, Message] | None = None

    def clock(self) -> float:
        return self.now

    def send(self, message: Message, dest: int) -> None:
        if isinstance(message, TakeRole):
            reply = RoleTaken(
                cell=message.cell, role=message.role, seq=message.seq, seconds=self.answer_after
            )
            self.answer = (self.now + self.answer_after, reply)

    def poll(self, source: int | None = None) -> tuple[int, Message] | None:
        self.now += 1.0
        if self.outbox:
            return (1, self.outbox.pop(0)) if self.now >= self.hello_at else None
        if self.answer is not None and self.now >= self.answer[0]:
            msg, self.answer = self.answer[1], None
            return 1, msg
        if self.now < self.silent_at:
            return 1, Heartbeat(cell=0, role=Role.SAMPLING, sent=self.now)
        return None


def fleet_of(tmp_path: Path, cell: ScriptedCell, waits: Waits) -> MpiFleet:
    events = ev.EventLog(tmp_path / "events.jsonl")
    fleet = MpiFleet(None, RankLayout(1, 1), CELLS, None, events, waits, 0, cell.clock)
    fleet.channel = cell  # type: ignore[assignment]
    fleet.start()
    return fleet


def test_a_cell_restarting_its_sglang_server_is_waited_for_while_it_heartbeats(tmp_path: Path) -> None:
    sglang = Waits.of(CELLS, EngineConfig(backend="sglang", start_timeout_s=300))
    assert sglang == Waits(hello_s=420, reply_s=360)
    cell = ScriptedCell(answer_after=200)  # a server restart on a slow machine: past 60 s
    assert fleet_of(tmp_path, cell, sglang).switch({0: Role.TRAINING}) == {0: 200}


def test_without_a_server_to_restart_the_answer_is_due_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    embedded = Waits.of(CELLS, EngineConfig(backend="embedded", start_timeout_s=300))
    assert embedded.reply_s == 60
    fleet = fleet_of(tmp_path, ScriptedCell(answer_after=200), embedded)
    with pytest.raises(ProtocolError, match=r"no RoleTaken from cells \[0\] within 60 s"):
        fleet.switch({0: Role.TRAINING})


def test_a_cell_that_falls_silent_is_lost_after_the_heartbeat_timeout_however_long_a_reply_may_take(
    tmp_path: Path,
) -> None:
    cell = ScriptedCell(answer_after=200, silent_at=30)
    fleet = fleet_of(tmp_path, cell, Waits.of(CELLS, EngineConfig(backend="sglang")))
    with pytest.raises(CellLost, match=r"cell 0 \(rank 1 on node-a\) silent for 6\d s"):
        fleet.switch({0: Role.TRAINING})
    assert cell.now < 100


def test_a_leader_says_hello_once_its_engine_is_up_so_the_wait_spans_the_engine_s_start(
    tmp_path: Path,
) -> None:
    """An 8B server with graph capture can take minutes to be healthy; ``hello_timeout_s`` (120 s)
    is the wait beyond ``engine.start_timeout_s``, not instead of it."""
    waits = Waits.of(CELLS, EngineConfig(backend="sglang", start_timeout_s=300))
    fleet_of(tmp_path, ScriptedCell(answer_after=0, hello_at=400), waits)  # up at 400 s: in time
    with pytest.raises(ProtocolError, match=r"no Hello from \[0\] within 420 s"):
        fleet_of(tmp_path, ScriptedCell(answer_after=0, hello_at=500), waits)
