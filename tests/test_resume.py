"""What a restarted run keeps: intact checkpoints, the TITO log and chat index cut to the resumed
state, and the journalled executions that continue (runtime.resume, agents.journal)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_hpc.agents.journal import Journal
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.observability import events as ev
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.rundir import RunDir, checkpoint_recorded
from gyre_hpc.runtime import resume
from gyre_hpc.trainer import checkpoint
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trajectory.codec import read_records, write_records
from gyre_hpc.trajectory.records import CallMeta, EncodedRecord, TitoRecord
from gyre_hpc.trajectory.tree import TrajectoryTree


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("tiny") / "m")


def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path: Path, tiny: Path) -> None:
    trainer = TorchTrainer(tiny, TrainerConfig(), core=True)
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 1, trainer, tiny, tito_bytes=10)
    newest = checkpoint.save(root, 2, trainer, tiny, tito_bytes=20)
    assert checkpoint.newest_intact(root) == (newest, [])
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    path, skipped = checkpoint.newest_intact(root)
    assert path == root / "step-000001"
    assert len(skipped) == 1 and str(weights) in skipped[0] and "damaged" in skipped[0]
    (root / "step-000001" / "optimizer.pt").unlink()
    assert checkpoint.newest_intact(root)[0] is None  # nothing intact: the run starts afresh


def test_a_checkpoint_whose_manifest_is_torn_is_named_and_the_previous_one_used(
    tmp_path: Path, tiny: Path
) -> None:
    trainer = TorchTrainer(tiny, TrainerConfig(), core=True)
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 1, trainer, tiny)
    state = checkpoint.save(root, 2, trainer, tiny) / "state.json"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # its manifest, torn
    path, skipped = checkpoint.newest_intact(root)
    assert path == root / "step-000001"
    assert len(skipped) == 1 and skipped[0].startswith(f"{state}: unreadable"), skipped


def test_a_checkpoint_whose_step_was_never_recorded_is_passed_over(tmp_path: Path, tiny: Path) -> None:
    """The controller died after the core wrote step 2's checkpoint but before step 2's record:
    that checkpoint does not count (the controller and the core both pass over it), and step 2
    runs again, to be recorded once."""
    trainer = TorchTrainer(tiny, TrainerConfig(), core=True)
    root = tmp_path / "checkpoints"
    first = checkpoint.save(root, 1, trainer, tiny, awaits_record=True)
    checkpoint_recorded(first).touch()  # what the controller does after step 1's record
    checkpoint.save(root, 2, trainer, tiny, awaits_record=True)
    path, skipped = checkpoint.newest_intact(root)
    assert path == first and len(skipped) == 1 and "never recorded" in skipped[0]


def test_a_marked_checkpoint_whose_record_never_reached_the_event_log_counts_and_gives_it(
    tmp_path: Path, tiny: Path
) -> None:
    """The controller died between marking step 1's checkpoint (the record in the mark) and
    writing the record to the event log: the checkpoint counts (step 1 does not run again) and
    the resume hands back the record to write, once."""
    run_dir = RunDir(tmp_path)
    trainer = TorchTrainer(tiny, TrainerConfig(), core=True)
    path = checkpoint.save(run_dir.checkpoints, 1, trainer, tiny, awaits_record=True)
    record = ev.Step(step=1, version=1, seconds=3.0, sample_seconds=2.0, roles={"0": "sampling"})
    resume.mark_recorded(path, record)
    point = resume.prepare(run_dir)
    assert point.step == 1 and point.lost_record == record
    with ev.EventLog(run_dir.events) as log:
        log.emit(point.lost_record)
    assert resume.prepare(run_dir).lost_record is None  # in the log now: not written twice


def call(tree: TrajectoryTree, n: int, version: int = 0) -> EncodedRecord:
    """The next call of a linear conversation: the previous input + output, then new ids."""
    if tree.num_records:
        last = tree.record(tree.num_records - 1)
        prefix = [*last.input_ids, *last.output_ids]
    else:
        prefix = [1, 2]
    rec = TitoRecord(
        tree.run_id, f"c{n}", "main", prefix + [50 + n], [60 + n, 61 + n], [-0.5, -0.5], CallMeta(version)
    )
    return tree.add(rec)


def write_log(path: Path, calls: list[tuple[str, int]]) -> dict[str, TrajectoryTree]:
    trees: dict[str, TrajectoryTree] = {}
    for run, version in calls:
        tree = trees.setdefault(run, TrajectoryTree(run))
        write_records(path, [call(tree, tree.num_records, version)])
    return trees


def test_the_log_keeps_the_checkpoint_and_the_continued_executions_calls_only(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    # Step 1 (checkpointed at 2 records), then step 2: a finished execution (2 calls), one under
    # way journalled after 2 calls with a 3rd call answered but not journalled, and one whose
    # journal is gone.
    write_log(run_dir.tito_log, [("s1-a", 0), ("s1-a", 0)])
    size = run_dir.tito_bytes()
    write_log(
        run_dir.tito_log,
        [("s2-f", 1), ("s2-r", 1), ("s2-f", 1), ("s2-r", 1), ("s2-x", 1), ("s2-r", 1)],
    )
    (run_dir.checkpoints / "step-000001").mkdir(parents=True)
    (run_dir.checkpoints / "step-000001" / "state.json").write_text(
        json.dumps({"step": 1, "version": 1, "tito_bytes": size})
    )
    journal = Journal(run_dir.journal(2))
    journal.call("s2-r", 0, [{"role": "user", "content": "hi"}], 1, {}, 1.0)
    journal.call("s2-r", 1, [{"role": "assistant", "content": "a"}], 2, {}, 2.0)
    journal.call("s2-f", 0, [], 2, {}, 1.0)
    journal.finish("s2-f", {"calls": 2, "status": "finished"})
    Journal(run_dir.journal(1)).call("s1-a", 0, [], 2, {}, 1.0)  # trained already
    for run, record in [("s2-r", 1), ("s2-r", 2), ("s2-x", 0), ("s1-a", 1)]:
        with run_dir.chat_index.open("a") as fh:
            fh.write(json.dumps({"run": run, "record": record}) + "\n")

    point = resume.prepare(run_dir)

    assert (point.step, point.version, point.continued, point.kept_finished) == (2 - 1, 1, 1, 1)
    assert point.dropped_records == 2  # s2-r's unjournalled 3rd call and s2-x's call
    kept = [(r.run_id, r.index) for r in read_records(run_dir.tito_log).records]
    assert kept == [("s1-a", 0), ("s1-a", 1), ("s2-f", 0), ("s2-r", 0), ("s2-f", 1), ("s2-r", 1)]
    entries = [json.loads(line) for line in run_dir.chat_index.read_text().splitlines()]
    assert [(e["run"], e["record"]) for e in entries] == [("s2-r", 1), ("s1-a", 1)]
    assert not run_dir.journal(1).exists()
    loaded = journal.load("s2-r")
    assert loaded is not None and loaded.calls == 2 and [m["content"] for m in loaded.messages] == ["hi", "a"]


def test_an_execution_sampled_after_the_checkpoint_version_starts_afresh(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    write_log(run_dir.tito_log, [("s3-r", 2), ("s3-r", 3)])  # its second call saw version 3
    journal = Journal(run_dir.journal(3))
    journal.call("s3-r", 0, [], 2, {}, 1.0)
    (run_dir.checkpoints / "step-000002").mkdir(parents=True)
    (run_dir.checkpoints / "step-000002" / "state.json").write_text(
        json.dumps({"step": 2, "version": 2, "tito_bytes": 0})
    )
    point = resume.prepare(run_dir)
    assert (point.continued, point.dropped_records) == (0, 2)
    assert journal.load("s3-r") is None and run_dir.tito_bytes() == {"tito.bin": 0}


def test_with_no_checkpoint_the_log_is_emptied(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    write_log(run_dir.tito_log, [("s1-a", 0), ("s1-b", 0)])
    point = resume.prepare(run_dir)
    assert (point.step, point.dropped_records, run_dir.tito_bytes()) == (0, 2, {"tito.bin": 0})


def test_a_torn_journal_line_is_the_call_made_again(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.call("r", 0, [{"role": "user", "content": "a"}], 1, {"tokens": 5}, 1.0)
    journal.call("r", 1, [{"role": "assistant", "content": "b"}], 2, {"tokens": 9}, 2.0)
    with journal.file("r").open("ab") as fh:
        fh.write(b'{"keep":2,"add":[{"ro')
    entry = journal.load("r")
    assert entry is not None and entry.calls == 2 and entry.counters == {"tokens": 9}
    journal.call("r", 0, [{"role": "user", "content": "summary"}], 3, {}, 3.0)  # after a compaction
    again = journal.load("r")
    assert (
        again is not None and again.calls == 3 and again.messages == [{"role": "user", "content": "summary"}]
    )
