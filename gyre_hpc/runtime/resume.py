"""What a restarted run keeps: the state it resumes, made consistent before anything starts.

```
 checkpoints/  newest intact step-N (digests checked; a damaged one is named and skipped)
                 └─▶ step N, version v, tito_bytes b (per segment)
 tito.bin      [0, b) kept as is ─┬─ records after b: kept only as the first `calls` records of an
 (tito-<n>.bin alike)             │  execution journalled in a step after N, all sampled at ≤ v
 chats.jsonl   entries of records no longer in the log dropped (chats-<n>.jsonl alike)
 journal/      step ≤ N: trained, removed; an execution not kept: forgotten (it starts afresh)
```

Run by the controller before the proxy opens the log, whatever the launcher: a local restart, a
Slurm requeue or ``--resume``. Every record it keeps is one a continued execution's next call
extends, so the trees of the resumed step are the ones a run without the restart would have
built; nothing of an abandoned call remains to be trained.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from gyre_hpc.agents.journal import Journal
from gyre_hpc.observability import events as ev
from gyre_hpc.rundir import RunDir, checkpoint_recorded
from gyre_hpc.trainer import checkpoint
from gyre_hpc.trajectory.codec import encode_frame, read_frames


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    step: int = 0
    """The last step the resumed state includes (0: none; the run starts at step 1)."""
    version: int = 0
    checkpoint: str = ""
    skipped: list[str] = field(default_factory=list)
    """Damaged newer checkpoints, one line each naming the file."""
    continued: int = 0
    """Journalled executions that continue from their last call."""
    kept_finished: int = 0
    """Journalled executions that had finished: their outcomes are used as they are."""
    dropped_records: int = 0
    """TITO records cut off: calls of steps sampled again, and abandoned calls."""
    lost_record: ev.Step | None = None
    """The resumed checkpoint's step record where the event log lacks it (the controller died
    between marking the checkpoint and writing the record): the controller writes it now."""


def prepare(run_dir: RunDir) -> ResumePoint:
    path, skipped = checkpoint.newest_intact(run_dir.checkpoints)
    state = checkpoint.read_state(path) if path is not None else {}
    step, version = int(state.get("step", 0)), int(state.get("version", 0))
    sizes = state.get("tito_bytes", 0)
    if not isinstance(sizes, dict):  # a checkpoint of before the log had segments
        sizes = {run_dir.tito_log.name: int(sizes)}
    journals = _journals(run_dir, step)
    wanted = {run: (j, e.calls if e.outcome is None else int(e.outcome["calls"]), e.outcome is not None)
              for j in journals for run in j.run_ids() if (e := j.load(run)) is not None}  # fmt: skip
    calls = {r: w[1] for r, w in wanted.items()}
    kept: dict[str, int] = {}
    dropped = 0
    for segment in run_dir.tito_segments():  # each proxy worker's runs: cut alike, runs never shared
        got, lost = _cut_log(segment, int(sizes.get(segment.name, 0)), calls, version)
        kept.update(got)
        dropped += lost
    for index in run_dir.chat_index_segments():
        _cut_chat_index(index, kept)
    continued = finished = 0
    for run, (journal, calls, done) in wanted.items():
        if kept.get(run, 0) == calls:
            finished += done
            continued += not done
        else:
            journal.forget(run)  # its records are gone (or never matched): it starts afresh
    return ResumePoint(
        step=step,
        version=version,
        checkpoint=str(path or ""),
        skipped=skipped,
        continued=continued,
        kept_finished=finished,
        dropped_records=dropped,
        lost_record=_lost_record(run_dir, path, step),
    )


def mark_recorded(checkpoint: Path, record: ev.Step) -> None:
    """From now on ``checkpoint`` counts: a resume starts after its step. The step's record goes
    into the mark, whole (renamed into place), before it goes into the event log, so a controller
    that dies between the two leaves a record ``prepare`` finds (``lost_record``) rather than a
    recorded step that would run again."""
    mark = checkpoint_recorded(checkpoint)
    tmp = mark.with_name(mark.name + ".tmp")
    tmp.write_text(json.dumps({"event": ev.kind_of(record), **record.fields()}))
    os.replace(tmp, mark)


def _lost_record(run_dir: RunDir, checkpoint: Path | None, step: int) -> ev.Step | None:
    if checkpoint is None or any(isinstance(e, ev.Step) and e.step == step for e in run_dir.read_events()):
        return None
    try:
        record = ev.parse(json.loads(checkpoint_recorded(checkpoint).read_text()))
    except (OSError, ValueError, AttributeError):
        return None  # a checkpoint of before steps were marked, or one that never awaited its record
    return record if isinstance(record, ev.Step) and record.step == step else None


def _journals(run_dir: RunDir, step: int) -> list[Journal]:
    """The journals of steps after ``step``; those of steps already trained are removed."""
    out = []
    for s, d in run_dir.journalled_steps().items():
        if s <= step:
            shutil.rmtree(d, ignore_errors=True)
        else:
            out.append(Journal(d))
    return out


def _cut_log(path: Path, keep_bytes: int, calls: dict[str, int], version: int) -> tuple[dict[str, int], int]:
    """Cut the TITO log to ``keep_bytes`` plus each journalled run's first ``calls`` records
    (a run with a record sampled after ``version`` keeps none of them). Returns every run's
    records now in the log, and how many were dropped."""
    data = path.read_bytes() if path.exists() else b""
    head = read_frames(data[:keep_bytes]).records
    after = read_frames(data[keep_bytes:])
    tail = after.records
    kept: dict[str, int] = {}
    for r in head:
        kept[r.run_id] = kept.get(r.run_id, 0) + 1
    ours = [r for r in tail if r.index < calls.get(r.run_id, 0)]
    stale = {r.run_id for r in ours if r.meta.policy_version > version}
    ours = [r for r in ours if r.run_id not in stale]
    for r in ours:
        kept[r.run_id] = kept.get(r.run_id, 0) + 1
    dropped = len(tail) - len(ours)
    if dropped or after.torn_bytes:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data[:keep_bytes] + b"".join(encode_frame(r) for r in ours))
        os.replace(tmp, path)
    return kept, dropped


def _cut_chat_index(path: Path, kept: dict[str, int]) -> None:
    if not path.exists():
        return
    lines = []
    for line in path.read_bytes().splitlines():
        try:
            entry = json.loads(line)
            if entry["record"] < kept.get(entry["run"], 0):
                lines.append(line + b"\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn last line
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(lines))
    os.replace(tmp, path)
