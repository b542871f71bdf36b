"""A proxy of several worker processes: who owns a run, a worker that refuses another's run,
the control verbs behind their token, and the segments read as one log while they grow."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.proxy.keys import KeyRing
from gyre_hpc.proxy.run_shard import shard_of
from gyre_hpc.proxy.server import Proxy
from gyre_hpc.proxy.tito_log import TitoTail
from gyre_hpc.proxy.worker import ADMIN, admin_routes, share
from gyre_hpc.recipe.schema import ProxyConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.trajectory.codec import encode_frame
from gyre_hpc.trajectory.records import CallMeta, TitoRecord
from gyre_hpc.trajectory.tree import TrajectoryTree


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def test_a_run_has_one_owner_everywhere_and_the_runs_spread() -> None:
    runs = [f"s0001-smoke-1-{p}-g{g}" for p in range(16) for g in range(4)]
    assert all(shard_of(r, 1) == 0 for r in runs)
    counts = Counter(shard_of(r, 4) for r in runs)
    assert sorted(counts) == [0, 1, 2, 3] and min(counts.values()) >= 8  # 64 runs, no worker idle
    assert shard_of("s0001-smoke-1-0-g0", 4) == shard_of("s0001-smoke-1-0-g0", 4)
    assert [share(8, w) for w in (1, 2, 3, 4, 16)] == [8, 4, 3, 2, 1]


def test_a_worker_refuses_another_worker_s_run_and_takes_verbs_only_with_its_token(
    tiny: Path, tmp_path: Path
) -> None:
    keys = KeyRing.load(RunDir(tmp_path).proxy_secret)
    mine = next(f"r{i}" for i in range(100) if shard_of(f"r{i}", 2) == 1)
    other = next(f"r{i}" for i in range(100) if shard_of(f"r{i}", 2) == 0)

    async def scenario() -> None:
        proxy = Proxy(tmp_path, tiny, ["http://127.0.0.1:9"], ProxyConfig(), 4, worker=1, workers=2)
        app = proxy.app()
        admin_routes(app, proxy, "tok")
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        try:
            async with aiohttp.ClientSession() as http:
                headers = {"Authorization": f"Bearer {keys.mint(other, 'main')}"}
                async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    error = (await r.json())["error"]["message"]
                    assert r.status == 421 and error == f"run {other!r} is served by proxy worker 0, not 1"
                for token in (None, keys.mint(mine, "main"), "tok2"):  # an execution's key is no token
                    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
                    async with http.post(url + ADMIN + "hold", json={"urls": []}, headers=headers) as r:
                        assert r.status == 401
                slot = proxy.router.engines["http://127.0.0.1:9"]
                assert slot.admitting
                headers = {"Authorization": "Bearer tok"}
                async with http.post(url + ADMIN + "sampling", json={"urls": []}, headers=headers) as r:
                    assert r.status == 200 and not slot.admitting  # drained by the controller's verb
        finally:
            await runner.cleanup()
        # Its own segment: worker 1 writes tito-1.bin and chats-1.jsonl, never worker 0's.
        assert (tmp_path / "tito-1.bin").exists() and not (tmp_path / "tito.bin").exists()

    asyncio.run(scenario())


def record(run_id: str, n: int) -> TitoRecord:
    ids = np.arange(10 * n + 10, dtype=np.int32)
    return TitoRecord(run_id, f"call_{n}", "main", ids[:-3], ids[-3:], np.zeros(3, np.float32), CallMeta())


def test_the_segments_are_read_as_one_log_as_they_grow(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    writers = {0: TrajectoryTree("a"), 1: TrajectoryTree("b")}
    frames = {
        w: [encode_frame(writers[w].add(record(writers[w].run_id, n))) for n in range(3)] for w in writers
    }
    tail = TitoTail(run_dir.tito_segments)
    assert tail.update() == {}
    run_dir.tito_segment(0).write_bytes(frames[0][0] + frames[0][1][:7])  # a frame half written
    run_dir.tito_segment(1).write_bytes(b"".join(frames[1]))
    trees = tail.update()
    assert (trees["a"].num_records, trees["b"].num_records) == (1, 3)
    with run_dir.tito_segment(0).open("ab") as fh:
        fh.write(frames[0][1][7:] + frames[0][2])
    trees = tail.update()
    assert trees["a"].num_records == 3
    assert [r.call_id for r in trees["a"].records()] == ["call_0", "call_1", "call_2"]
    assert np.array_equal(trees["a"].record(2).input_ids, record("a", 2).input_ids)  # exact, across reads
    assert [p.name for p in run_dir.tito_segments()] == ["tito.bin", "tito-1.bin"]


def test_a_resumed_run_keeps_the_number_of_workers_that_wrote_its_log(tmp_path: Path) -> None:
    from gyre_hpc.errors import GyreError
    from gyre_hpc.proxy.worker import WorkerSpec
    from gyre_hpc.proxy.workers import check_same_workers

    run_dir = RunDir(tmp_path)
    check_same_workers(run_dir, 4)  # a new run: any number
    run_dir.tito_log.write_bytes(b"")
    check_same_workers(run_dir, 1)
    with pytest.raises(
        GyreError, match=r"written by 1 proxy worker\(s\): resume it with --set proxy.workers=1"
    ):
        check_same_workers(run_dir, 2)
    WorkerSpec("m", [], {}, 2, "t").write(run_dir.proxy_workers / "spec.json")
    check_same_workers(run_dir, 2)
    with pytest.raises(GyreError, match="proxy.workers=2"):
        check_same_workers(run_dir, 3)
