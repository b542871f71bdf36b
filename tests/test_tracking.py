"""What a user watches: TensorBoard and W&B fed from the step records (read back with their own
readers), the step's diagnostics, where each cell's time went, the plots (opened and looked at),
``status``, and output that survives a pipe."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, gyre

from gyre_hpc.observability import events as ev
from gyre_hpc.observability.cell_time import CATEGORIES, COLORS
from gyre_hpc.observability.events import EventLog, read_events
from gyre_hpc.observability.plot import SERIES
from gyre_hpc.observability.tracking import TensorBoard, Trackers, WandB, scalars
from gyre_hpc.rundir import RunDir


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in ``directory``, as TensorBoard itself reads it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_history(directory: Path) -> list[dict[str, float]]:
    """The history rows of the offline W&B run under ``directory``: its ``.wandb`` transaction
    log (a LevelDB-style log of 32 KiB blocks after a 7-byte header) parsed with W&B's own
    protocol buffers."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = directory.rglob("run-*.wandb")
    rows = []
    for record in _log_records(path.read_bytes()):
        r = pb.Record()
        r.ParseFromString(record)
        if r.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


def _log_records(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack_from("<IHB", data, pos)
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        parts = chunk if kind in (1, 2) else parts + chunk  # full, first │ middle, last
        if kind in (1, 4):
            yield parts


def drawn(png: Path, colors: dict[str, str]) -> dict[str, int]:
    """Pixels of each named series' colour in the image (a series drawn has many)."""
    from PIL import Image

    pixels = np.asarray(Image.open(png).convert("RGB")).reshape(-1, 3)
    out = {}
    for name, hex_color in colors.items():
        rgb = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)])
        out[name] = int((np.abs(pixels.astype(int) - rgb).max(axis=1) <= 2).sum())
    return out


def step(n: int, **kw: object) -> ev.Step:
    return ev.Step(step=n, version=n, seconds=10.0, sample_seconds=6.0, roles={}, **kw)  # type: ignore[arg-type]


def test_one_reducer_names_every_number_and_skips_what_was_not_measured() -> None:
    e = step(
        3, reward_mean=0.5, replies=10, cut_replies=2, group_count=4, no_signal_groups=1,
        calls_per_execution={"mean": 3.0, "p50": 2.0, "p90": 6.0, "max": 9.0},
        token_stats={"mismatch_mean": 0.001, "entropy": None},
        cell_seconds={"0": {"sampling": 4.0, "idle slots": 1.0}}, statuses={"finished": 7, "timed_out": 1},
        sampled_tokens=500, forwarded_tokens=300, train_seconds=3.0,
    )  # fmt: skip
    s = scalars(e)
    assert s["rollout/cut_share"] == 0.2 and s["rollout/no_signal_groups"] == 0.25
    assert s["rollout/calls_per_execution/p90"] == 6.0 and s["rollout/status/timed_out"] == 1
    assert s["train/mismatch_mean"] == 0.001 and "train/entropy" not in s  # not measured: not zero
    assert s["cells/0/idle_slots_s"] == 1.0
    assert s["perf/sampled_tokens_per_s"] == 50.0 and s["perf/trained_tokens_per_s"] == 100.0
    assert scalars(ev.Eval(step=0, version=0, n=4, statuses={}, pass_rate=0.25, mean_score=0.5)) == {
        "eval/pass_rate": 0.25, "eval/mean_score": 0.5
    }  # fmt: skip
    assert scalars(ev.Shutdown(reason="x")) == {}


def test_tensorboard_and_offline_wandb_get_the_same_scalars_and_a_failing_writer_is_dropped(
    tmp_path: Path,
) -> None:
    class Broken:
        def write(self, step: int, values: dict[str, float]) -> None:
            raise OSError("disk gone")

        def close(self) -> None:
            pass

    trackers = Trackers(
        [Broken(), TensorBoard(tmp_path / "tb"), WandB("gyre-test", "offline", tmp_path / "wb", "r", {})]
    )
    for n in (1, 2):
        trackers.record(step(n, reward_mean=n / 4, loss=-n))
    trackers.close()
    assert len(trackers.writers) == 2
    tb = tensorboard_scalars(tmp_path / "tb")
    assert tb["rollout/reward_mean"] == [(1, 0.25), (2, 0.5)] and tb["train/loss"] == [(1, -1.0), (2, -2.0)]
    rows = wandb_history(tmp_path / "wb")
    assert [r["rollout/reward_mean"] for r in rows] == [0.25, 0.5] and [r["_step"] for r in rows] == [1, 2]


def test_a_bad_tracker_setting_or_a_missing_wandb_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    bad = gyre("recipe", "check", "recipes/smoke.toml", "--set", "observability.wandb_mode=local")
    assert bad.returncode == 2 and 'valid values: "offline", "online"' in bad.stderr
    # An environment without the extra: to import machinery, wandb is not there.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    missing = gyre("run", "recipes/smoke.toml", "--set", "observability.wandb_project=p", env=env)
    assert missing.returncode == 2 and "pip install 'gyre-hpc[wandb]'" in missing.stderr
    assert "Traceback" not in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def watched_run(elastic_run: Path) -> RunDir:
    """The session's elastic run (``conftest.ELASTIC``: 2 steps, 3 cells, the warm-started tiny
    model on the embedded engine) with TensorBoard, offline W&B and a held-out evaluation before
    and after each step."""
    return RunDir(elastic_run)


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_a_run_s_trackers_hold_what_its_step_events_say(watched_run: RunDir) -> None:
    events = read_events(watched_run.events)
    steps = [e for e in events if isinstance(e, ev.Step)]
    evals = [e for e in events if isinstance(e, ev.Eval)]
    assert [e.step for e in evals] == [0, 1, 2]  # the held-out curve starts before any update
    tb = tensorboard_scalars(watched_run.tensorboard)
    assert [s for s, _ in tb["eval/pass_rate"]] == [0, 1, 2]
    names = ("train/loss", "rollout/reward_mean", "train/mismatch_mean", "rollout/calls_per_execution/p90",
             "perf/sampled_tokens_per_s", "cells/0/training_s", "perf/weight_bytes")  # fmt: skip
    for name in names:
        assert [s for s, _ in tb[name]] == [1, 2], name
        assert [v for _, v in tb[name]] == pytest.approx([scalars(e)[name] for e in steps], rel=1e-6), name
    history = [r for r in wandb_history(watched_run.wandb) if "rollout/reward_mean" in r]
    assert [r["rollout/reward_mean"] for r in history] == pytest.approx([e.reward_mean for e in steps])


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_a_run_s_diagnostics_are_measured_and_its_cells_time_fills_the_run(watched_run: RunDir) -> None:
    events = read_events(watched_run.events)
    steps = [e for e in events if isinstance(e, ev.Step)]
    for e in steps:
        assert (
            e.calls_per_execution["max"] >= e.calls_per_execution["p90"] >= e.calls_per_execution["p50"] >= 1
        )
        assert e.sampled_tokens == pytest.approx(e.tokens_per_execution["mean"] * e.executions, abs=1)
        assert e.replies >= e.calls and 0 <= e.cut_replies <= e.replies and e.group_count == 4
        ts = e.token_stats
        # The embedded engine scores with the trainer's own code: rollout and trainer agree.
        assert ts["mismatch_tokens"] > 0 and ts["mismatch_mean"] < 1e-3 and ts["mismatch_share"] == 0
        assert ts["entropy"] > 0 and ts["approx_kl"] >= 0 and 0 <= ts["clip_fraction"] <= 1
        assert e.weight_bytes > 0 and e.weight_seconds > 0
    # Each cell's categories fill each window; the windows tile the run from the fleet's start.
    ends = [e.cell_since for e in steps[1:]] + [steps[-1].t]
    for e, end in zip(steps, ends, strict=True):
        assert set(e.cell_seconds) == {"0", "1", "2"}
        for cell, split in e.cell_seconds.items():
            assert set(split) == set(CATEGORIES) and min(split.values()) >= 0
            assert sum(split.values()) == pytest.approx(end - e.cell_since, abs=0.05), (e.step, cell)
    trained = sum(e.cell_seconds[c]["training"] for e in steps for c in e.cell_seconds)
    assert trained > 0 and sum(e.cell_seconds[c]["sampling"] for e in steps for c in e.cell_seconds) > 0


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_a_run_s_plots_draw_every_named_series(watched_run: RunDir) -> None:
    from PIL import Image

    assert Image.open(watched_run.metrics_plot).size == (700, 550)
    assert min(drawn(watched_run.metrics_plot, SERIES).values()) > 30, drawn(watched_run.metrics_plot, SERIES)
    assert Image.open(watched_run.cells_plot).size[0] == 1100
    steps = [e for e in read_events(watched_run.events) if isinstance(e, ev.Step)]
    present = {w for e in steps for split in e.cell_seconds.values() for w, s in split.items() if s > 0.05}
    pixels = drawn(watched_run.cells_plot, {w: COLORS[w] for w in present})
    assert min(pixels.values()) > 30, pixels


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_status_shows_the_diagnostics_and_the_cell_time_whole_when_piped(watched_run: RunDir) -> None:
    proc = gyre(
        "status", str(watched_run.path), "--once", env={k: v for k, v in os.environ.items() if k != "COLUMNS"}
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "diagnostics" in out and "mismatch mean·max" in out and "where the cell time went" in out
    assert "…" not in out  # nothing cut to fit 80 columns
    assert max(len(line) for line in out.splitlines()) > 80


def test_result_tables_print_whole_when_piped_and_as_json_or_csv(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    table = gyre("bench", "sim", "--config", "smoke", "--out", str(tmp_path), env=env)
    assert table.returncode == 0, table.stderr
    assert "…" not in table.stdout and "total / on-policy bound" in table.stdout
    as_json = gyre("bench", "sim", "--config", "smoke", "--out", str(tmp_path), "--json", env=env)
    (result,) = [json.loads(line) for line in as_json.stdout.splitlines()]
    rows = {r["mode"]: r for r in result["rows"]}
    assert float(rows["elastic"]["total / bound"]) > 1 and "plot:" in as_json.stderr
    as_csv = gyre("bench", "sim", "--config", "smoke", "--out", str(tmp_path), "--csv", env=env)
    lines = as_csv.stdout.splitlines()
    assert (
        lines[0].startswith("# smoke:")
        and lines[1].startswith("mode,total h,")
        and len(lines) == 2 + len(rows)
    )
    both = gyre("bench", "sim", "--json", "--csv", env=env)
    assert both.returncode == 2 and "not both" in both.stderr


def test_plot_learning_draws_each_run_it_is_given(tmp_path: Path) -> None:
    import subprocess
    import sys

    from matplotlib.colors import to_hex

    for name, rate in (("a", 0.2), ("b", 0.6)):
        (tmp_path / name).mkdir()
        with EventLog(tmp_path / name / "events.jsonl") as log:
            for n in range(3):
                log.emit(step(n + 1, reward_mean=rate + n / 10, staleness_tokens={"0": 9, "1": n}))
                log.emit(
                    ev.Eval(step=n, version=n, n=4, statuses={}, pass_rate=rate + n / 20, mean_score=0.0)
                )
    out = tmp_path / "learning.png"
    tool = [sys.executable, str(REPO / "tools" / "plot_learning.py")]
    runs = [f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"]
    proc = subprocess.run([*tool, *runs, "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    pixels = drawn(out, {"a": to_hex("C0"), "b": to_hex("C1")})
    assert min(pixels.values()) > 30, pixels
