"""An engine serves only current weights: the router admits an engine at the version it holds,
a load splits the calls running across it into segments of one version each, and no call reuses
keys/values computed by other weights (the embedded engine here; real SGLang in test_sglang)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web
from conftest import flat_of, recomputed

from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.sampling import SamplingParams
from gyre_hpc.engines.server import make_app
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.flat import FlatLayout
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.proxy.router import EngineSlot, Router
from gyre_hpc.trajectory.records import CallMeta

PROMPT = [5, 17, 33, 2, 9, 41]
LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}  # long: the hold lands mid-call


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def weights(tiny: Path, seed: int) -> tuple[CausalLM, torch.Tensor]:
    """The tiny model moved by a seeded perturbation, and its flat buffer."""
    model = CausalLM.from_pretrained(tiny)
    flat = flat_of(model)
    flat = flat + torch.from_numpy(np.random.RandomState(seed).randn(flat.numel()).astype(np.float32)) * 0.05
    FlatLayout.of(model.config).load(model, flat)
    return model, flat


async def serve(engine: Engine, port: int = 0, seen: Counter[str] | None = None) -> tuple[web.AppRunner, str]:
    """The engine's HTTP server; ``seen`` counts the requests it answers, by path."""
    app = make_app(engine)
    if seen is not None:

        @web.middleware
        async def count(request: web.Request, handler):  # noqa: ANN001, ANN202
            seen[request.path] += 1
            return await handler(request)

        app.middlewares.append(count)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def until(predicate, timeout: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_restarted_engine_gets_no_call_until_it_holds_the_version_last_loaded(tiny: Path) -> None:
    """A server that comes back after a failure holds its initial weights (version 0): the call
    that failed there waits, and is served only once the engine reports the version it had."""
    _, flat = weights(tiny, 3)

    async def go() -> tuple[str, list[tuple[int, int]], int]:
        engine = Engine(tiny).start()
        engine.load_flat(flat, "3")
        runner, url = await serve(engine)
        port = int(url.rsplit(":", 1)[1])
        router = Router([EngineSlot(url, 4)], timeout_s=60, retry_down_s=0.0)
        await router.loaded(url, 3)
        try:
            await runner.cleanup()  # the server dies
            call = asyncio.ensure_future(router.complete("r", PROMPT, {"max_new_tokens": 4}))
            await until(lambda: router.engines[url].version is None)  # it failed there
            engine.stop()
            fresh = Engine(tiny).start()  # a restarted server: its initial weights
            fresh.weight_version = "0"
            seen: Counter[str] = Counter()
            runner, _ = await serve(fresh, port, seen)
            await until(lambda: seen["/get_model_info"] >= 2)  # asked twice what it holds: version 0
            assert not call.done() and fresh.stats["generated_tokens"] == 0
            served_at_zero = fresh.stats["generated_tokens"]
            fresh.load_flat(flat, "3")  # the cell loads the version it had
            done = await asyncio.wait_for(call, 60)
            return done.weight_version, done.segments, served_at_zero
        finally:
            await router.close()
            await runner.cleanup()
            fresh.stop()

    version, segments, at_zero = asyncio.run(go())
    assert version == "3" and segments == [(4, 3)] and at_zero == 0


def test_a_load_splits_a_running_call_into_one_segment_per_version(tiny: Path) -> None:
    """``hold`` stops the engine's calls where they are; after the load each goes on from its
    partial output at the new version: its parts are tagged with the versions that generated
    them, and the new part's log-probs are the new weights', computed afresh (no reused KV)."""
    new_model, new_flat = weights(tiny, 5)

    async def go() -> tuple[list[int], list[float], list[tuple[int, int]]]:
        engine = Engine(tiny).start()
        engine.weight_version = "0"
        runner, url = await serve(engine)
        router = Router([EngineSlot(url, 4)], timeout_s=60)
        await router.loaded(url, 0)
        try:
            call = asyncio.ensure_future(router.complete("r", PROMPT, LONG))
            await until(lambda: any(len(s.output_ids) >= 6 for s in engine.running))
            assert await router.hold(url) == 1
            await until(lambda: not router.engines[url].inflight)
            engine.load_flat(new_flat, "1")
            await router.loaded(url, 1)
            done = await asyncio.wait_for(call, 60)
            return done.output_ids, done.logprobs, done.segments
        finally:
            await router.close()
            await runner.cleanup()
            engine.stop()

    output, logprobs, segments = asyncio.run(go())
    assert len(output) == LONG["max_new_tokens"] and [v for _, v in segments] == [0, 1]
    first, second = segments[0][0], segments[1][0]
    assert first >= 6 and first + second == len(output)
    versions = CallMeta(policy_version=0, segments=tuple(segments)).output_versions(len(output))
    assert list(versions) == [0] * first + [1] * second
    fresh = recomputed(new_model, PROMPT + output[:first], output[first:])
    assert np.abs(np.array(logprobs[first:]) - np.array(fresh)).max() <= 1e-4


def test_keys_and_values_never_outlive_the_weights_that_computed_them(tiny: Path) -> None:
    """A sequence that ran across a load holds keys/values of both versions: none of it is
    cached for later calls. Requests of another cache key (SGLang's extra_key) never share."""
    _, new_flat = weights(tiny, 7)
    engine = Engine(tiny).start()
    try:

        def run(prompt: list[int], n: int, key: str = "", during=None) -> dict:  # noqa: ANN001
            done: dict = {}
            params = SamplingParams.from_request({"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
            seq = engine.submit(prompt, params, done.update, extra_key=key)
            if during is not None:
                deadline = time.monotonic() + 60
                while len(seq.output_ids) < 4:
                    assert time.monotonic() < deadline
                    time.sleep(0.005)
                during()
            deadline = time.monotonic() + 60
            while not done:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            return done

        first = run(PROMPT, 32, during=lambda: engine.load_flat(new_flat, "1"))  # a load mid-call
        again = run(PROMPT + first["output_ids"][:8], 2)
        assert again["meta_info"]["cached_tokens"] == 0  # nothing of the mixed sequence was kept
        third = run(PROMPT + first["output_ids"][:8] + [3], 2)
        assert third["meta_info"]["cached_tokens"] > 0  # what version 1 computed is reused
        other = run(PROMPT + first["output_ids"][:8] + [3], 2, key="v-other")
        assert other["meta_info"]["cached_tokens"] == 0  # another key: nothing shared
    finally:
        engine.stop()
