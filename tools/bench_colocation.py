"""The checks a first GPU run needs answered, in one call (``tools/gpu_bench.sh run``):

1. push   a version from one process into another on the same GPU: by reference (CUDA IPC,
          what ``engines.sglang.TensorPush`` sends), bucket by bucket, bf16 and fp32, with the
          sender's peak; and by an NCCL broadcast between the two (the same GPU twice in one
          communicator: NCCL's refusal, or its figures, are recorded).
2. flex   FlexAttention over a dozen tree lengths at Qwen3-8B's attention shapes, padded to
          ``tree_attention.padded_length``: compiles, seconds (forward and backward) and peak
          memory per length, and a forward without grad as recomputation runs it (its compiles
          counted apart: grad mode is part of what a compiled frame is specialised to).
3. cycle  colocation: an engine-sized allocation in another process, released; a trainer rank's
          state (bf16 weights, fp32 masters, Adam) resumed from the host, one optimizer step,
          released (``trainer.offload``); the engine's allocation taken again.

On the CPU (``--device cpu``, the test suite's tiny sizes) the same code runs with gloo and a
shared-memory file instead of NCCL and CUDA IPC, forward-only attention and resident-set sizes.

    python tools/bench_colocation.py --device cuda --out DIR [--phases push,broadcast,flex,cycle]

Each phase adds its figures to DIR/bench_colocation.json as it ends (figures already there from
another call stay), so a call cut short by its time limit still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gyre_hpc.trainer.offload import Offload, moments  # noqa: E402
from gyre_hpc.trainer.tree_attention import block_mask, flex, padded_ends, padded_length  # noqa: E402

MIB = 1 << 20
PHASES = ("push", "broadcast", "flex", "cycle")


def used(device: str) -> int:
    """Bytes in use: on the GPU all processes' (what the driver reports), else this one's peak RSS."""
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return total - free
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- 1. push ---------------------------------------------------------------------------------


def receiver(inbox: mp.Queue, acks: mp.Queue, numel: int, dtype: str, device: str) -> None:
    """The engine's side: its weights, and each bucket copied in from where the sender left it."""
    weights = torch.empty(numel, dtype=getattr(torch, dtype), device=device)
    acks.put("ready")
    while (msg := inbox.get()) is not None:
        start, bucket = msg
        weights[start : start + bucket.numel()].copy_(bucket)
        del bucket
        acks.put("ok")


def push_by_reference(device: str, numel: int, bucket: int, dtype: str) -> dict:
    ctx = mp.get_context("spawn")
    inbox, acks = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(inbox, acks, numel, dtype, device))
    proc.start()
    assert acks.get(timeout=300) == "ready"
    flat = torch.randn(numel)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0, staged_peak = time.perf_counter(), 0
    for start in range(0, numel, bucket):
        staged = flat[start : start + bucket].to(getattr(torch, dtype)).to(device)
        staged_peak = max(staged_peak, staged.numel() * staged.element_size())
        inbox.put((start, staged))
        assert acks.get(timeout=300) == "ok"
        del staged
    seconds = time.perf_counter() - t0
    # On the GPU what the allocator saw (the sender allocates nothing else there).
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else staged_peak
    inbox.put(None)
    proc.join(60)
    size = numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return {
        "dtype": dtype, "seconds": round(seconds, 3), "gb_per_s": round(size / seconds / 1e9, 2),
        "sender_peak_mb": round(peak / MIB, 1), "bucket_mb": round(bucket * size / numel / MIB, 1),
    }  # fmt: skip


def broadcaster(rank: int, port: int, numel: int, device: str, out: mp.Queue) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    try:
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        t = torch.zeros(numel, dtype=torch.bfloat16, device=device)
        t0 = time.perf_counter()
        torch.distributed.broadcast(t, 0)
        if device == "cuda":
            torch.cuda.synchronize()
        out.put({"rank": rank, "seconds": round(time.perf_counter() - t0, 3)})
    except Exception as err:  # NCCL refuses a GPU twice in one communicator
        out.put({"rank": rank, "error": f"{type(err).__name__}: {str(err)[:300]}"})


def push_by_broadcast(device: str, numel: int, wait_s: float) -> dict:
    from gyre_hpc.launch.ports import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port("127.0.0.1")
    procs = [ctx.Process(target=broadcaster, args=(r, port, numel, device, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        try:
            results.append(out.get(timeout=wait_s))
        except Exception:
            results.append({"error": f"no answer within {wait_s:g} s (a rank hung)"})
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return {"ranks": results}


# ---- 2. flex ---------------------------------------------------------------------------------


def tree_ends(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random depth-first tree of ``n`` tokens: a shared prefix, then branches."""
    ends = np.empty(n, dtype=np.int64)
    stack = [(0, n)]
    while stack:
        start, stop = stack.pop()
        chain = min(stop - start, int(rng.integers(1, max(2, n // 8))))
        ends[start : start + chain] = stop
        at = start + chain
        while at < stop:
            size = min(stop - at, int(rng.integers(1, max(2, n // 4))))
            stack.append((at, at + size))
            at += size
    return ends


def flex_sweep(
    device: str, lengths: list[int], limit: int, heads: int, kv_heads: int, dim: int, budget_s: float = 1e9
) -> list[dict]:
    """One row per length, until ``budget_s`` is spent (each new padded length compiles)."""
    import torch._dynamo.utils as dynamo

    rng = np.random.default_rng(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    grad = device == "cuda"  # FlexAttention has no backward on the CPU
    rows = []
    began = time.perf_counter()
    for n in lengths:
        if time.perf_counter() - began > budget_s:
            rows.append({"tokens": n, "skipped": f"past the sweep's {budget_s:g} s"})
            continue
        length = padded_length(n, limit)
        before = dynamo.counters["stats"]["unique_graphs"]
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        mask = block_mask(padded_ends(tree_ends(n, rng), length), torch.device(device))
        q = torch.randn(1, heads, length, dim, dtype=dtype, device=device, requires_grad=grad)
        k, v = (
            torch.randn(1, kv_heads, length, dim, dtype=dtype, device=device, requires_grad=grad)
            for _ in "kv"
        )
        out = flex(q, k, v, mask)
        if grad:
            out.sum().backward()
            torch.cuda.synchronize()
        seconds, graphs = time.perf_counter() - t0, dynamo.counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        with torch.no_grad():  # recomputation's first forward
            flex(q, k, v, mask)
        rows.append({
            "tokens": n, "padded": length, "seconds": round(seconds, 3),
            "new_graphs": graphs - before,
            "no_grad_seconds": round(time.perf_counter() - t0, 3),
            "no_grad_new_graphs": dynamo.counters["stats"]["unique_graphs"] - graphs,
            "peak_mb": round((torch.cuda.max_memory_allocated() if grad else used(device)) / MIB, 1),
        })  # fmt: skip
    return rows


# ---- 3. cycle --------------------------------------------------------------------------------


def engine(inbox: mp.Queue, acks: mp.Queue, nbytes: int, device: str) -> None:
    """A stand-in for a server's static pool: held, released, taken again on command."""
    pool = torch.empty(nbytes, dtype=torch.uint8, device=device)
    acks.put(used(device))
    while (msg := inbox.get()) is not None:
        if msg == "release":
            del pool
            if device == "cuda":
                torch.cuda.empty_cache()
        else:
            pool = torch.empty(nbytes, dtype=torch.uint8, device=device)  # noqa: F841
        acks.put(used(device))


def cycle(device: str, engine_bytes: int, params: int) -> dict:
    """The cell's order: the engine lets go before the trainer steps, the trainer lets go (and
    empties its cache) before the engine takes its pool again, and back."""
    ctx = mp.get_context("spawn")
    inbox, acks = ctx.Queue(), ctx.Queue()
    weights = torch.zeros(params, dtype=torch.bfloat16, device=device)
    master = torch.zeros(params, dtype=torch.float32, device=device, requires_grad=True)
    master.grad = torch.zeros_like(master)
    opt = torch.optim.AdamW([master], lr=1e-6, foreach=False)
    opt.step()  # Adam's moments exist: the whole state of a core rank
    proc = ctx.Process(target=engine, args=(inbox, acks, engine_bytes, device))
    proc.start()
    phases = {"both_resident": acks.get(timeout=300)}
    inbox.put("release")
    phases["engine_released"] = acks.get(timeout=300)
    master.grad.normal_()
    opt.step()  # the trainer's step, with the GPU to itself
    with torch.no_grad():
        weights.copy_(master)

    def state() -> list[tuple[str, torch.Tensor]]:
        adam = moments(opt, {id(master): "master"})
        return [("weights", weights), ("master", master), ("grad", master.grad), *adam]

    off = Offload()
    t0 = time.perf_counter()
    moved = off.release(state())
    if device == "cuda":
        torch.cuda.empty_cache()
    phases["release_s"] = round(time.perf_counter() - t0, 3)
    phases["trainer_released"] = used(device)
    inbox.put("resume")
    phases["engine_resumed"] = acks.get(timeout=300)
    inbox.put("release")
    acks.get(timeout=300)
    t0 = time.perf_counter()
    off.resume(state(), torch.device(device))
    phases["resume_s"] = round(time.perf_counter() - t0, 3)
    phases["trainer_resumed"] = used(device)
    inbox.put(None)
    proc.join(60)
    figures = {k: (round(v / 1e9, 2) if isinstance(v, int) else v) for k, v in phases.items()}
    return {
        **figures,
        "trainer_state_gb": round(moved / 1e9, 2),
        "engine_pool_gb": round(engine_bytes / 1e9, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--push-gb", type=float, default=4.0, help="bf16 gigabytes pushed (fp32: twice)")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument(
        "--rank-params", type=float, default=2.05e9, help="a trainer rank's parameters (8B / tp 4)"
    )
    ap.add_argument("--flex-budget-s", type=float, default=240, help="no new length after this")
    ap.add_argument("--engine-fraction", type=float, default=0.6, help="of the GPU the engine's pool takes")
    ap.add_argument("--broadcast-wait-s", type=float, default=20, help="how long a broadcast rank may take")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"a comma list of {', '.join(PHASES)}")
    args = ap.parse_args()
    phases = args.phases.split(",")
    if bad := sorted(set(phases) - set(PHASES)):
        ap.error(f"--phases: {', '.join(bad)}; valid: {', '.join(PHASES)}")
    cuda = args.device == "cuda"
    numel = int(args.push_gb * 1e9 / 2)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_colocation.json"
    figures: dict = json.loads(path.read_text()) if path.exists() else {}
    figures["device"] = torch.cuda.get_device_name() if cuda else "cpu"

    def done(name: str, value: object) -> None:
        figures[name] = value
        path.write_text(json.dumps(figures, indent=2) + "\n")
        print(json.dumps({name: value}, indent=2), flush=True)

    if "push" in phases:
        done("push_by_reference", [
            push_by_reference(args.device, numel, args.bucket_mb * MIB // size, dtype)
            for dtype, size in (("bfloat16", 2), ("float32", 4))
        ])  # fmt: skip
    if "broadcast" in phases:
        done("push_by_broadcast", push_by_broadcast(args.device, numel, args.broadcast_wait_s))
    if "flex" in phases:
        lengths = [1000, 2500, 4096, 6000, 8191, 10000, 14000, 16384, 20000, 24576, 28000, 32768]
        limit, shape = (32768, (32, 8, 128)) if cuda else (512, (4, 2, 32))
        if not cuda:
            lengths = [n * 512 // 32768 + 16 for n in lengths]
        done("flex", flex_sweep(args.device, lengths, limit, *shape, budget_s=args.flex_budget_s))
    if "cycle" in phases:
        total = torch.cuda.mem_get_info()[1] if cuda else 1 << 30
        state = int(args.rank_params) * (2 + 4 + 4 + 8)
        # The engine's pool and the rank's state never exceed 90 % of the GPU (an H100 too).
        pool = max(0, int(min(args.engine_fraction * total, 0.9 * total - state)))
        done("cycle", cycle(args.device, pool, int(args.rank_params)))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # as the runtime sets it beside SGLang
    if not torch.cuda.is_available():
        torch.multiprocessing.set_sharing_strategy("file_system")
    main()
