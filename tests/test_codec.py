"""The on-disk record stream: exact round trip, torn tail dropped, storage ∝ unique tokens."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from conftest import gyre
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_hpc.proxy.tito_log import TitoLog
from gyre_hpc.rundir import RunDir
from gyre_hpc.trajectory import TitoRecord, TrajectoryTree
from gyre_hpc.trajectory.codec import by_run, encode_frame, read_frames, read_records, write_records


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


def frames_of(records: int = 4) -> tuple[bytes, list[int]]:
    """A small log's bytes and where each of its frames ends."""
    tree = TrajectoryTree.from_records(conversation("r", records))
    ends, data = [], b""
    for enc in tree.encoded:
        data += encode_frame(enc)
        ends.append(len(data))
    return data, ends


def test_every_truncation_keeps_exactly_the_complete_frames() -> None:
    data, ends = frames_of()
    for cut in range(len(data) + 1):
        read = read_frames(data[:cut])
        complete = sum(end <= cut for end in ends)
        assert [r.index for r in read.records] == list(range(complete)), cut
        assert read.torn_bytes == cut - (ends[complete - 1] if complete else 0)


@settings(max_examples=300, deadline=None)
@given(tail=st.binary(max_size=64), header=st.booleans(), size=st.integers(0, 2**32 - 1))
def test_no_garbage_tail_crashes_the_reader_or_costs_a_complete_frame(
    tail: bytes, header: bool, size: int
) -> None:
    """Garbage after the last frame — random bytes, or a frame header claiming any size (an
    empty frame's checksum is valid) — is torn; the frames before it are all kept."""
    data, ends = frames_of()
    if header:  # a header that passes the magic check, as a writer killed after it would leave
        tail = struct.pack("<2sII", b"GT", size, zlib.crc32(tail[: min(size, len(tail))])) + tail
    read = read_frames(data + tail)
    assert [r.index for r in read.records] == list(range(len(ends)))
    assert read.torn_bytes == len(tail)


def test_the_proxy_s_log_and_traj_show_survive_a_torn_empty_frame(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path, "torn")
    data, _ = frames_of()
    run.tito_log.write_bytes(data + struct.pack("<2sII", b"GT", 0, zlib.crc32(b"")))
    log = TitoLog(run.tito_log)  # reopening cuts the torn tail off
    assert log.tree("r").num_records == 4 and run.tito_log.stat().st_size == len(data)
    log.close()
    run.tito_log.write_bytes(data + b"GT\0\0\0\0garbage")
    shown = gyre("traj", "show", str(run.path))
    assert shown.returncode == 0 and "Traceback" not in shown.stderr
