"""Routing replay: engines return the experts they routed every token to, the TITO log keeps them
once per position, and the trainer sends each trained token through them."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from loopback import Stack

from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.sampling import SamplingParams
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.routing import differing, routed
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trajectory.codec import by_run, read_records, write_records
from gyre_hpc.trajectory.records import TitoRecord, as_routes
from gyre_hpc.trajectory.sequences import TrainSequence
from gyre_hpc.trajectory.tree import TrajectoryTree


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "moe", seed=0, family="qwen3_moe")


def forward_routes(model: CausalLM, tokens: list[int], replay: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad(), routed(model, replay, model.config.renormalizes_topk) as capture:
        model(torch.tensor([tokens]))
    return capture.routes()


def test_replay_routes_each_token_through_the_given_experts(moe: Path) -> None:
    model = CausalLM.from_pretrained(moe)
    tokens = list(range(3, 19))
    own = forward_routes(model, tokens)
    assert own.shape == (16, model.config.num_hidden_layers, model.config.num_experts_per_tok)
    other = (own + 1) % model.config.num_experts  # every token, every layer: other experts
    other[:4] = -1  # no route known: the model's own choice
    got = forward_routes(model, tokens, other)
    assert not differing(got[4:], other[4:]).any()
    assert differing(got, own)[4:].all()
    with torch.no_grad():
        plain = model(torch.tensor([tokens]))[0]
        with routed(model, own, model.config.renormalizes_topk):
            same = model(torch.tensor([tokens]))[0]
    assert torch.equal(plain, same)  # its own routes replayed: the same forward, bit for bit
    with routed(model, other, model.config.renormalizes_topk):
        model(torch.tensor([tokens]))[0].logsumexp(-1).sum().backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router still learns


def record(
    call: str, input_ids: list[int], output_ids: list[int], routes: np.ndarray, start: int
) -> TitoRecord:
    return TitoRecord("run", call, "main", input_ids, output_ids, [-1.0] * len(output_ids), routes=routes,
                      routes_from=start)  # fmt: skip


def test_tree_keeps_each_route_once_and_the_log_round_trips(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    truth = rng.integers(0, 8, size=(40, 3, 2))  # what the engine routed each position to
    tree = TrajectoryTree("run")
    # call 1: 10 prompt + 5 output tokens; its routes cover all but its last position
    seq1 = list(range(100, 115))
    tree.add(record("c1", seq1[:10], seq1[10:], as_routes(truth[:14], 8), 0))
    assert tree.num_routed_positions == 14
    # call 2 re-sends the whole context and more: it needs routes only from position 14 on
    seq2 = seq1 + list(range(200, 210)) + list(range(300, 305))
    assert tree.routes_from(np.array(seq2[:25])) == 14
    tree.add(record("c2", seq2[:25], seq2[25:], as_routes(truth[14:29], 8), 14))
    # call 3 branches at position 12 (a retry): it needs routes only from its divergence
    seq3 = seq1[:12] + list(range(400, 406))
    assert tree.routes_from(np.array(seq3[:15])) == 12
    tree.add(record("c3", seq3[:15], seq3[15:], as_routes(truth[30:35], 8), 12))
    leaves = tree.leaves()
    paths = {tree.path_tokens(leaf)[-1]: tree.path_routes(leaf) for leaf in leaves}
    main, retry = paths[seq2[-1]], paths[seq3[-1]]
    np.testing.assert_array_equal(main[:29], truth[:29])
    assert (main[29:] == -1).all()  # the last output position was never forwarded
    np.testing.assert_array_equal(retry[:12], truth[:12])
    np.testing.assert_array_equal(retry[12:17], truth[30:35])
    # one byte an id (8 experts), each position once: 3 layers × top-2
    assert tree.route_bytes() == tree.num_unique_tokens * 3 * 2
    assert tree.num_routed_positions == 14 + 15 + 5
    # the log keeps them: read back, the same tree
    log = tmp_path / "tito.log"
    write_records(log, tree.encoded)
    [(_, encoded)] = list(by_run(read_records(log).records))
    again = TrajectoryTree.from_encoded(encoded)
    for leaf, back in zip(leaves, again.leaves(), strict=True):
        np.testing.assert_array_equal(tree.path_routes(leaf), again.path_routes(back))
    stored = log.stat().st_size
    ids_only = tmp_path / "ids.log"
    write_records(ids_only, [_without_routes(e) for e in tree.encoded])
    assert sum(e.routes.nbytes for e in encoded) == 34 * 3 * 2  # each reported route stored once
    assert stored - ids_only.stat().st_size <= 34 * 3 * 2 + 3 * 24  # and a few header bytes a call


def _without_routes(enc):  # noqa: ANN001, ANN202
    return dataclasses.replace(enc, routes=None, routes_from=0)


def test_engine_returns_complete_routes_for_prefix_cached_calls(moe: Path) -> None:
    """A call whose prompt is all cached still returns the routes of every position: the engine
    keeps them with the keys/values, as SGLang keeps them by KV slot."""
    engine = Engine(moe, max_running=2)
    config = engine.config
    done: list[dict] = []
    params = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=1, ignore_eos=True)
    first = list(range(5, 25))
    engine.submit(first, params, done.append, routes_from=0)
    while engine.step():
        pass
    out1 = done[0]["output_ids"]
    routes1 = decode(done[0], config)
    assert routes1.shape[0] == len(first) + len(out1) - 1  # every forwarded position
    second = first + out1 + [7, 8, 9]
    engine.submit(second, params, done.append, routes_from=0)
    while engine.step():
        pass
    assert done[1]["meta_info"]["cached_tokens"] == len(first) + len(out1) - 1
    routes2 = decode(done[1], config)
    assert routes2.shape[0] == len(second) + 6 - 1
    np.testing.assert_array_equal(routes2[: len(routes1)], routes1)  # the cached prefix's, complete
    fresh = forward_routes(engine.model, second + done[1]["output_ids"][:-1]).numpy()
    assert (~differing(torch.tensor(routes2), torch.tensor(fresh))).float().mean() > 0.9
    # asked from a position on: only those
    engine.submit(second, params, done.append, routes_from=len(second))
    while engine.step():
        pass
    np.testing.assert_array_equal(decode(done[2], config), routes2[len(second) :])


def decode(response: dict, config) -> np.ndarray:  # noqa: ANN001
    data = base64.b64decode(response["meta_info"]["routed_experts"])
    return np.frombuffer(data, "<i4").reshape(-1, config.num_hidden_layers, config.num_experts_per_tok)


def test_proxy_records_each_positions_route_once_over_http(moe: Path, tmp_path: Path) -> None:
    """Through the proxy, a growing context asks the engine only for the routes it lacks, and the
    log's tree holds a route for every forwarded position; an engine refuses a bad start."""

    async def go() -> None:
        async with Stack(moe, tmp_path) as stack, aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {stack.key('run-1')}"}
            context = list(range(5, 30))
            for turn in range(3):
                async with http.post(
                    stack.url + "/v1/generate",
                    json={
                        "input_ids": context,
                        "sampling_params": {"max_new_tokens": 5, "sampling_seed": turn},
                    },
                    headers=headers,
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    context += (await resp.json())["output_ids"] + [40 + turn, 41 + turn]
            bad = {"input_ids": [5, 6], "return_routed_experts": True, "routed_experts_start_len": 3}
            async with http.post(stack.urls[0] + "/generate", json=bad) as resp:
                assert resp.status == 400 and "routed_experts_start_len" in await resp.text()

    asyncio.run(go())
    [(_, encoded)] = list(by_run(read_records(RunDir(tmp_path).tito_log).records))
    assert [e.routes_from for e in encoded] == [0, encoded[1].shared - 1, encoded[2].shared - 1]
    tree = TrajectoryTree.from_encoded(encoded)
    [leaf] = tree.leaves()
    routes = tree.path_routes(leaf)
    assert (routes[:-1] >= 0).all() and (routes[-1] == -1).all()  # all but the unforwarded last
    assert sum(len(e.routes) for e in encoded) == len(routes) - 1  # none sent twice


def trainer_loss(moe: Path, routes: np.ndarray | None, replay: bool, packing: str = "paths") -> float:
    trainer = TorchTrainer(moe, TrainerConfig(routing_replay=replay), core=False, packing=packing)
    tokens = np.arange(3, 19)
    mask = np.r_[np.zeros(8), np.ones(8)].astype(np.float32)
    seq = TrainSequence("r", tokens, mask, np.where(mask > 0, -2.0, 0.0).astype(np.float32), 1.0, 0.125,
                        routes=routes)  # fmt: skip
    return trainer.micro_step([seq]).loss_sum


def test_the_torch_trainer_replays_the_sequences_routes(moe: Path) -> None:
    model = CausalLM.from_pretrained(moe)
    own = forward_routes(model, list(range(3, 19))).numpy().astype(np.int16)
    other = ((own + 1) % model.config.num_experts).astype(np.int16)
    free = trainer_loss(moe, None, True)
    assert trainer_loss(moe, own, True) == pytest.approx(free, rel=1e-6)  # its own routes: no change
    assert abs(trainer_loss(moe, other, True) - free) > 1e-4  # others: trained through those
    assert trainer_loss(moe, other, False) == pytest.approx(free, rel=1e-6)  # replay off: ignored
    # a packed tree's chains replay the same routes: the same loss as the path
    assert trainer_loss(moe, other, True, "tree") == pytest.approx(trainer_loss(moe, other, True), rel=1e-5)


def test_route_ids_outside_the_experts_are_refused() -> None:
    """An engine's ids a trainer could not replay never reach the log (the proxy keeps the call
    without them)."""
    assert as_routes([[[0, 7]]], 8).dtype == np.uint8 and as_routes([[[0, 300]]], 512).dtype == np.uint16
    for bad in ([[[0, 8]]], [[[-1, 2]]]):
        with pytest.raises(ValueError, match="outside"):
            as_routes(bad, 8)
