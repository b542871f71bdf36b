"""The on-disk record stream: exact round trip, torn tail dropped, storage ∝ unique tokens."""

from __future__ import annotations

from pathlib import Path

from gyre_hpc.trajectory import TitoRecord, TrajectoryTree
from gyre_hpc.trajectory.codec import by_run, encode_frame, read_records, write_records


def conversation(run: str, turns: int) -> list[TitoRecord]:
    records, ctx = [], [1, 2, 3]
    for t in range(turns):
        out = [100 + t, 200 + t]
        records.append(TitoRecord(run, f"c{t}", "main", ctx, out, [-1.5, -0.25]))
        ctx = ctx + out + [50 + t]
    return records


def test_round_trip_of_interleaved_runs(tmp_path: Path) -> None:
    log = tmp_path / "tito.bin"
    a, b = TrajectoryTree("a"), TrajectoryTree("b")
    ra, rb = conversation("a", 6), conversation("b", 4)
    for i in range(6):  # runs interleave in the log as calls finish
        write_records(log, [a.add(ra[i])])
        if i < 4:
            write_records(log, [b.add(rb[i])])
    read = read_records(log)
    assert read.torn_bytes == 0
    runs = dict(by_run(read.records))
    assert list(TrajectoryTree.from_encoded(runs["a"]).records()) == ra
    assert list(TrajectoryTree.from_encoded(runs["b"]).records()) == rb


def test_storage_grows_with_unique_tokens_not_with_resent_context(tmp_path: Path) -> None:
    records = conversation("r", 200)
    tree = TrajectoryTree.from_records(records)
    size = write_records(tmp_path / "tito.bin", tree.encoded)
    flat_ids = sum(len(r.input_ids) + len(r.output_ids) for r in records)
    assert tree.num_record_tokens == flat_ids > 50 * tree.num_unique_tokens
    ids_and_logprobs = 4 * tree.num_unique_tokens + 4 * sum(len(r.output_ids) for r in records)
    assert size < ids_and_logprobs + 250 * len(records)  # plus a small header per call


def test_torn_tail_is_dropped_and_everything_acknowledged_is_kept(tmp_path: Path) -> None:
    log = tmp_path / "tito.bin"
    tree = TrajectoryTree.from_records(conversation("r", 3))
    write_records(log, tree.encoded[:2])
    frame = encode_frame(tree.encoded[2])
    with log.open("ab") as fh:
        fh.write(frame[: len(frame) // 2])  # the writer died mid-frame
    read = read_records(log)
    assert [r.index for r in read.records] == [0, 1]
    assert read.torn_bytes == len(frame) // 2


def test_a_corrupted_frame_stops_the_read(tmp_path: Path) -> None:
    log = tmp_path / "tito.bin"
    tree = TrajectoryTree.from_records(conversation("r", 3))
    write_records(log, tree.encoded)
    data = bytearray(log.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the last frame's payload
    log.write_bytes(bytes(data))
    assert [r.index for r in read_records(log).records] == [0, 1]
