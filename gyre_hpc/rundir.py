"""The run directory: everything a run leaves, on storage every node and the login node see.

```
runs/<name>-<YYYYmmdd-HHMMSS>/
  recipe.toml     the resolved recipe as created (every key, documented; never rewritten)
  resumes.jsonl   each resume: when, by which launcher, the overrides it gave (applied in order)
  events.jsonl    what happened, one JSON record per line (observability.events)
  tito.bin        every model call's exact token ids, delta-encoded (trajectory.codec);
                  tito-<n>.bin: proxy worker n's runs, when proxy.workers > 1
  proxy.secret    signs the per-execution API keys (proxy.keys)
  chats.jsonl     the proxy's chat index: served transcripts by digest (proxy.server.ChatIndex);
                  chats-<n>.jsonl: proxy worker n's
  proxy/          spec.json, worker-<n>.json: the proxy workers' brief and addresses (proxy.worker)
  executions.jsonl, eval.json   ``gyre-hpc eval``: every execution and its score; the summary
  checkpoints/    step-NNNNNN/: a Hugging Face model directory + optimizer state + state.json
                  (.tmp-step-NNNNNN/ while it is written)
  journal/        step-NNNN/<run>.jsonl: each execution after every call (agents.journal)
  requeue         left by a preempted run under Slurm: the batch script requeues the job
  metrics.png     reward and pass rate per step (observability.plot)
  workspaces/     step-NNNN/<run>/: each execution's working directory
  tasks/          files the tasks' verifiers use
  engines/        unit-<n>[-replica-<r>][-part-<p>]/: an SGLang server's log (and weights it
                  loads from disk)
  executors/      hub.json: where executor nodes find the controller (executors.job.HubAddress)
  job.json        how it was launched: local mpirun or the Slurm job id (job.sbatch: the script
                  a Slurm launch submitted)
  logs/           mpirun.log or slurm.out (the launcher's), rank-<N>.log, executor-<node>.log,
                  proxy-worker-<n>.log, executions/ (a black-box harness's output per run)
  ranks/          rank-<N>.json: pid, host, role of every rank (written when it starts);
                  rank-<N>.exit: its exit code (written as it ends)
```

``status``, ``bench`` and plots read only this directory, never a live process; every module
reaches these files through ``RunDir`` (and a checkpoint's through ``checkpoint_dir``), so their
names are written once, here (``tests/test_rundir.py`` greps the package for them).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_hpc.errors import GyreError
from gyre_hpc.observability.events import Event, read_events
from gyre_hpc.recipe import Recipe, load_recipe, to_toml


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def create(cls, runs_dir: str | Path, name: str, now: float | None = None) -> RunDir:
        """A new, empty run directory ``<runs_dir>/<name>-<time>`` (suffixed if taken)."""
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        base = Path(runs_dir).resolve() / f"{name}-{stamp}"
        path, n = base, 1
        while True:
            try:
                path.mkdir(parents=True)
                break
            except FileExistsError:
                n += 1
                path = base.with_name(f"{base.name}.{n}")
        run = cls(path)
        run.logs.mkdir()
        run.ranks.mkdir()
        return run

    @classmethod
    def under(cls, runs_dir: Path) -> list[RunDir]:
        """The run directories directly under ``runs_dir`` that have an event log or a launch
        record, oldest (by their event log, else their record) first."""
        found = {p.parent for name in ("events.jsonl", "job.json") for p in runs_dir.glob(f"*/{name}")}
        runs = [cls(p) for p in found]
        return sorted(runs, key=lambda r: (r.events if r.events.exists() else r.job_path).stat().st_mtime)

    @classmethod
    def enclosing(cls, path: Path) -> RunDir | None:
        """The run directory ``path`` lies in (a workspace an execution left), if any."""
        for parent in path.parents:
            if cls(parent).recipe_path.exists() and cls(parent).workspaces.is_dir():
                return cls(parent)
        return None

    def missing(self) -> str | None:
        """What makes this no run directory (one line), or None."""
        if self.recipe_path.exists():
            return None
        return f"{self.path} is not a run directory (no {self.recipe_path.name})"

    @property
    def recipe_path(self) -> Path:
        return self.path / "recipe.toml"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def tito_log(self) -> Path:
        """Every model call of every execution, as checksummed encoded records (trajectory.codec);
        with ``proxy.workers`` > 1, worker 0's segment (``tito_segment``)."""
        return self.path / "tito.bin"

    def tito_segment(self, worker: int) -> Path:
        """Proxy worker ``worker``'s part of the TITO log: the records of the runs it owns."""
        return self.tito_log if worker == 0 else self.path / f"tito-{worker}.bin"

    def tito_segments(self) -> list[Path]:
        """Every segment of the TITO log there is, worker 0's first: together, one log."""
        more = sorted(self.path.glob("tito-*.bin"), key=lambda p: int(p.stem.split("-")[1]))
        return [self.tito_log, *more] if self.tito_log.exists() else more

    def tito_bytes(self) -> dict[str, int]:
        """Each segment's size: every call answered so far is in them (written before the reply)."""
        return {p.name: p.stat().st_size for p in self.tito_segments()}

    @property
    def chat_index(self) -> Path:
        """Per served chat call, what the proxy needs to extend its ids exactly after a restart."""
        return self.path / "chats.jsonl"

    def chat_index_segment(self, worker: int) -> Path:
        """Proxy worker ``worker``'s chat index."""
        return self.chat_index if worker == 0 else self.path / f"chats-{worker}.jsonl"

    def chat_index_segments(self) -> list[Path]:
        """Every chat index there may be, worker 0's first."""
        more = sorted(self.path.glob("chats-*.jsonl"), key=lambda p: int(p.stem.split("-")[1]))
        return [self.chat_index, *more]

    @property
    def proxy_workers(self) -> Path:
        """``worker-<n>.json``: where each proxy worker listens; ``spec.json``: what they serve."""
        return self.path / "proxy"

    @property
    def proxy_spec(self) -> Path:
        """What every proxy worker serves (``proxy.worker.WorkerSpec``)."""
        return self.proxy_workers / "spec.json"

    def proxy_worker(self, index: int) -> Path:
        """Where proxy worker ``index`` says it listens, once it does."""
        return self.proxy_workers / f"worker-{index}.json"

    def proxy_worker_files(self) -> list[Path]:
        """Every proxy worker's address file there is (a previous world's, before a start)."""
        return sorted(self.proxy_workers.glob("worker-*.json"))

    def proxy_worker_log(self, index: int) -> Path:
        return self.logs / f"proxy-worker-{index}.log"

    @property
    def proxy_secret(self) -> Path:
        """The key the proxy signs per-execution API keys with (mode 600)."""
        return self.path / "proxy.secret"

    @property
    def checkpoints(self) -> Path:
        """``step-NNNNNN/`` directories the core writes (trainer.checkpoint)."""
        return self.path / "checkpoints"

    @property
    def metrics_plot(self) -> Path:
        return self.path / "metrics.png"

    @property
    def cells_plot(self) -> Path:
        """Where each cell's time went, per step and in total (``observability.plot.plot_cells``)."""
        return self.path / "cells.png"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.path / "wandb"

    @property
    def workspaces(self) -> Path:
        return self.path / "workspaces"

    def step_workspaces(self, step: int) -> Path:
        """The workspaces of one step's executions (and of its held-out evaluation)."""
        return self.workspaces / f"step-{step:04d}"

    @property
    def journals(self) -> Path:
        return self.path / "journal"

    def journal(self, step: int) -> Path:
        """The execution journal of one step (``agents.journal``): what a restart continues."""
        return self.journals / f"step-{step:04d}"

    def journalled_steps(self) -> dict[int, Path]:
        """Step → its journal, for every step that has one."""
        return {int(d.name.removeprefix("step-")): d for d in sorted(self.journals.glob("step-*"))}

    @property
    def engines(self) -> Path:
        """Engine processes' files (an SGLang server's log, weights it loads from disk)."""
        return self.path / "engines"

    @property
    def fault_markers(self) -> Path:
        """``POINT@RANK`` files: the faults a test armed that happened (``faults.points``)."""
        return self.path / "faults"

    @property
    def executor_hub(self) -> Path:
        """Where executor nodes find the controller's hub (``executors.job.HubAddress``)."""
        return self.path / "executors" / "hub.json"

    @property
    def task_files(self) -> Path:
        return self.path / "tasks"

    @property
    def executions(self) -> Path:
        """``gyre-hpc eval``: every execution and its score, one JSON object per line."""
        return self.path / "executions.jsonl"

    @property
    def eval_summary(self) -> Path:
        """``gyre-hpc eval``: the summary it printed."""
        return self.path / "eval.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def launcher_log(self) -> Path:
        """What ``mpirun`` printed (a local run)."""
        return self.logs / "mpirun.log"

    @property
    def slurm_out(self) -> Path:
        """The batch script's output (``--output``; never ``%j``: it expands per het component)."""
        return self.logs / "slurm.out"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def executor_log(self, node: str) -> Path:
        """An executor node's log, and a local executor process's output."""
        return self.logs / f"executor-{node}.log"

    @property
    def execution_logs(self) -> Path:
        """A black-box harness's output, one file per execution."""
        return self.logs / "executions"

    @property
    def ranks(self) -> Path:
        return self.path / "ranks"

    @property
    def job_path(self) -> Path:
        return self.path / "job.json"

    @property
    def job_script(self) -> Path:
        """The sbatch script a Slurm launch submitted (``launch.submit``)."""
        return self.path / "job.sbatch"

    @property
    def requeue_flag(self) -> Path:
        """Left by a preempted run (the step it checkpointed): the sbatch script requeues the job."""
        return self.path / "requeue"

    def request_requeue(self, step: int) -> None:
        self.requeue_flag.write_text(f"{step}\n")

    @property
    def resumes(self) -> Path:
        """One JSON line per resume of the run: when, how, and the overrides it gave."""
        return self.path / "resumes.jsonl"

    def write_recipe(self, recipe: Recipe) -> None:
        """The recipe as the run was created with; never rewritten (resumes add overrides)."""
        self.recipe_path.write_text(to_toml(recipe))

    def add_resume(self, overrides: list[str], launcher: str) -> None:
        line = {"t": round(time.time(), 3), "launcher": launcher, "overrides": overrides}
        with self.resumes.open("a") as fh:
            fh.write(json.dumps(line) + "\n")

    def overrides(self) -> list[str]:
        """Every override given at a resume, in order."""
        try:
            lines = self.resumes.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [o for line in lines if line.strip() for o in json.loads(line)["overrides"]]

    def read_recipe(self) -> Recipe:
        """The recipe in force: as created, then each resume's overrides."""
        return load_recipe(self.recipe_path, self.overrides())

    def read_events(self) -> list[Event]:
        return read_events(self.events)

    def write_job(self, **info: Any) -> None:
        self.job_path.write_text(json.dumps(info, indent=1) + "\n")

    def read_job(self) -> dict[str, Any]:
        try:
            return json.loads(self.job_path.read_text())
        except FileNotFoundError:
            return {}

    def write_rank(self, rank: int, **info: Any) -> None:
        (self.ranks / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, **info}) + "\n")

    def write_exit(self, rank: int, code: int) -> None:
        """A rank's exit code, left as it ends (the sbatch script watches for ``*.exit``)."""
        (self.ranks / f"rank-{rank}{EXIT}").write_text(f"{code}\n")

    def read_ranks(self) -> list[dict[str, Any]]:
        out = []
        for p in sorted(self.ranks.glob("rank-*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except json.JSONDecodeError:  # a rank killed while writing
                continue
        return sorted(out, key=lambda r: r["rank"])


EXIT = ".exit"
"""The suffix of a rank's exit-code file in ``ranks/``."""


def checkpoint_dir(root: Path, step: int, writing: bool = False) -> Path:
    """Checkpoint ``step`` under ``root`` (``RunDir.checkpoints``); ``writing``: where it is
    written first, renamed into place once whole (``newest_intact`` never sees it)."""
    return root / f"{'.tmp-' if writing else ''}step-{step:06d}"


def checkpoint_dirs(root: Path) -> list[Path]:
    """Every whole checkpoint under ``root``, newest first (the ones with their state)."""
    return sorted((p for p in root.glob("step-*") if checkpoint_state(p).exists()), reverse=True)


def checkpoint_state(path: Path) -> Path:
    """A checkpoint's ``state.json``: step, version and what the run stored with it."""
    return path / "state.json"


def checkpoint_optimizer(path: Path, rank: int | None = None) -> Path:
    """A checkpoint's optimizer state: ``optimizer.pt`` (a trainer of one rank), or that of rank
    ``rank`` of a replica (``optimizer-rank-<r>.pt``, ``trainer.state_files``)."""
    return path / ("optimizer.pt" if rank is None else f"optimizer-rank-{rank}.pt")


def checkpoint_optimizer_ranks(path: Path) -> list[Path]:
    """A checkpoint's per-rank optimizer files, in rank order."""
    found = path.glob("optimizer-rank-*.pt")
    return sorted(found, key=lambda p: int(p.stem.rsplit("-", 1)[1]))


SHARDS = "megatron"
"""A checkpoint's folder of weight shards, apart from the Hugging Face files that loaders glob."""


def checkpoint_shard(path: Path, stage: int, tp_rank: int) -> Path:
    """The weights a replica's rank of pipeline stage ``stage`` and tensor-parallel rank
    ``tp_rank`` holds, in Megatron's names (``trainer.weight_shards``): written by that rank."""
    return path / SHARDS / f"stage-{stage}-tp-{tp_rank}.safetensors"


def checkpoint_shards(path: Path) -> dict[tuple[int, int], Path]:
    """A checkpoint's weight shards by (stage, TP rank); empty for one written whole."""
    return _stage_files(path, "tp")


def _stage_files(path: Path, axis: str) -> dict[tuple[int, int], Path]:
    """``stage-<s>-<axis>-<r>.safetensors`` in a checkpoint's shards, by (s, r)."""
    out = {}
    for f in (path / SHARDS).glob(f"stage-*-{axis}-*.safetensors"):
        _, stage, _, rank = f.name.removesuffix(".safetensors").split("-")
        out[int(stage), int(rank)] = f
    return dict(sorted(out.items()))


def checkpoint_expert_shard(path: Path, stage: int, expert_rank: int) -> Path:
    """The routed experts an expert-parallel rank of pipeline stage ``stage`` holds, where a
    replica splits them (``trainer.ep_size`` > 1; else they are in each TP rank's shard)."""
    return path / SHARDS / f"stage-{stage}-ep-{expert_rank}.safetensors"


def checkpoint_expert_shards(path: Path) -> dict[tuple[int, int], Path]:
    """A checkpoint's expert shards by (stage, expert-parallel rank); empty where none were split."""
    return _stage_files(path, "ep")


def checkpoint_recorded(path: Path) -> Path:
    """A checkpoint's mark that its step was recorded (``awaits_record`` in its state); it holds
    the step's record (``runtime.resume.mark_recorded``)."""
    return path / "recorded"


def engine_part_dir(engines: Path, unit: int, replica: int, node_rank: int) -> Path:
    """Where an engine part keeps its log: ``unit-0``, ``unit-0-replica-1``, ``unit-0-part-1`` (a
    part across nodes that is not its replica's head: emulated nodes share one file system)."""
    name = f"unit-{unit}" if replica == 0 else f"unit-{unit}-replica-{replica}"
    return engines / (name if node_rank == 0 else f"{name}-part-{node_rank}")


def find_run(target: str | None, runs_dir: Path) -> tuple[RunDir | None, str | None]:
    """(run directory, job id) for a run directory, a Slurm job id, or nothing (the newest run
    under ``runs_dir``); a ``GyreError`` for anything else."""
    if target is None:
        runs = [r for r in RunDir.under(runs_dir) if r.events.exists()]
        if not runs:
            raise GyreError(f"no runs in {runs_dir}/; give a run directory or a job id")
        run_dir = runs[-1]
        return run_dir, run_dir.read_job().get("job_id")
    if Path(target).is_dir():
        run_dir = RunDir(Path(target))
        if not run_dir.events.exists() and not run_dir.recipe_path.exists():
            raise GyreError(
                f"{target} is not a run directory (no {run_dir.events.name} or {run_dir.recipe_path.name})"
            )
        return run_dir, run_dir.read_job().get("job_id")
    if target.isdigit():
        for run_dir in RunDir.under(runs_dir):
            if str(run_dir.read_job().get("job_id")) == target:
                return run_dir, target
        return None, target
    raise GyreError(f"{target!r} is neither a run directory nor a Slurm job id")
