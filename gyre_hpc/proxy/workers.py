"""The controller's side of a proxy of several processes (``proxy.workers`` > 1).

Starts the workers (``proxy.worker``), tells each its share of every engine's admission limit,
sends the router verbs to all of them at once, and reads the runs' trees from their TITO
segments as one log (``proxy.tito_log.TitoTail``): every call a harness saw answered is on disk
in its worker's segment, so the trees read here are the ones a single proxy would hold.

It knows nothing of which run a worker owns beyond ``run_shard``; the executions are told
their own worker's URL (``agents.external.Endpoint.workers``).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from gyre_hpc.errors import GyreError
from gyre_hpc.launch.orphans import die_with_parent
from gyre_hpc.proxy.tito_log import TitoTail
from gyre_hpc.proxy.worker import ADMIN, WorkerSpec, share
from gyre_hpc.rundir import RunDir
from gyre_hpc.trajectory.tree import TrajectoryTree

UP_S = 120.0
"""How long the workers may take to listen (each loads the tokenizer)."""


def check_same_workers(run_dir: RunDir, workers: int) -> None:
    """A resumed run keeps the number of proxy workers its TITO log was written by: a run's
    records are in the segment of its shard, and another count would send it elsewhere."""
    spec = run_dir.proxy_spec
    if spec.exists():
        before: int | None = WorkerSpec.read(spec).workers
    else:
        before = 1 if run_dir.tito_log.exists() else None
    if before is not None and before != workers:
        raise GyreError(
            f"proxy.workers = {workers}, but this run's TITO log was written by {before} proxy "
            f"worker(s): resume it with --set proxy.workers={before}"
        )


def last_words(log_path: Path) -> str:
    """A worker's own reason for ending, where it printed one (``proxy.worker``), as ``: …``."""
    try:
        with log_path.open("rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - 4096))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    said = [line for line in lines if line.startswith("proxy worker ")]
    return ": " + said[-1].split(": ", 1)[1] if said else ""


class ProxyWorkers:
    def __init__(
        self,
        run_dir: RunDir,
        model_dir: Path,
        limits: dict[str, int],
        workers: int,
        python: str = sys.executable,
        faults: tuple[str, ...] = (),
    ) -> None:
        """``limits``: calls in flight each engine admits in all (split among the workers);
        ``faults``: the fault points a test armed (``faults.points``)."""
        self.run_dir, self.model_dir, self.limits, self.n, self.python = (
            run_dir,
            model_dir,
            limits,
            workers,
            python,
        )
        self.faults = faults
        self.stopping = False
        self.token = secrets.token_urlsafe(24)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self.tail = TitoTail(self.run_dir.tito_segments)
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> list[str]:
        """Start every worker; their URLs, by index, once all listen."""
        for old in self.run_dir.proxy_worker_files():
            old.unlink()  # a previous world's
        engines = list(self.limits)
        per_worker = {url: share(limit, self.n) for url, limit in self.limits.items()}
        WorkerSpec(str(self.model_dir), engines, per_worker, self.n, self.token, list(self.faults)).write(
            self.run_dir.proxy_spec
        )
        for i in range(self.n):
            with self.run_dir.proxy_worker_log(i).open("ab") as log:
                self.procs.append(
                    subprocess.Popen(
                        [self.python, "-m", "gyre_hpc.proxy.worker", str(self.run_dir.path), str(i)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        preexec_fn=die_with_parent,
                    )
                )
        deadline = time.monotonic() + UP_S
        for i, proc in enumerate(self.procs):
            where = self.run_dir.proxy_worker(i)
            while not where.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    log_path = self.run_dir.proxy_worker_log(i)
                    raise GyreError(f"proxy worker {i} did not start (exit {proc.poll()}); see {log_path}")
                await asyncio.sleep(0.05)
            self.urls.append(json.loads(where.read_text())["url"])
        self._http = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"})
        return self.urls

    def check(self) -> None:
        """Raise if a worker died. Its runs' calls cannot be served, and its TITO segment and
        chat index are its own: the controller fails, and the restarted world resumes the runs
        from their journals (a call answered but not yet journalled is made again). Any thread."""
        for i, proc in enumerate(self.procs):
            if not self.stopping and (code := proc.poll()) is not None:
                log_path = self.run_dir.proxy_worker_log(i)
                raise GyreError(f"proxy worker {i} died (exit {code}){last_words(log_path)}; see {log_path}")

    async def _all(self, verb: str, body: dict[str, object]) -> list[Any]:
        """The verb on every worker at once, and what each answered; a worker that refuses it
        fails the run."""
        assert self._http is not None

        async def one(url: str) -> Any:
            async with self._http.post(url + ADMIN + verb, json=body) as resp:  # type: ignore[union-attr]
                if resp.status != 200:
                    raise GyreError(f"proxy worker {url}: {verb} answered {resp.status}: {await resp.text()}")
                return await resp.json()

        return list(await asyncio.gather(*(one(u) for u in self.urls)))

    async def occupancy(self) -> dict[str, float]:
        """Busy slot-seconds per engine over every worker (each holds a share of its slots)."""
        total: dict[str, float] = {}
        for answer in await self._all("occupancy", {}):
            for url, seconds in answer.items():
                total[url] = total.get(url, 0.0) + seconds
        return total

    async def set_sampling(self, urls: set[str], drain_mode: str) -> None:
        await self._all("sampling", {"urls": sorted(urls), "drain_mode": drain_mode})

    async def hold(self, urls: set[str]) -> None:
        await self._all("hold", {"urls": sorted(urls)})

    async def loaded(self, urls: set[str], version: int) -> None:
        await self._all("loaded", {"urls": sorted(urls), "version": version})

    def trees(self, run_ids: list[str]) -> dict[str, TrajectoryTree]:
        trees = self.tail.update()
        return {r: trees[r] for r in run_ids if r in trees}

    def usage(self, run_id: str) -> tuple[int, int]:
        """Calls recorded for ``run_id``, and the tokens they processed (as ``Proxy.usage``)."""
        tree = self.tail.update().get(run_id)
        if tree is None:
            return 0, 0
        records = [tree.record(i) for i in range(tree.num_records)]
        return len(records), sum(len(r.input_ids) + len(r.output_ids) for r in records)

    async def stop(self, grace_s: float) -> None:
        self.stopping = True
        if self._http is not None:
            await self._http.close()
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
