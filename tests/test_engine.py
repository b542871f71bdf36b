"""The embedded engine over real HTTP on loopback: batching, prefix cache, log-probs, control verbs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from aiohttp import web
from conftest import REPO, flat_of

from gyre_hpc.engines.client import EngineClient, EngineError
from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.server import make_app
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.tiny import init_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


class Served:
    """An embedded engine and its HTTP server on a free loopback port, for one test."""

    def __init__(self, model: Path, **kw: object) -> None:
        self.engine = Engine(model, **kw).start()  # type: ignore[arg-type]
        self.runner = web.AppRunner(make_app(self.engine))

    async def __aenter__(self) -> EngineClient:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.client = EngineClient(f"http://127.0.0.1:{port}")
        return self.client

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.runner.cleanup()
        self.engine.stop()


def run(coro) -> object:  # noqa: ANN001
    return asyncio.run(coro)


def prompt(tiny: Path, text: str) -> list[int]:
    from gyre_hpc.models.tokenizer import ChatTokenizer

    tok = ChatTokenizer(tiny)
    return tok.encode(tok.render([{"role": "user", "content": text}]))


def test_concurrent_requests_decode_together(tiny: Path) -> None:
    async def go() -> tuple[list[dict], dict]:
        served = Served(tiny)
        async with served as client:
            params = {"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 0}
            outs = await asyncio.gather(
                *(client.generate(prompt(tiny, f"task {i}"), params) for i in range(8))
            )
            return outs, dict(served.engine.stats)

    outs, stats = run(go())
    assert all(o["meta_info"]["completion_tokens"] == 24 for o in outs)
    assert stats["generated_tokens"] == 8 * 24
    assert stats["decode_steps"] < 3 * 24  # 8 sequences shared the decode steps


def test_batched_log_probs_hold_when_sequences_finish_at_different_steps(tiny: Path) -> None:
    """A sequence leaving the batch mid-step must not shift its neighbours' keys/values."""
    from gyre_hpc.loss.policy_loss import token_logprobs
    from gyre_hpc.models.causal_lm import CausalLM

    prompts = [prompt(tiny, "word " * (3 + 5 * i)) for i in range(6)]

    async def go() -> list[dict]:
        async with Served(tiny) as client:
            return await asyncio.gather(
                *(
                    client.generate(p, {"max_new_tokens": 4 + 3 * i, "ignore_eos": True, "sampling_seed": i})
                    for i, p in enumerate(prompts)
                )
            )

    outs = run(go())
    model = CausalLM.from_pretrained(tiny)
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        assert len(out["output_ids"]) == 4 + 3 * i
        ids = torch.tensor([p + out["output_ids"]])
        with torch.no_grad():
            expected = token_logprobs(model(ids)[0][0], ids[0])[len(p) :]
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, expected, atol=1e-4), (i, (got - expected).abs().max())


def test_prefix_cache_reuses_earlier_turns(tiny: Path) -> None:
    async def go() -> list[tuple[int, int]]:
        async with Served(tiny) as client:
            ids, seen = prompt(tiny, "build a calculator"), []
            for turn in range(4):  # a multi-turn agent resends its whole context every call
                out = await client.generate(
                    ids, {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": turn}
                )
                seen.append((out["meta_info"]["cached_tokens"], len(ids)))
                ids = ids + out["output_ids"] + prompt(tiny, f"tool result {turn}")
            return seen

    seen = run(go())
    assert seen[0][0] == 0
    for (cached, _), (_, prev_total) in zip(seen[1:], seen, strict=False):
        assert cached >= prev_total + 11  # the previous input and all but the last output token
    assert sum(c for c, _ in seen[1:]) / sum(t for _, t in seen[1:]) > 0.6


def test_logprobs_are_those_of_the_sampled_distribution(tiny: Path) -> None:
    params = {
        "max_new_tokens": 10,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "sampling_seed": 3,
        "ignore_eos": True,
    }

    async def go() -> dict:
        async with Served(tiny) as client:
            return await client.generate(prompt(tiny, "hello"), params)

    out = run(go())
    model = CausalLM.from_pretrained(tiny)
    ids = prompt(tiny, "hello") + out["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0][0]
    n = len(prompt(tiny, "hello"))
    for k, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        scaled = logits[n - 1 + k] / 0.7  # recomputed from scratch: no cache, no batching
        kth = torch.topk(scaled, 20).values[-1]
        probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), -1)
        sorted_p, order = torch.sort(probs, descending=True)
        probs[order[(torch.cumsum(sorted_p, 0) - sorted_p) > 0.9]] = 0
        assert lp == pytest.approx(float(torch.log(probs[tok] / probs.sum())), abs=2e-4)


async def until(predicate, timeout: float = 60.0) -> None:  # noqa: ANN001
    """Wait for ``predicate`` to hold (an event), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_abort_pause_continue(tiny: Path) -> None:
    async def go() -> tuple[dict, float, dict]:
        served = Served(tiny)
        engine = served.engine
        async with served as client:
            long = asyncio.create_task(
                client.generate(prompt(tiny, "x"), {"max_new_tokens": 30000, "ignore_eos": True}, rid="long")
            )
            await until(lambda: engine.stats["generated_tokens"] > 0)  # the long call decodes
            await client.abort("long")
            aborted = await long
            await client.pause("in_place")
            generated = engine.stats["generated_tokens"]
            paused = asyncio.create_task(client.generate(prompt(tiny, "y"), {"max_new_tokens": 5}))
            await until(lambda: len(engine.waiting) == 1)  # it reached the paused engine
            assert not paused.done() and not engine.running and engine.stats["generated_tokens"] == generated
            t0 = time.monotonic()
            await client.continue_()
            finished = await paused
            return aborted, time.monotonic() - t0, finished

    aborted, waited, finished = run(go())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < aborted["meta_info"]["completion_tokens"] < 30000
    assert finished["meta_info"]["finish_reason"]["type"] in ("length", "stop") and waited < 5


def test_weights_from_disk_and_from_a_flat_buffer(tiny: Path, tmp_path: Path) -> None:
    other = init_tiny(tmp_path / "other", seed=1)
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    def logprobs(out: dict) -> list[float]:  # random tiny models agree on greedy tokens, not on log-probs
        return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]

    async def go() -> tuple[list[float], list[float], str, list[float]]:
        served = Served(tiny)
        async with served as client:
            ids = prompt(tiny, "weights")
            before = logprobs(await client.generate(ids, greedy))
            reply = await client.update_weights_from_disk(str(other), "v1")
            assert reply["success"]
            after = await client.generate(ids, greedy)
            served.engine.load_flat(flat_of(CausalLM.from_pretrained(tiny)), "v2")
            again = logprobs(await client.generate(ids, greedy))
            return before, logprobs(after), after["meta_info"]["weight_version"], again

    before, after, version, again = run(go())
    assert (
        version == "v1"
        and after != pytest.approx(before, abs=1e-3)
        and again == pytest.approx(before, abs=1e-5)
    )


def test_bad_requests_get_400_with_the_reason(tiny: Path) -> None:
    async def go() -> list[str]:
        async with Served(tiny) as client:
            errors = []
            for body in (
                {"input_ids": []},
                {"input_ids": [1], "sampling_params": {"temperature": -1}},
                {"input_ids": [10**9]},
            ):
                try:
                    await client._post("/generate", body)
                except EngineError as err:
                    errors.append(str(err))
            ok = await client._post(
                "/generate",
                {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "some_future_key": True},
            )  # unknown keys are ignored
            assert ok["meta_info"]["completion_tokens"] == 1
            return errors

    errors = run(go())
    assert len(errors) == 3 and all("HTTP 400" in e for e in errors)
    assert "sampling_params.temperature = -1 is not valid" in errors[1]


def test_readme_commands_init_tiny_serve_and_curl(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    assert (
        subprocess.run(
            [sys.executable, "-m", "gyre_hpc", "model", "init-tiny", str(model)],
            cwd=REPO,
            capture_output=True,
        ).returncode
        == 0
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "gyre_hpc", "engine", "serve", str(model), "--port", "30471"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}).encode()
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:30471/generate", body, timeout=30) as resp:
                    out = json.loads(resp.read())
                break
            except OSError:
                assert time.monotonic() < deadline, server.stdout.read1(4000) if server.stdout else ""
                time.sleep(0.3)
        assert out["meta_info"]["completion_tokens"] <= 8 and len(out["output_ids"]) >= 1
    finally:
        server.terminate()
        server.wait(10)


def test_sequences_of_different_lengths_decode_together(tiny: Path) -> None:
    """Capacities differ with prompt and budget: the batch must pad, not crash."""

    async def go() -> list[dict]:
        async with Served(tiny) as client:
            return await asyncio.gather(
                *(
                    client.generate(
                        list(range(1, 2 + 37 * i)),
                        {"max_new_tokens": 300 if i % 2 else 5, "ignore_eos": True},
                    )
                    for i in range(6)
                )
            )

    outs = run(go())
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [5, 300, 5, 300, 5, 300]


@pytest.mark.gpu
def test_the_embedded_engine_on_a_gpu_answers_like_on_the_cpu(tiny: Path) -> None:
    """engine.device = "cuda": the same greedy tokens, log-probs within float32 noise."""

    async def answer(device: str) -> dict:
        async with Served(tiny, device=device) as client:
            return await client.generate(list(range(1, 60)), {"max_new_tokens": 24, "temperature": 0})

    cpu, gpu = run(answer("cpu")), run(answer("cuda"))
    assert gpu["output_ids"] == cpu["output_ids"]
    lp = [[x[0] for x in r["meta_info"]["output_token_logprobs"]] for r in (cpu, gpu)]
    assert max(abs(a - b) for a, b in zip(*lp, strict=True)) < 1e-3


def test_a_decode_step_copies_its_logits_to_the_host_once_for_the_whole_batch(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU each copy is a sync: one a sequence per step would serialise the batch."""
    from gyre_hpc.engines.sampling import SamplingParams

    engine = Engine(tiny, max_running=4)  # stepped here, not by its thread
    done: list[dict] = []
    for i in range(4):
        engine.submit(list(range(1, 20 + i)), SamplingParams(max_new_tokens=8, ignore_eos=True), done.append)
    engine.step()  # prefill (a copy per sequence: its first token) and the first decode step
    copies = 0
    real = torch.Tensor.cpu

    def counted(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        nonlocal copies
        copies += 1
        return real(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    assert engine.step() and len(engine.running) == 4
    assert copies == 1


def test_an_embedded_engine_on_a_gpu_sizes_its_prefix_cache_from_free_memory() -> None:
    from gyre_hpc.engines.hosted import cache_tokens
    from gyre_hpc.models.catalog import model_shape
    from gyre_hpc.plan.memory import Shape

    c = Shape.of(model_shape("/models/Qwen3-8B"))
    gib = 1 << 30
    per_token = 2 * 36 * 8 * 128 * 2  # layers × kv heads × head dim × bf16, keys and values
    params = 8_190_735_360
    # 80 % of an 80 GiB GPU, of which 30 GiB is free now: the free memory bounds it
    assert cache_tokens(30 * gib, 80 * gib, 0.8, c, 2) == (30 * gib - 2 * params) // 2 // per_token
    assert cache_tokens(79 * gib, 80 * gib, 0.8, c, 2) == (64 * gib - 2 * params) // 2 // per_token
    assert cache_tokens(gib, 80 * gib, 0.8, c, 2) == 0  # not even the weights fit: no cache
