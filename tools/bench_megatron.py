#!/usr/bin/env python3
"""The megatron trainer's costs on one device: HF → Megatron load, training tokens/s per
micro-step, snapshot export to (pinned) host memory, and Megatron → HF conversion; with
``--tree N``, one tree-packed micro-step of N unique tokens (a deep prefix forked into leaves).

python tools/bench_megatron.py                       # a ~1.7B Qwen3-shaped model in bf16 on a GPU
python tools/bench_megatron.py --size tiny --seq 256 # the same measurements on the CPU, in seconds
python tools/bench_megatron.py --tree 32768          # + a 32K-token packed tree (block mask on CUDA)
python tools/bench_megatron.py --size moe            # a Qwen3-MoE-shaped model: + the micro-step
                                                     # replaying routes (routing replay) against not

Random weights are written once as a Hugging Face directory (bf16 safetensors), then loaded the
way a cell loads them. Prints one table and writes the figures as JSON next to the model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

warnings.filterwarnings("ignore")

from gyre_hpc.models.architecture import ModelConfig  # noqa: E402
from gyre_hpc.models.catalog import tiny_config  # noqa: E402
from gyre_hpc.models.causal_lm import CausalLM, checkpoint_names  # noqa: E402
from gyre_hpc.models.flat import FlatLayout  # noqa: E402
from gyre_hpc.recipe.schema import TrainerConfig  # noqa: E402
from gyre_hpc.trainer.megatron_backend import MegatronTrainer  # noqa: E402
from gyre_hpc.trainer.megatron_weights import megatron_to_hf  # noqa: E402
from gyre_hpc.trajectory.sequences import TrainSequence  # noqa: E402

SIZES = {
    # Qwen3-1.7B's shape.
    "1.7b": ModelConfig(
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40_960,
    ),
    "tiny": replace(tiny_config(4096, []), max_position_embeddings=4096),
    # Qwen3-30B-A3B's layer (hidden 2048, experts of 768, 8 routed a token, 32 heads of 128, 4
    # key/value heads) with 64 experts, 8 layers deep: 3.2B parameters, 1.1B active a token,
    # trained whole (EP 1) on one H200 in bf16 with Adam.
    "moe": ModelConfig(
        model_type="qwen3_moe",
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=40_960,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "tiny-moe": replace(tiny_config(4096, [], "qwen3_moe"), max_position_embeddings=4096),
}


def random_routes(c: ModelConfig, tokens: int, seed: int = 2) -> np.ndarray | None:
    """k distinct experts a position and layer, drawn at random: what a replayed sequence carries."""
    if not c.num_experts:
        return None
    draw = np.random.default_rng(seed).random((tokens, c.num_hidden_layers, c.num_experts))
    return np.argsort(draw, -1)[..., : c.num_experts_per_tok].astype(np.int16)


def write_model(c: ModelConfig, model_dir: Path) -> Path:
    """Random weights (std 0.02) as one bf16 safetensors file, built layer by layer on the CPU."""
    model_dir.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = CausalLM(c)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    state = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    state = {n: t.contiguous() for n, t in checkpoint_names(model.hf, state).items()}  # experts one by one
    save_file(state, str(model_dir / "model.safetensors"), {"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(c.to_hf()))
    return model_dir


def exported(trainer: MegatronTrainer) -> np.ndarray:
    """The snapshot gathered anew (``weights`` returns the last one until the weights change)."""
    trainer.fresh = False
    return trainer.weights()


def timed(fn, repeat: int = 1) -> tuple[float, object]:  # noqa: ANN001
    best, out = float("inf"), None
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def tree_micro_step(trainer: MegatronTrainer, c: ModelConfig, unique: int, leaves: int, steps: int) -> dict:
    """One micro-step of a deep shared prefix (3/4 of ``unique``) forked into ``leaves`` paths,
    packed as a tree: its time and the device's peak memory; the paths would forward far more."""
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, c.vocab_size, unique * 3 // 4)
    tail = (unique - len(prefix)) // leaves
    seqs = []
    for _ in range(leaves):
        tokens = np.concatenate([prefix, rng.integers(0, c.vocab_size, tail)]).astype(np.int32)
        mask = (np.arange(len(tokens)) >= len(prefix)).astype(np.float32)
        seqs.append(TrainSequence("tree", tokens, mask, np.where(mask > 0, -2.0, 0.0).astype(np.float32),
                                  1.0, 1.0 / (leaves * tail)))  # fmt: skip
    trainer.packing = "tree"
    trainer.micro_step(seqs)  # warm-up (on CUDA: compiles the block-sparse attention)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    tree_s, stats = timed(lambda: trainer.micro_step(seqs), steps)
    trainer.packing = "paths"
    cuda = torch.cuda.is_available()
    return {
        "tree_unique_tokens": stats.tokens,
        "tree_path_tokens": sum(len(s) for s in seqs),
        "tree_micro_step_s": round(tree_s, 4),
        "tree_tokens_per_s": round(stats.tokens / tree_s, 1),
        "tree_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="1.7b" if torch.cuda.is_available() else "tiny")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per training sequence")
    ap.add_argument("--steps", type=int, default=3, help="timed micro-steps (after one warm-up)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--dir", type=Path, default=None, help="where the random model is written")
    ap.add_argument("--tree", type=int, default=0, help="unique tokens of a tree-packed micro-step; 0: none")
    ap.add_argument("--leaves", type=int, default=8, help="leaves of that tree")
    args = ap.parse_args()
    c = replace(SIZES[args.size], max_position_embeddings=max(args.seq, args.tree, 4096))
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-megatron-"))
    model_dir = write_model(c, root / args.size)

    cfg = TrainerConfig(dtype=args.dtype, lr=1e-6)
    start_s, trainer = timed(lambda: MegatronTrainer(model_dir, cfg, core=True))
    assert isinstance(trainer, MegatronTrainer)
    load_s, _ = timed(lambda: trainer.load_files(model_dir))  # files → Megatron
    gb = trainer.numel * 4 / 1e9  # the flat fp32 snapshot

    rng = np.random.default_rng(0)
    mask = (np.arange(args.seq) >= args.seq // 4).astype(np.float32)
    seq = TrainSequence(
        "bench",
        rng.integers(0, c.vocab_size, args.seq).astype(np.int32),
        mask,
        np.where(mask > 0, -2.0, 0.0).astype(np.float32),
        1.0,
        1.0 / mask.sum(),
    )
    # with routed experts, also the same micro-step sending every token through given experts
    replayed = replace(seq, routes=random_routes(c, args.seq)) if c.num_experts else None
    for s in (seq, replayed):  # warm-up
        if s is not None:
            trainer.micro_step([s])
    step_s, _ = timed(lambda: trainer.micro_step([seq]), args.steps)
    replay = {}
    if replayed is not None:
        replay_s, _ = timed(lambda: trainer.micro_step([replayed]), args.steps)
        replay = {"replay_micro_step_s": round(replay_s, 4), "replay_over_free": round(replay_s / step_s, 3)}
    export_s, _ = timed(lambda: exported(trainer), 3)
    to_hf_s, _ = timed(
        lambda: sum(
            t.numel() for _, t in megatron_to_hf(lambda n: [trainer.params[n].detach()], trainer.layout, 0)
        ),
        3,
    )
    figures = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "size": args.size,
        "parameters": trainer.numel,
        "dtype": args.dtype,
        "seq": args.seq,
        "trainer_start_s": round(start_s, 3),
        "hf_to_megatron_load_s": round(load_s, 3),
        "micro_step_s": round(step_s, 4),
        "train_tokens_per_s": round(args.seq / step_s, 1),
        "snapshot_export_s": round(export_s, 4),
        "snapshot_export_gb_per_s": round(gb / export_s, 2),
        "megatron_to_hf_s": round(to_hf_s, 4),
        "host_buffer_pinned": bool(torch.from_numpy(trainer.flat).is_pinned()),
        **replay,
    }
    out = root / "bench_megatron.json"
    out.write_text(json.dumps(figures, indent=1) + "\n")  # what a time limit would leave
    if args.tree:  # the long one: a cold compile of the block mask and the attention
        figures.update(tree_micro_step(trainer, c, args.tree, args.leaves, args.steps))
        out.write_text(json.dumps(figures, indent=1) + "\n")
    apply_s, _ = timed(lambda: trainer.apply(1))
    FlatLayout.of(c).views(trainer.weights())  # the snapshot is readable as HF tensors
    figures["apply_s"] = round(apply_s, 4)
    width = max(map(len, figures))
    for k, v in figures.items():
        print(f"{k:<{width}}  {v}")
    out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
