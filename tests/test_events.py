"""The event log: one typed schema, one line per record, several writers, torn tails dropped."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from gyre_hpc.observability import events as ev
from gyre_hpc.observability.events import EventLog, EventTail, read_events


def _write(path: Path, who: int, n: int) -> None:
    with EventLog(path) as log:
        for i in range(n):
            log.emit(ev.Dispatched(run=f"w{who}-{i}-" + "x" * 200, d=i, p=who, f=0))


def test_concurrent_writers_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    procs = [multiprocessing.Process(target=_write, args=(path, w, 300)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    events = read_events(path)
    assert len(events) == 1200 and all(isinstance(e, ev.Dispatched) for e in events)
    for w in range(4):
        assert [e.d for e in events if e.p == w] == list(range(300))


def test_torn_tail_is_dropped_and_picked_up_once_complete(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.emit(ev.Shutdown(reason="a"))
    with path.open("ab") as fh:
        fh.write(b'{"t":1,"event":"shutdown","reason":"b"')  # a writer killed mid-line
    tail = EventTail(path)
    assert [e.reason for e in tail.new()] == ["a"]
    with path.open("ab") as fh:
        fh.write(b"}\n")
    assert tail.new() == [ev.Shutdown(t=1.0, reason="b")]
    assert tail.new() == []


def test_a_writer_after_one_killed_mid_line_loses_nothing_of_its_own(tmp_path: Path) -> None:
    """The controller killed mid-record, then its restart's first record: that one is read whole
    (it was glued to the torn line before, and lost with it); so for the proxy's chat index."""
    from gyre_hpc.proxy.server import ChatIndex

    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.emit(ev.Shutdown(reason="a"))
    with path.open("ab") as fh:
        fh.write(b'{"t":1,"event":"shutdown","reas')  # killed mid-line
    with EventLog(path) as log:
        log.emit(ev.Shutdown(reason="b"))
    assert [e.reason for e in read_events(path)] == ["a", "b"]
    chats = tmp_path / "chats.jsonl"
    index = ChatIndex(chats)
    index.append("r1", {"digest": "d1"})
    index.close()
    with chats.open("ab") as fh:
        fh.write(b'{"run":"r1","dig')
    index = ChatIndex(chats)
    index.append("r1", {"digest": "d2"})
    index.close()
    assert ChatIndex(chats).entries == {"r1": [{"digest": "d1"}, {"digest": "d2"}]}


def test_records_round_trip_through_the_file_with_their_kind_and_time(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    step = ev.Step(
        step=3, version=3, seconds=1.5, sample_seconds=1.0, roles={"0": "sampling"}, claims={"0": 2}
    )
    with EventLog(path) as log:
        written = log.emit(step)
    line = json.loads(path.read_text())
    assert line["event"] == "step" and line["step"] == 3 and line["t"] == written.t > 0
    (read,) = read_events(path)
    assert read == written and isinstance(read, ev.Step)


def test_unknown_kinds_and_old_records_are_kept_not_dropped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(
        '{"t":1,"event":"tick","who":3}\n'  # a kind this version does not know
        '{"t":2,"event":"hello","cell":0}\n'  # required fields missing: written by another version
        '{"t":3,"event":"run_end","status":"completed","extra":1}\n'  # an unknown key is ignored
    )
    tick, hello, end = read_events(path)
    assert (ev.kind_of(tick), tick.fields()) == ("tick", {"who": 3})
    assert ev.kind_of(hello) == "hello" and isinstance(hello, ev.Other)
    assert end == ev.RunEnd(t=3.0, status="completed")


def test_missing_file_reads_as_empty(tmp_path: Path) -> None:
    assert read_events(tmp_path / "none.jsonl") == []
