"""The event log: one line per record, several writers, torn tails dropped."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from gyre_hpc.observability.events import EventLog, EventTail, read_events


def _write(path: Path, who: int, n: int) -> None:
    with EventLog(path) as log:
        for i in range(n):
            log.emit("tick", who=who, i=i, pad="x" * 200)


def test_concurrent_writers_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    procs = [multiprocessing.Process(target=_write, args=(path, w, 300)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    events = read_events(path)
    assert len(events) == 1200
    for w in range(4):
        assert [e["i"] for e in events if e["who"] == w] == list(range(300))


def test_torn_tail_is_dropped_and_picked_up_once_complete(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.emit("a")
    with path.open("ab") as fh:
        fh.write(b'{"t":1,"event":"b"')  # a writer killed mid-line
    tail = EventTail(path)
    assert [e["event"] for e in tail.new()] == ["a"]
    with path.open("ab") as fh:
        fh.write(b"}\n")
    assert [e["event"] for e in tail.new()] == ["b"]
    assert tail.new() == []


def test_missing_file_reads_as_empty(tmp_path: Path) -> None:
    assert read_events(tmp_path / "none.jsonl") == []
