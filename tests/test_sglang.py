"""Real SGLang servers (0.5.23, on the CPU here): the same answers as the embedded engine, the
verbs a cell uses, weights from the core's flat snapshot, and whole runs with SGLang cells.

``GYRE_SGLANG_URL`` points the engine-level tests at a server already running (any Qwen3 model
the embedded engine can load too, served at float32 on this machine, trusting
``--custom-weight-loader gyre_hpc.engines.weight_delta.load``); otherwise they start one from
``.venv-sglang`` (``tools/setup.sh --sglang``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, SGLANG_PYTHON, flat_of, missing, recomputed
from test_slurm_job import wait_for_event

from gyre_hpc.engines.client import routed_experts
from gyre_hpc.engines.colocation import State
from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.hosted import SGLangHost
from gyre_hpc.engines.sampling import SamplingParams
from gyre_hpc.engines.sglang import (
    SGLangServer,
    TensorPush,
    WeightGroup,
    buckets,
    call,
    cpu_threads_bind,
    served_dtype,
    server_env,
    sglang_command,
    tp_entries,
)
from gyre_hpc.errors import LaunchError
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.catalog import TINY_FAMILIES, model_shape
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.flat import FlatLayout
from gyre_hpc.models.hf_files import copy_model_files
from gyre_hpc.models.routing import differing, routed
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.observability import events as ev
from gyre_hpc.observability.events import read_events
from gyre_hpc.proxy.router import EngineSlot, Router
from gyre_hpc.recipe.schema import EngineConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.trainer import checkpoint
from gyre_hpc.trainer.megatron_weights import MegatronLayout, hf_to_megatron
from gyre_hpc.trainer.weight_shards import write_shard
from gyre_hpc.trajectory.codec import by_run, read_records
from gyre_hpc.trajectory.tree import TrajectoryTree

PROMPTS = [[1, 2, 3], list(range(40, 90)), [7] * 20]


def test_the_server_command_is_a_pure_function_of_the_engine_config() -> None:
    gpu = EngineConfig(
        backend="sglang", tp_size=4, mem_fraction_static=0.85, max_total_tokens=262144, dtype="bfloat16"
    )
    assert " ".join(sglang_command(gpu, "/models/Qwen3-8B", 30001, "0.0.0.0", "python", "cuda", 4)) == (
        "python -m sglang.launch_server --model-path /models/Qwen3-8B --host 0.0.0.0 --port 30001 "
        "--tp-size 4 --weight-version 0 --skip-server-warmup --base-gpu-id 4 --mem-fraction-static 0.85 "
        "--enable-memory-saver --max-total-tokens 262144 --dtype bfloat16"
    )
    cpu = EngineConfig(backend="sglang", dtype="float32", prefix_cache=False)
    assert " ".join(sglang_command(cpu, "/m", 30002, python="python", device="cpu")) == (
        "python -m sglang.launch_server --model-path /m --host 127.0.0.1 --port 30002 --tp-size 1 "
        "--weight-version 0 --skip-server-warmup --device cpu --attention-backend torch_native "
        "--sampling-backend pytorch --disable-cuda-graph --grammar-backend none --sleep-on-idle "
        "--max-total-tokens 16384 --dtype float32 --disable-radix-cache"
    )  # no memory saver without CUDA: it cannot start there
    moe = EngineConfig(backend="sglang", tp_size=8, ep_size=8, attn_dp_size=2, moe_a2a_backend="deepep")
    assert " ".join(sglang_command(moe, "/models/Qwen3-30B-A3B", 30003, python="python", routes=True)) == (
        "python -m sglang.launch_server --model-path /models/Qwen3-30B-A3B --host 127.0.0.1 --port 30003 "
        "--tp-size 8 --weight-version 0 --skip-server-warmup --ep-size 8 --attn-dp-size 2 "
        "--moe-a2a-backend deepep --enable-return-routed-experts --base-gpu-id 0 --mem-fraction-static 0.8 "
        "--enable-memory-saver"
    )


def test_a_version_goes_in_buckets_that_cover_the_layout_once_in_order() -> None:
    layout = FlatLayout.of(model_shape("tiny"))
    cut = buckets(layout, 2, 256 << 10)
    assert [n for b in cut for n in b.names] == list(layout.slots)
    assert cut[0].start == 0 and cut[-1].end == layout.numel
    assert all(a.end == b.start for a, b in zip(cut, cut[1:], strict=False))
    sizes = {b.names[0]: (b.end - b.start) * 2 for b in cut}
    # a bucket holds at most the limit, unless one tensor alone is larger
    assert all(size <= 256 << 10 or len(b.names) == 1 for b, size in zip(cut, sizes.values(), strict=True))
    assert len(buckets(layout, 4, 1 << 40)) == 1


def test_each_tp_rank_of_a_replica_across_nodes_reads_its_own_node_s_reference() -> None:
    """SGLang's tensor verb hands TP rank r entry r, and TP rank r of a replica over n nodes runs
    on node r // (tp / n): there it must find a reference to its own node's copy (a CUDA IPC
    handle opens only on the GPU's node; one reference per rank, as CUDA IPC counts them)."""
    by_node = [[f"node{n}-ref{i}" for i in range(4)] for n in range(2)]
    entries = tp_entries(by_node, 8)
    assert entries == ["node0-ref0", "node0-ref1", "node0-ref2", "node0-ref3",
                       "node1-ref0", "node1-ref1", "node1-ref2", "node1-ref3"]  # fmt: skip
    assert all(entries[r].startswith(f"node{r // 4}-") for r in range(8))
    assert tp_entries([["a"], ["b"]], 2) == ["a", "b"]
    with pytest.raises(ValueError, match=r"\[4, 3\] references for 8 TP ranks over 2 nodes: each node gives "
                                         "one for each of its 4"):  # fmt: skip
        tp_entries([by_node[0], by_node[1][:3]], 8)


def test_the_cpu_threads_of_a_part_s_tensor_parallel_ranks() -> None:
    """SGLang's CPU engine needs each TP rank's cores named when it has more ranks than NUMA
    nodes (tp 2 here, or a replica across two emulated nodes)."""
    assert cpu_threads_bind([0, 1], 2) == "0|1"
    assert cpu_threads_bind([3, 2, 1, 0], 2) == "0,1|2,3"
    assert cpu_threads_bind([5], 2) == "5|5"  # fewer cores than ranks: they share


def test_the_served_dtype_and_the_server_s_environment(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert served_dtype("auto", tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text('{"torch_dtype": "float32"}')
    assert served_dtype("auto", tmp_path) == "float16"  # SGLang's rule for float32 checkpoints
    assert served_dtype("float32", tmp_path) == "float32"
    assert server_env("cuda", {})["NCCL_CUMEM_ENABLE"] == "0"  # what SGLang sets in its processes
    assert server_env("cuda", {"NCCL_CUMEM_ENABLE": "1"})["NCCL_CUMEM_ENABLE"] == "1"
    assert server_env("cpu", {})["SGLANG_USE_CPU_ENGINE"] == "1"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(URL, model directory) of a real SGLang server serving float32."""
    if url := os.environ.get("GYRE_SGLANG_URL"):
        yield url, Path(call(url, lambda c: c.model_info())["model_path"])
        return
    model = init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)
    server = SGLangServer(
        EngineConfig(backend="sglang", dtype="float32", weight_sync="delta"),
        model,
        tmp_path_factory.mktemp("sglang"),
        device="cpu",
        python=str(SGLANG_PYTHON),
    )
    server.start()
    try:
        yield server.url, model
    finally:
        server.stop()


def greedy(url: str, prompt: list[int], n: int = 16) -> dict:
    return call(
        url, lambda c: c.generate(prompt, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    )


def embedded_greedy(engine: Engine, prompt: list[int], n: int = 16) -> tuple[list[int], list[float]]:
    done: dict = {}
    params = SamplingParams.from_request({"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    engine.submit(prompt, params, done.update)
    while not done:
        time.sleep(0.01)
    return done["output_ids"], [lp for lp, _, _ in done["meta_info"]["output_token_logprobs"]]


@pytest.mark.sglang
def test_sglang_answers_like_the_embedded_engine(served: tuple[str, Path]) -> None:
    url, model = served
    engine = Engine(model, max_running=4).start()
    try:
        for prompt in PROMPTS:
            reply = greedy(url, prompt)
            ours, ours_lp = embedded_greedy(engine, prompt)
            assert reply["output_ids"] == ours
            theirs = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
            assert np.abs(np.array(theirs) - np.array(ours_lp)).max() <= 1e-4
    finally:
        engine.stop()


@pytest.mark.sglang
def test_the_trainer_scores_what_sglang_sampled_as_sglang_did_until_the_temperature_is_wrong(
    served: tuple[str, Path],
) -> None:
    from test_diagnostics import sampled, trained

    url, model = served

    def generate(prompt: list[int], params: dict) -> tuple[list[int], list[float]]:
        reply = call(url, lambda c: c.generate(prompt, params))
        return reply["output_ids"], [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]

    ok, bad = trained(model, sampled(generate, 1.0)), trained(model, sampled(generate, 0.7))
    assert ok["mismatch_tokens"] == bad["mismatch_tokens"] == 72
    assert ok["mismatch_mean"] < 1e-3 and ok["mismatch_share"] == 0  # float32 kernels: rounding only
    assert bad["mismatch_mean"] > 0.05 and bad["mismatch_share"] > 0.1


@pytest.mark.sglang
def test_the_verbs_a_cell_uses(served: tuple[str, Path]) -> None:
    url, _ = served
    call(url, lambda c: c.pause("abort"))
    call(url, lambda c: c.continue_())
    for mode in ("retract", "in_place"):
        call(url, lambda c, mode=mode: c.pause(mode))
        call(url, lambda c: c.continue_())
    call(url, lambda c: c.flush_cache())  # only while nothing runs: it refuses otherwise
    again = greedy(url, PROMPTS[1], 4)
    assert again["meta_info"]["finish_reason"]["type"] == "length"
    assert greedy(url, PROMPTS[1], 4)["meta_info"]["cached_tokens"] > 0  # the prefix was kept


def cpu_seconds(pids: list[int]) -> float:
    """User and system time of these processes so far (their children's too, once reaped)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    parents = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    tree = [root]
    for pid in tree:
        tree += [child for child, parent in parents.items() if parent == pid]
    return tree


@pytest.mark.sglang
def test_an_idle_server_leaves_the_cores_to_the_trainer_and_the_agents(served: tuple[str, Path]) -> None:
    """Idle, SGLang's scheduler spins one core unless it sleeps on its sockets (measured: 1.03
    cores without --sleep-on-idle, 0.04 with); on the CPU those cores train and run the agents."""
    url, _ = served
    port = url.rsplit(":", 1)[1]
    root = next((p for p in Path("/proc").iterdir() if p.name.isdigit() and _serves(p, port)), None)
    if root is None:
        missing("sglang", f"the server at {url} (GYRE_SGLANG_URL) is not a process of this machine")
    tree = process_tree(int(root.name))
    greedy(url, PROMPTS[0], 4)  # it has served, and is idle again
    used, started = cpu_seconds(tree), time.monotonic()
    time.sleep(3)  # a window to measure over, not a wait for something to happen
    cores = (cpu_seconds(tree) - used) / (time.monotonic() - started)
    assert cores < 0.25, f"an idle server used {cores:.2f} cores"
    assert greedy(url, PROMPTS[0], 4)["meta_info"]["finish_reason"]["type"] == "length"  # and it wakes


@pytest.mark.sglang
def test_new_weights_arrive_by_reference_by_broadcast_and_from_disk(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    """The core's flat snapshot reaches the server bucket by bucket — read where it lies (the
    tensor verb; a shared-memory file here, CUDA IPC on a GPU) or broadcast — or as a model
    directory (a checkpoint's TP 2 × PP 2 shards exported as Hugging Face files a bucket at a
    time); it then serves that version, and its log-probs are those of those weights computed
    here. No push ever stages more than one bucket."""
    url, model_dir = served
    layout = FlatLayout.of(ModelConfig.load(model_dir))
    model = CausalLM.from_pretrained(model_dir)
    base = flat_of(model).numpy().copy()
    group = WeightGroup(url, layout, "127.0.0.1", 1, "gloo", "float32", bucket_bytes=1 << 20)
    assert len(group.buckets) > 2  # the tiny model is 3.4 MiB in float32
    by_reference = TensorPush(url, layout, 1, "cpu", "float32", bucket_bytes=1 << 20)
    for version, how in ((7, "broadcast"), (8, "tensor"), (9, "disk")):
        flat = base + np.random.RandomState(version).randn(base.size).astype(np.float32) * 0.02
        if how in ("broadcast", "tensor"):
            push = group if how == "broadcast" else by_reference
            call(url, lambda c: c.begin_weight_update())
            push.push(flat, version)
            call(url, lambda c: c.end_weight_update())
            assert 0 < push.peak_bytes <= 1 << 20  # never more than a bucket staged
        else:
            shards, path = tmp_path / f"v{version}-shards", tmp_path / f"v{version}"
            cut = MegatronLayout(ModelConfig.load(model_dir), tp=2, pp=2)
            for stage, rank in itertools.product(range(2), range(2)):
                mine = dict(hf_to_megatron(layout.views(flat).__getitem__, cut, rank, stage))
                write_shard(shards, mine, cut, stage, rank)
            copy_model_files(model_dir, shards)
            assert len(checkpoint.export_hf(shards, path, bucket_bytes=1 << 20)) > 2  # files and index
            assert call(url, lambda c, path=path, v=version: c.update_weights_from_disk(str(path), str(v)))[
                "success"
            ]
        layout.load(model, flat)
        for prompt in PROMPTS:
            reply = greedy(url, prompt)
            assert reply["meta_info"]["weight_version"] == str(version)
            theirs = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
            assert (
                np.abs(np.array(theirs) - np.array(recomputed(model, prompt, reply["output_ids"]))).max()
                <= 1e-4
            )
    layout.load(model, base)
    call(url, lambda c: c.begin_weight_update())
    group.push(base, 0)  # as it was, for the tests that follow
    call(url, lambda c: c.end_weight_update())


@pytest.mark.sglang
def test_a_version_travels_as_the_elements_that_changed_and_the_server_checks_what_it_holds(
    served: tuple[str, Path],
) -> None:
    """engine.weight_sync = "delta": after a whole first push, a version that changed 1 % of the
    elements goes as those alone (positions and absolute values), and one that moved half of them
    by an ulp (as an RL step does) as its XOR with the held version, packed to under a quarter
    of the bytes; the server then serves exactly that version. A server holding another version
    than the sender kept (another sender loaded it), or a sender whose kept copy is wrong (the
    checksum disagrees), makes the push whole — served correctly either way."""
    url, model_dir = served
    layout = FlatLayout.of(ModelConfig.load(model_dir))
    model = CausalLM.from_pretrained(model_dir)
    base = flat_of(model).numpy().copy()
    delta = TensorPush(url, layout, 1, "cpu", "float32", bucket_bytes=1 << 20, delta=True)
    other = TensorPush(url, layout, 1, "cpu", "float32", bucket_bytes=1 << 20, delta=True)
    rng = np.random.RandomState(0)

    def sparse_step(flat: np.ndarray) -> np.ndarray:
        out = flat.copy()
        at = rng.choice(out.size, out.size // 100, replace=False)
        out[at] += rng.randn(at.size).astype(np.float32) * 0.05
        return out

    def ulp_step(flat: np.ndarray) -> np.ndarray:
        out = flat.copy()
        at = rng.choice(out.size, out.size // 2, replace=False)
        up = rng.rand(at.size) < 0.5
        out[at] = np.nextafter(out[at], np.where(up, np.inf, -np.inf).astype(np.float32))
        return out

    def push(sender: TensorPush, flat: np.ndarray, version: int):  # noqa: ANN202
        call(url, lambda c: c.begin_weight_update())
        pushed = sender.push(flat, version)
        call(url, lambda c: c.end_weight_update())
        layout.load(model, flat)
        for prompt in PROMPTS:
            reply = greedy(url, prompt)
            assert reply["meta_info"]["weight_version"] == str(version)
            theirs = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
            ours = recomputed(model, prompt, reply["output_ids"])
            assert np.abs(np.array(theirs) - np.array(ours)).max() <= 1e-4, version
        return pushed

    first = push(delta, base, 21)
    assert first.sent >= first.whole == base.nbytes and first.changed == base.size  # nothing held yet
    v22 = sparse_step(base)
    second = push(delta, v22, 22)
    assert abs(second.changed_fraction - 0.01) < 1e-3, second
    assert second.sent < 0.06 * second.whole, second  # 8 bytes a changed float32, and the headers
    v23 = ulp_step(v22)
    third = push(delta, v23, 23)
    assert abs(third.changed_fraction - 0.5) < 0.01, third
    assert third.sent < 0.25 * third.whole, third  # positions would be 4 bytes more a change: 2x

    push(other, sparse_step(v23), 24)  # the server now holds 24; `delta` still thinks 23
    v25 = sparse_step(v23)
    assert push(delta, v25, 25).sent >= base.nbytes  # refused as stale: whole

    v26 = sparse_step(v25)
    kept = next(iter(delta.held.values()))  # the first bucket, as this side keeps it
    moved = np.flatnonzero(v26[: kept.numel()] != v25[: kept.numel()])[:16]
    assert moved.size
    kept.view(-1)[moved] = torch.from_numpy(v26[moved])  # this side's copy wrong there
    assert push(delta, v26, 26).sent >= base.nbytes  # the checksum disagreed: whole
    assert push(delta, ulp_step(v26), 27).sent < 0.25 * base.nbytes  # and deltas again

    layout.load(model, base)
    push(other, base, 0)  # as it was, for the tests that follow


@pytest.mark.sglang
@pytest.mark.mpi
@pytest.mark.megatron
def test_a_tensor_parallel_cell_streams_whole_tensors_from_its_slices_a_bucket_at_a_time(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    """A megatron cell of TP 2 holds its weights only as slices: the server gets them as whole
    tensors gathered one at a time on the cell's ranks, staged a bucket at a time (by reference,
    then as deltas), and serves exactly those weights; no rank ever makes a whole-model buffer,
    and the staging never exceeds a bucket (or the one tensor larger than a bucket)."""
    url, model_dir = served
    bucket = 1 << 20
    out = tmp_path / "streamed.npz"
    program = REPO / "tests" / "mpi_programs" / "streamed_load.py"
    proc = subprocess.run(
        ["mpirun", "--oversubscribe", "-n", "2", sys.executable, str(program), str(model_dir), str(out),
         "2", "1", url, str(bucket)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **ROOT_OK},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = np.load(out)
    layout = FlatLayout.of(ModelConfig.load(model_dir))
    assert list(got["whole"]) == [0, 0]  # no rank made a whole-model buffer to push from
    assert 0 < int(got["peak"]) <= max(bucket, int(got["largest"]))
    by_reference, whole, sparse = got["pushed"].tolist()
    assert by_reference[3] == whole[3] == sparse[3] == layout.numel  # every tensor, each once
    assert abs(sparse[2] / sparse[3] - 0.01) < 2e-3 and sparse[0] < 0.06 * sparse[1], sparse
    model = CausalLM.from_pretrained(model_dir)
    layout.load(model, got["served"])
    for prompt in PROMPTS:
        reply = greedy(url, prompt)
        assert reply["meta_info"]["weight_version"] == "3"
        theirs = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
        assert (
            np.abs(np.array(theirs) - np.array(recomputed(model, prompt, reply["output_ids"]))).max() <= 1e-4
        )
    base = flat_of(CausalLM.from_pretrained(model_dir)).numpy()
    restore = TensorPush(url, layout, 1, "cpu", "float32", bucket_bytes=bucket)
    call(url, lambda c: c.begin_weight_update())
    restore.push(base, 0)  # as it was, for the tests that follow
    call(url, lambda c: c.end_weight_update())


@pytest.mark.sglang
def test_a_conversation_continued_after_a_load_reuses_no_keys_and_values_of_older_weights(
    served: tuple[str, Path],
) -> None:
    """SGLang keeps its prefix cache across a load while calls run (a load with the cache kept,
    here). Asked without a key, it continues a conversation on keys/values of the old weights;
    through the router, each call's cache key is its engine's version (SGLang's extra_key), so
    the continuation's log-probs are those of the new weights computed afresh."""
    url, model_dir = served
    layout = FlatLayout.of(ModelConfig.load(model_dir))
    model = CausalLM.from_pretrained(model_dir)
    base = flat_of(model).numpy().copy()
    push = TensorPush(url, layout, 1, "cpu", "float32", bucket_bytes=1 << 20)
    turn = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}

    def load(version: int, flush: bool = False) -> np.ndarray:
        flat = base + np.random.RandomState(version).randn(base.size).astype(np.float32) * 0.05
        call(url, lambda c: c.begin_weight_update())
        push.push(flat, version, flush=flush)
        call(url, lambda c: c.end_weight_update())
        layout.load(model, flat)
        return flat

    def mismatch(prompt: list[int], output: list[int], logprobs: list[float]) -> float:
        return float(np.abs(np.array(logprobs) - np.array(recomputed(model, prompt, output))).max())

    # Unkeyed, as calls were sent before: the second turn reuses the first turn's old KV.
    first = call(url, lambda c: c.generate(PROMPTS[1], turn))
    load(31)
    prompt = PROMPTS[1] + first["output_ids"] + [11, 12]
    second = call(url, lambda c: c.generate(prompt, turn))
    assert second["meta_info"]["cached_tokens"] > 0
    theirs = [lp for lp, _, _ in second["meta_info"]["output_token_logprobs"]]
    assert mismatch(prompt, second["output_ids"], theirs) > 1e-3  # served partly by the old weights

    async def conversation() -> tuple[list[int], list[int], list[float], int]:
        router = Router([EngineSlot(url, 4)], timeout_s=120)
        try:
            await router.loaded(url, 31)
            one = await router.complete("conv", PROMPTS[2], turn)
            await asyncio.to_thread(load, 32)
            await router.loaded(url, 32)
            again = PROMPTS[2] + one.output_ids + [11, 12]
            two = await router.complete("conv", again, turn)
            return again, two.output_ids, two.logprobs, two.cached_tokens
        finally:
            await router.close()

    prompt, output, logprobs, cached = asyncio.run(conversation())
    assert cached == 0 and mismatch(prompt, output, logprobs) <= 1e-4
    call(url, lambda c: c.begin_weight_update())
    push.push(base, 0)  # as it was, cache dropped, for the tests that follow
    call(url, lambda c: c.end_weight_update())


# ---- whole runs with SGLang cells --------------------------------------------------------------

SMOKE_SGLANG = str(REPO / "recipes" / "smoke-sglang.toml")
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@pytest.mark.sglang
def test_a_server_killed_while_each_verb_is_in_flight_comes_back_as_the_verbs_asked(tmp_path: Path) -> None:
    """A cell's server killed as it is launched (it dies while it starts), and the moment a request
    of each verb reaches it — a pause, a load by reference, a resume: each verb returns, the
    server is started again on its port, and it comes back in the state and at the version the
    verbs asked for (the load's own weights: its log-probs are theirs), each restart recorded;
    where the cell streams its weights (no copy to restart from), it comes back paused until the
    cell streams them again."""
    model_dir = init_tiny(tmp_path / "tiny", seed=0)
    model = CausalLM.from_pretrained(model_dir)
    base = flat_of(model).numpy().copy()
    newer = base + np.random.RandomState(1).randn(base.size).astype(np.float32) * 0.02
    held = {"weights": (base, 0)}  # the cell's newest weights, as ``CellHost.newest_weights``
    engine = EngineConfig(backend="sglang", dtype="float32", weight_sync="delta")
    server = SGLangServer(engine, model_dir, tmp_path / "sglang", device="cpu", python=str(SGLANG_PYTHON))
    host = SGLangHost(server, lambda: held["weights"], attempts=3, backoff_s=0.1)
    armed: set[str] = set()

    def kill_on_arrival(path: str) -> None:
        if path in armed and server.proc is not None:
            armed.discard(path)
            os.killpg(server.proc.pid, signal.SIGKILL)

    def back() -> None:
        while host.restarting:  # the cell's loop: supervise between messages
            host.supervise()
            time.sleep(0.1)
        host.supervise()

    def kill_once_launched() -> None:  # it dies while it starts: before it answers anything
        while server.proc is None:
            time.sleep(0.01)
        os.killpg(server.proc.pid, signal.SIGKILL)

    server.sent = kill_on_arrival
    threading.Thread(target=kill_once_launched, daemon=True).start()
    port = host.start()
    try:
        armed.add("/pause_generation")
        host.pause()
        back()
        assert host.state == State.PAUSED and not armed
        held["weights"] = (newer, 1)
        armed.add("/update_weights_from_tensor")
        host.load(newer, 1)
        back()
        assert host.state == State.PAUSED and not armed
        armed.add("/continue_generation")
        host.resume()
        back()
        assert host.state == State.SERVING and not armed and server.port == port
        FlatLayout.of(ModelConfig.load(model_dir)).load(model, newer)
        reply = greedy(server.url, PROMPTS[1])
        assert reply["meta_info"]["weight_version"] == "1"
        theirs = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
        ours = recomputed(model, PROMPTS[1], reply["output_ids"])
        assert np.abs(np.array(theirs) - np.array(ours)).max() <= 1e-4
        # A cell that streams its weights from its slices keeps no copy: killed while a stream
        # arrives, the server comes back paused (SGLang's /ready says 503), waiting for that
        # version, and serves again only once the cell has streamed it (Leader.catch_up).
        newest = base + np.random.RandomState(2).randn(base.size).astype(np.float32) * 0.02
        layout = FlatLayout.of(ModelConfig.load(model_dir))
        held["weights"] = (None, 2)
        armed.add("/update_weights_from_tensor")
        host.load(iter(layout.views(newest).items()), 2)
        back()
        assert (host.wants, host.state, host.can_load, armed) == (2, State.SERVING, True, set())
        assert not ready(server.url)
        host.load(iter(layout.views(newest).items()), 2)
        assert host.wants is None and ready(server.url)
        layout.load(model, newest)
        reply = greedy(server.url, PROMPTS[2])
        assert reply["meta_info"]["weight_version"] == "2"
        theirs = np.array([lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]])
        assert np.abs(theirs - np.array(recomputed(model, PROMPTS[2], reply["output_ids"]))).max() <= 1e-4
        assert [(r.cause, r.attempts, r.version) for r in host.restarts] == [
            ("died while it started", 2, 0),
            ("died during pause", 1, 0),
            ("died during load", 1, 1),
            ("died during resume", 1, 1),
            ("died during load", 1, 2),
        ]
    finally:
        host.stop()


def ready(url: str) -> bool:
    """SGLang's /ready: healthy and not paused."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=30) as r:  # noqa: S310 - a local server
            return r.status == 200
    except urllib.error.HTTPError as err:
        if err.code != 503:
            raise
        return False


def test_a_server_that_never_comes_up_fails_its_cell_after_its_attempts_naming_why(tmp_path: Path) -> None:
    """Every start dies at once (here its interpreter exits 1): after ``engine.restart_attempts``
    starts, with backoff between them, one line names the bound, the last failure and the log."""
    model_dir = init_tiny(tmp_path / "tiny", seed=0)
    engine = EngineConfig(backend="sglang", dtype="float32")
    server = SGLangServer(engine, model_dir, tmp_path / "sglang", device="cpu", python="/bin/false")
    host = SGLangHost(server, lambda: (np.zeros(1, np.float32), 0), attempts=2, backoff_s=0.01)
    with pytest.raises(LaunchError) as err:
        host.start()
    said = str(err.value)
    assert (
        "did not come up in 2 attempts (engine.restart_attempts); the last: sglang exited with code 1" in said
    )
    assert f"see {server.log}" in said and "\n" not in said


@pytest.mark.sglang
def test_a_server_killed_while_a_broadcast_or_a_disk_load_reaches_it_comes_back_at_that_version(
    tmp_path: Path,
) -> None:
    """The other two ways weights reach a server: killed the moment the load's request arrives
    (mid-broadcast, the cell's end of the weight group meets a dead peer), the load returns, the
    server starts again, forms its weight group anew and serves the load's version, with its
    log-probs. The two servers side by side (each start leaves a core idle part of the time),
    each of another family than the Qwen3 the tests above serve: a Llama 3 (untied, scaled rotary
    frequencies) by broadcast, a Qwen2 (biased q/k/v) from disk."""
    ways = [(sync, verb, init_tiny(tmp_path / sync / "model", seed=0, family=family))
            for sync, verb, family in (("broadcast", "/update_weights_from_distributed", "llama"),
                                       ("disk", "/update_weights_from_disk", "qwen2"))]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(killed_mid_load, d, tmp_path / sync, sync, verb) for sync, verb, d in ways]:
            done.result()


def killed_mid_load(model_dir: Path, work: Path, sync: str, verb: str) -> None:
    model = CausalLM.from_pretrained(model_dir)
    newer = flat_of(model).numpy().copy()
    newer += np.random.RandomState(2).randn(newer.size).astype(np.float32) * 0.02
    held = {"weights": (flat_of(model).numpy().copy(), 0)}
    engine = EngineConfig(backend="sglang", dtype="float32", weight_sync=sync, weight_bucket_mb=1)
    server = SGLangServer(engine, model_dir, work, device="cpu", python=str(SGLANG_PYTHON))
    host = SGLangHost(server, lambda: held["weights"], attempts=3, backoff_s=0.1)
    armed = {verb}

    def kill_on_arrival(path: str) -> None:
        if path in armed and server.proc is not None:
            armed.discard(path)
            os.killpg(server.proc.pid, signal.SIGKILL)

    server.sent = kill_on_arrival
    host.start()
    try:
        held["weights"] = (newer, 1)
        host.load(newer, 1)
        while host.restarting:  # the cell's loop: supervise between messages
            host.supervise()
            time.sleep(0.1)
        host.supervise()
        assert not armed and host.state == State.SERVING, sync
        FlatLayout.of(ModelConfig.load(model_dir)).load(model, newer)
        reply = greedy(server.url, PROMPTS[2])
        assert reply["meta_info"]["weight_version"] == "1", sync
        theirs = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
        gap = np.abs(np.array(theirs) - np.array(recomputed(model, PROMPTS[2], reply["output_ids"]))).max()
        assert gap <= 1e-4, (sync, gap)
        assert [(r.cause, r.attempts, r.version) for r in host.restarts] == [("died during load", 1, 1)], sync
    finally:
        host.stop()


def start_run(runs_dir: Path, *sets: str) -> subprocess.Popen[str]:
    args = [str(SGLANG_PYTHON), "-m", "gyre_hpc", "run", SMOKE_SGLANG, "--set", f"run.runs_dir={runs_dir}"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **ROOT_OK})  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout: float) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return err


def events_of(runs_dir: Path) -> tuple[RunDir, list[ev.Event]]:
    (path,) = runs_dir.iterdir()
    run = RunDir(path)
    return run, run.read_events()


@pytest.mark.mpi
@pytest.mark.sglang
@pytest.mark.timeout(1500)
def test_an_elastic_run_with_sglang_cells_whose_killed_server_comes_back(tmp_path: Path) -> None:
    """One run for both (an SGLang run is the suite's dearest): three elastic steps; in step 2,
    cell 1's server is killed, comes back at the newest version the cell holds, and no execution
    is lost."""
    # 8 executions in 4 groups of 2: a group is packed while others still run, so the core
    # trains mid-burst (2 groups of 4 tend to end together, and then it trains after the burst).
    proc = start_run(tmp_path, "tasks.prompts_per_step=4", "tasks.group_size=2")
    try:
        port, run = None, None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:  # wait for step 2's burst to be under way
            if any(tmp_path.iterdir()):
                run, events = events_of(tmp_path)
                hello = next((e for e in events if isinstance(e, ev.Hello) and e.cell == 1), None)
                port = hello.addresses[0].rsplit(":", 1)[1] if hello else None
                if any(isinstance(e, ev.Finished) and e.run.startswith("s0002") for e in events):
                    break
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            time.sleep(0.5)
        assert port is not None and run is not None, "step 2 never started"
        server = next(p for p in Path("/proc").iterdir() if p.name.isdigit() and _serves(p, port))
        os.kill(int(server.name), signal.SIGKILL)
        finish(proc, 1200)
    finally:
        proc.kill()
    run, events = events_of(tmp_path)
    steps = [e for e in events if isinstance(e, ev.Step)]
    assert [s.step for s in steps] == [1, 2, 3] and [s.version for s in steps] == published(steps)
    for s in steps:  # none failed: drained calls, and those of the killed server, continued elsewhere
        assert set(s.statuses) <= {"finished", "timed_out"} and s.executions == 8, s.statuses
    log = (run.logs / "rank-2.log").read_text()  # cell 1's leader
    assert "died" in log and "back at version" in log
    (restart,) = [e for e in events if isinstance(e, ev.EngineRestart)]
    assert restart.cell == 1 and restart.cause.startswith("died") and restart.attempts >= 1
    joined = [e for e in events if isinstance(e, ev.Switch) and e.direction == "sampling→training"]
    assert any(e.w for e in joined), "a cell moved to training while executions were running"
    # Every call of the last step was served by the version the step before published, and its
    # behaviour log-probs are those of that version's weights (the checkpoint), recomputed here:
    # the restarted server too.
    calls, worst = served_against_checkpoint(run, 3)
    assert calls and {c.policy_version for c in calls} == {steps[1].version}
    assert worst <= 1e-4, worst
    # Every part of every call was served at the version its engine held then (the engine's own
    # report), and after step 1 none at version 0: the restarted server had none until it loaded.
    trees = by_run(read_records(run.tito_log).records)
    later = [
        rec
        for r, recs in trees
        if not r.startswith("s0001")
        for rec in TrajectoryTree.from_encoded(recs).records()
    ]
    assert later and all(v >= steps[0].version for rec in later for _, v in rec.meta.versions())
    hosts = {e.cell: e.addresses for e in events if isinstance(e, ev.Hello)}
    assert all((run.engines / f"unit-{c}" / "sglang.log").exists() for c in hosts)


@pytest.mark.mpi
@pytest.mark.sglang
@pytest.mark.timeout(1200)
def test_a_cell_of_two_ranks_serves_with_two_sglang_replicas(tmp_path: Path) -> None:
    """One megatron cell of TP 2 over 2 ranks, engine.tp_size 1: two SGLang servers behind the
    router, both get calls, both load each version as the cell streams it from its two slices
    (their calls' log-probs are the checkpoint's), and each role switch drains and pauses both.
    The member's server is killed as step 1 samples: it comes back paused, says so to its
    leader, and serves again once the cell has streamed it the version it holds. Versions go by delta (at
    float32 and this learning rate nearly every element changes: the first goes whole, later
    ones as their XOR with the held version, packed, never more than whole), and each load
    reports what it moved."""
    sets = ("cells.count=1", "cells.ranks_per_cell=2", "scheduler.mode=colocate", "run.steps=2",
            "trainer.backend=megatron", "trainer.tp_size=2")  # fmt: skip
    proc = start_run(tmp_path, *sets, "tasks.prompts_per_step=2", "engine.weight_sync=delta")
    try:
        port, deadline = None, time.monotonic() + 900
        while port is None and time.monotonic() < deadline:  # the member's server, once step 1 samples
            if any(tmp_path.iterdir()):
                _, events = events_of(tmp_path)
                hello = next((e for e in events if isinstance(e, ev.Hello)), None)
                if hello and any(isinstance(e, ev.Dispatched) for e in events):
                    port = hello.addresses[1].rsplit(":", 1)[1]
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            time.sleep(0.25)
        assert port is not None, "step 2 never started"
        server = next(p for p in Path("/proc").iterdir() if p.name.isdigit() and _serves(p, port))
        os.kill(int(server.name), signal.SIGKILL)
        finish(proc, 1100)
    finally:
        proc.kill()
    run, events = events_of(tmp_path)
    loads = [e for e in events if isinstance(e, ev.WeightsLoaded)]
    whole = 2 * FlatLayout.of(ModelConfig.load(run.checkpoints / "step-000001")).numel * 4  # 2 replicas
    assert loads and loads[0].whole_bytes == whole and loads[0].bytes >= whole, loads
    # A load that finds the killed server restarting moves nothing there (it gets the version
    # once it is back): one replica's worth.
    assert all(e.whole_bytes in (whole, whole // 2) for e in loads), loads
    assert all(e.bytes <= 1.01 * e.whole_bytes for e in loads), loads  # headers aside, never over whole
    steps = [e for e in events if isinstance(e, ev.Step)]
    assert [s.version for s in steps] == published(steps)
    # A load of a new version changed nearly every element; one of the version the engines hold
    # (after a step that learned nothing) changed none and sent only the buckets' headers.
    assert loads[0].changed == 1.0, loads  # the first goes whole: the servers held nothing of ours
    # The one exception: the same version again, reaching the restarted server, which holds
    # nothing of ours (it came back waiting for the cell's weights), goes whole to it alone.
    for before, e in itertools.pairwise(loads):
        if e.version != before.version:
            assert 0.9 < e.changed <= 1.0, loads
        elif e.changed:
            assert e.changed == 0.5 and e.bytes <= 1.01 * whole // 2, loads
        else:
            assert e.bytes < 0.01 * whole, loads
    assert sum(a.version == b.version and b.changed > 0 for a, b in itertools.pairwise(loads)) <= 1, loads
    (hello,) = [e for e in events if isinstance(e, ev.Hello)]
    assert len(hello.addresses) == 2
    last = steps[-1].engine_calls  # both served (in step 1 the member may die before its first call)
    assert set(last) == set(hello.addresses) and min(last.values()) > 0, last
    logs = [run.engines / "unit-0" / "sglang.log", run.engines / "unit-0-replica-1" / "sglang.log"]
    for log in logs:  # the role switches (to train and back) reached both servers
        text = log.read_text()
        assert "/pause_generation" in text and "/continue_generation" in text, log
    calls, worst = served_against_checkpoint(run, 2)
    assert {c.meta.engine for c in calls} <= set(hello.addresses)
    assert {c.policy_version for c in calls} == {steps[0].version}
    assert worst <= 1e-4, worst
    (restart,) = [e for e in events if isinstance(e, ev.EngineRestart)]
    assert restart.cell == 0 and restart.cause.startswith("died"), restart
    member = (run.logs / "rank-2.log").read_text()
    assert "streamed from the cell's slices into its engine" in member
    # Back, the restarted server waited paused until the cell streamed it a version whole (the
    # next load, which waited for it, or its leader's catch-up between messages).
    after = member[member.index("back at version") :]
    assert re.search(r"streamed from the cell's slices into its engine \([1-9]\d* elements\)", after), after
    # Nothing was served by the restarted server before the cell streamed it its version: each
    # step's calls at the version the step before published.
    trees = list(by_run(read_records(run.tito_log).records))
    for step, version in ((1, 0), (2, steps[0].version)):
        records = [rec for r, recs in trees if r.startswith(f"s{step:04d}")
                   for rec in TrajectoryTree.from_encoded(recs).records()]  # fmt: skip
        assert records and all(v == version for rec in records for _, v in rec.meta.versions()), step


@pytest.mark.mpi
@pytest.mark.slurm
@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_a_cell_across_two_slurm_nodes_serves_with_one_replica_spanning_both(tmp_path: Path) -> None:
    """One megatron cell of TP 2 over 2 ranks on 2 nodes of the local Slurm, engine.tp_size 2: one
    SGLang replica whose two parts run on the two nodes (--nnodes 2, each part's node rank, the
    head's address). Each version goes by reference from each node: both ranks gather every
    tensor from the two slices, each stages every bucket on its own node, and the head's one
    request gives each TP rank its own node's reference; what it serves is the checkpoint's
    (log-probs within 1e-4). A world that dies may start again once: beside other MPI jobs on
    this host, UCX has segfaulted in a rank's MPI start-up (twice in many runs), a fault that
    costs a restart, as any rank's death does."""
    sets = ("slurm.nodes_per_cell=2", "cells.ranks_per_cell=2", "engine.tp_size=2",
            "engine.weight_sync=tensor", "trainer.backend=megatron", "trainer.tp_size=2", "cells.count=1",
            "run.steps=2", "tasks.prompts_per_step=2", "scheduler.mode=colocate",
            "run.max_restarts=1")  # fmt: skip
    args = [str(SGLANG_PYTHON), "-m", "gyre_hpc", "submit", SMOKE_SGLANG, "--set", f"run.runs_dir={tmp_path}"]
    proc = subprocess.run([*args, *(a for s in sets for a in ("--set", s))], capture_output=True, text=True,
                          cwd=REPO, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    run = RunDir(Path(re.search(r"run directory: (\S+)", proc.stdout).group(1)))
    end = wait_for_event(run, "run_end", timeout=800)
    assert end.status == "completed", end
    events = read_events(run.events)
    last_world = max(i for i, e in enumerate(events) if isinstance(e, ev.WorldUp))
    hellos = [e for e in events[last_world:] if isinstance(e, ev.Hello)]
    assert len(hellos) == 1 and len(hellos[0].addresses) == 1, hellos
    hosts = {r["rank"]: r["host"] for r in run.read_ranks()}
    assert hosts[1] != hosts[2], hosts  # the cell's two ranks on two emulated nodes
    parts = {d.name: (d / "sglang.log").read_text() for d in sorted(run.engines.iterdir())}
    assert parts.keys() == {"unit-0", "unit-0-part-1"}, parts.keys()
    for rank, (name, text) in enumerate(parts.items()):
        assert f"'nnodes': 2, 'node_rank': {rank}, 'tp_size': 2" in text, name
    assert "update_weights_from_tensor" in parts["unit-0"]
    # Each load staged the whole version once on each node (the part's rank says so too).
    whole = FlatLayout.of(ModelConfig.load(run.checkpoints / "step-000001")).numel * 4
    loads = [e for e in events[last_world:] if isinstance(e, ev.WeightsLoaded)]
    assert loads and all(e.whole_bytes == 2 * whole for e in loads), loads
    assert "streamed from the cell's slices into its engine" in (run.logs / "rank-2.log").read_text()
    steps = [e for e in read_events(run.events) if isinstance(e, ev.Step)]
    calls, worst = served_against_checkpoint(run, 2)
    assert calls and {c.policy_version for c in calls} == {steps[0].version} and worst <= 1e-4, worst


def published(steps: list[ev.Step]) -> list[int]:
    """The versions the steps should have published: one more for each step that trained (the
    tiny model sometimes fails or passes every run of a step, which then has nothing to learn)."""
    return list(itertools.accumulate(int(not s.skipped) for s in steps))


def served_against_checkpoint(run: RunDir, step: int) -> tuple[list, float]:
    """The calls of ``step``'s executions, and the largest gap between their behaviour log-probs
    and a recomputation here with the checkpoint of the step before (the version they sampled;
    whole or a megatron cell's shards)."""
    path = run.checkpoints / f"step-{step - 1:06d}"
    model = CausalLM(ModelConfig.load(path))
    FlatLayout.of(model.config).load(model, checkpoint.read_weights(path))
    calls = [
        rec
        for r, recs in by_run(read_records(run.tito_log).records)
        if r.startswith(f"s{step:04d}")
        for rec in TrajectoryTree.from_encoded(recs).records()
    ]
    gaps = [
        np.abs(
            np.array(c.output_logprobs) - np.array(recomputed(model, list(c.input_ids), list(c.output_ids)))
        ).max()
        for c in calls
    ]
    return calls, float(max(gaps, default=0.0))


def _serves(proc: Path, port: str) -> bool:
    try:
        cmd = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"sglang.launch_server" in b" ".join(cmd) and port.encode() in cmd


@pytest.mark.sglang
def test_each_family_with_experts_serves_under_sglang_with_the_trainer_s_log_probs_after_a_push(
    tmp_path: Path,
) -> None:
    """The families with routed experts (Qwen3, Llama and Qwen2 are served by the tests above;
    SGLang's Mistral is its Llama): a tiny random model of each starts under real SGLang on this
    CPU, takes a pushed version by reference (its experts one tensor each, as SGLang loads them,
    from a flat snapshot or from a stream of fused tensors),
    and serves it with the log-probs transformers' implementation computes here, returning the
    experts it routed every position to — a prefix-cached call's complete — as transformers routes
    them (``served_routes``). Both servers at once: a start mostly waits on imports."""
    families = [f for f, shape in TINY_FAMILIES.items() if shape.get("num_experts")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        worst = dict(
            zip(families, pool.map(lambda f: served_after_a_push(tmp_path / f, f), families), strict=True)
        )
    assert all(w <= 1e-4 for w in worst.values()), worst


def served_after_a_push(work: Path, family: str) -> float:
    """The largest log-prob difference of two greedy replies after one push."""
    model_dir = init_tiny(work / "model", seed=0, family=family)
    engine = EngineConfig(backend="sglang", dtype="float32")
    server = SGLangServer(
        engine, model_dir, work / "sglang", device="cpu", python=str(SGLANG_PYTHON), routes=True
    )
    server.start()
    try:
        layout, model = FlatLayout.of(ModelConfig.load(model_dir)), CausalLM.from_pretrained(model_dir)
        base = flat_of(model).numpy()
        flat = base + np.random.RandomState(1).randn(base.size).astype(np.float32) * 0.02
        call(server.url, lambda c: c.begin_weight_update())
        # One as a flat snapshot, one as a megatron cell streams it: whole tensors, experts fused.
        weights = flat if family == "qwen3_moe" else iter(layout.views(flat).items())
        TensorPush(server.url, layout, 1, "cpu", "float32", bucket_bytes=1 << 20).push(weights, 3)
        call(server.url, lambda c: c.end_weight_update())
        layout.load(model, flat)
        worst = 0.0
        for prompt in PROMPTS[:2]:
            reply = greedy(server.url, prompt, 12)
            assert reply["meta_info"]["weight_version"] == "3", family
            theirs = np.array([lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]])
            worst = max(worst, float(np.abs(theirs - recomputed(model, prompt, reply["output_ids"])).max()))
        served_routes(server.url, model)
        return worst
    finally:
        server.stop()


def served_routes(url: str, model: CausalLM) -> None:
    """SGLang's routed experts of a call: every position but the last generated one, as
    transformers routes them; a second call that extends the first finds its prefix cached and
    still gets its routes, the same; asked from a position on, it gets those alone."""
    c = model.config
    shape = (c.num_hidden_layers, c.num_experts_per_tok)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = call(url, lambda e: e.generate(PROMPTS[1], params, routes_from=0))
    routes1 = routed_experts(first["meta_info"], *shape)
    sequence = PROMPTS[1] + first["output_ids"]
    assert routes1.shape == (len(sequence) - 1, *shape)
    with routed(model) as capture:
        model(torch.tensor([sequence[:-1]]))
    alike = ~differing(torch.from_numpy(routes1.astype(np.int64)), capture.routes())
    assert alike.float().mean() >= 0.95, alike.float().mean()  # float32 both: ties aside, the same
    longer = sequence + [7, 8, 9]
    second = call(url, lambda e: e.generate(longer, params, routes_from=0))
    assert second["meta_info"]["cached_tokens"] >= len(PROMPTS[1])
    routes2 = routed_experts(second["meta_info"], *shape)
    assert routes2.shape == (len(longer) + 6 - 1, *shape)
    np.testing.assert_array_equal(routes2[: len(routes1)], routes1)  # the cached prefix's, complete
    third = call(url, lambda e: e.generate(longer, params, routes_from=len(sequence)))
    np.testing.assert_array_equal(routed_experts(third["meta_info"], *shape), routes2[len(sequence) :])
