#!/usr/bin/env python3
"""Routing replay: how differently a bf16 engine and an fp32 trainer route the same tokens, and
what that does to the trainer/rollout log-prob mismatch, with and without replay.

The embedded engine (``--engine-dtype``, bfloat16 by default) samples ``--prompts`` smoke-suite
prompts (the harness's system prompt, tools and task) for ``--tokens`` tokens each at temperature
1, returning each position's routed experts as SGLang does. The trainer's model (float32, the
same weights) then forwards every sampled sequence three ways: routing freely, replaying the
engine's routes (``models.routing``), and — the floor — the dense tiny model of the same shape
(``--dense``) on its own samples. Reported, side by side:

  routes     share of forwarded positions routed to a different set of experts in ≥ 1 layer,
             and share of (position, layer) choices that differ, trainer vs engine
  mismatch   mean and p99 |log π_trainer − log π_engine| over the sampled tokens (the same
             version: the same weights), and the share above 0.1

    python tools/bench_routing_replay.py [--model tiny-moe-warm] [--dense tiny-warm] [--prompts 64]
"""

from __future__ import annotations

import argparse
import base64
import json

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from gyre_hpc.agents.harness import MAIN_SYSTEM
from gyre_hpc.agents.tools import MAIN_TOOLS, SPECS
from gyre_hpc.builtin_models.resolve import resolve_model
from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.sampling import SamplingParams
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.routing import differing, routed
from gyre_hpc.models.tokenizer import ChatTokenizer
from gyre_hpc.tasks.suites import smoke


def sample(model_dir, dtype: torch.dtype, prompts: int, tokens: int) -> list[dict]:  # noqa: ANN001
    """Each sample's tokens, output log-probs and (MoE) routes, from the embedded engine."""
    tok = ChatTokenizer(model_dir)
    engine = Engine(model_dir, dtype=dtype, max_running=prompts)
    c = engine.config
    done: list[dict] = []
    sent: dict[str, list[int]] = {}
    for i, task in enumerate(smoke(prompts, 1234)):
        messages = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": task.spec}]
        sent[str(i)] = tok.encode(tok.render(messages, [SPECS[t] for t in MAIN_TOOLS]))
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0, sampling_seed=i, ignore_eos=True)
        engine.submit(sent[str(i)], params, done.append, rid=str(i), routes_from=0)
    while engine.step():
        pass
    out = []
    for r in done:
        meta = r["meta_info"]
        item = {
            "full": sent[meta["id"]] + r["output_ids"],
            "prompt_len": len(sent[meta["id"]]),
            "logprobs": np.array([lp for lp, _, _ in meta["output_token_logprobs"]]),
        }
        if "routed_experts" in meta:  # positions 0 … the last but one
            flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4")
            item["routes"] = flat.reshape(-1, c.num_hidden_layers, c.num_experts_per_tok)
        out.append(item)
    return out


def measure(model_dir, engine_dtype: torch.dtype, prompts: int, tokens: int) -> dict:  # noqa: ANN001
    samples = sample(model_dir, engine_dtype, prompts, tokens)
    trainer = CausalLM.from_pretrained(model_dir)  # float32
    moe = bool(trainer.config.num_experts)
    renorm = trainer.config.renormalizes_topk if moe else False
    gaps: dict[str, list[np.ndarray]] = {"free": [], "replay": []}
    moved, choices = [], []
    for s in samples:
        ids = torch.tensor([s["full"][:-1]])  # the engine forwarded every position but the last
        start = s["prompt_len"] - 1  # the position whose logits sampled the first output token
        out = torch.tensor(s["full"][s["prompt_len"] :])
        for mode in ("free", "replay") if moe else ("free",):
            replay = torch.tensor(s["routes"], dtype=torch.int64) if mode == "replay" else None
            with torch.no_grad(), routed(trainer, replay, renorm) as capture:
                logits = trainer(ids)[0][0].float()
            logp = torch.log_softmax(logits[start:], -1).gather(-1, out[:, None])[:, 0]
            gaps[mode].append(np.abs(logp.numpy() - s["logprobs"]))
            if moe and mode == "free":
                theirs, mine = torch.tensor(s["routes"], dtype=torch.int64), capture.routes()
                rerouted = differing(mine, theirs).numpy()
                moved.append(rerouted)
                choices.append((mine.sort(-1).values != theirs.sort(-1).values).any(-1).numpy())
    result: dict = {"model": str(model_dir), "moe": moe, "tokens": int(sum(len(g) for g in gaps["free"]))}
    if moe:
        result["positions_rerouted"] = float(np.concatenate(moved).mean())
        result["layer_choices_rerouted"] = float(np.concatenate(choices).mean())
    for mode, g in gaps.items():
        if g:
            a = np.concatenate(g)
            result[mode] = {"mean": float(a.mean()), "p99": float(np.quantile(a, 0.99)),
                            "over_0.1": float((a > 0.1).mean())}  # fmt: skip
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-moe-warm")
    ap.add_argument("--dense", default="tiny-warm")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.engine_dtype)
    moe = measure(resolve_model(args.model), dtype, args.prompts, args.tokens)
    dense = measure(resolve_model(args.dense), dtype, args.prompts, args.tokens)
    table = Table(title=f"{args.engine_dtype} engine, float32 trainer: {moe['tokens']} sampled tokens each")
    cols = ("", "rerouted positions (≥1 layer)", "rerouted layer choices", "|Δlogp| mean", "p99", "> 0.1")
    for col in cols:
        table.add_column(col, justify="right")
    pos, ch = f"{moe['positions_rerouted']:.1%}", f"{moe['layer_choices_rerouted']:.1%}"
    rows = [("MoE, router free", moe["free"], pos, ch), ("MoE, routing replay", moe["replay"], "0", "0"),
            ("dense (floor)", dense["free"], "–", "–")]  # fmt: skip
    for name, m, p, c in rows:
        table.add_row(name, p, c, f"{m['mean']:.4f}", f"{m['p99']:.4f}", f"{m['over_0.1']:.2%}")
    Console(width=120).print(table)
    print(json.dumps({"moe": moe, "dense": dense}))


if __name__ == "__main__":
    main()
