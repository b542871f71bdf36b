"""Warm-starting the tiny model: brief supervised learning on imperfect demonstrations.

RL starts from a pretrained model in real life. Here the tiny model is taught the format of
the smoke suite — the harness's system prompt and tools, a ``write_file`` tool call, then
``finish``; some episodes delegate the write to a sub-agent (which hands back a summary), some
end with a summary call — from synthetic demonstrations that are deliberately only partly
right: they always write the right word, but often to the wrong file, so that the policy's
pass rate leaves room for RL to improve it (held-out: 17 % measured for seed 0).
Deterministic for a seed: bit for bit, whatever the thread count and, with the kernels pinned
(``warm_settings.PINNED_KERNELS``, as ``resolve`` runs it: ``python -m`` this module), whatever
the x86 CPU with AVX2; a few CPU minutes at most.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import torch

from gyre_hpc.agents.harness import MAIN_SYSTEM, SUB_SYSTEM, SUMMARIZE
from gyre_hpc.agents.tools import MAIN_TOOLS, SPECS, SUB_AGENT_TOOLS
from gyre_hpc.builtin_models.warm_settings import DELEGATE, RIGHT_FILE, STEPS, SUMMARY, WRONG_FILES
from gyre_hpc.models.causal_lm import CausalLM, save_weights
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.models.tokenizer import ChatTokenizer
from gyre_hpc.tasks.suites import WORDS, smoke


def _call(name: str, **args: str) -> str:
    return (
        '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args) + "}\n</tool_call><|im_end|>"
    )


def _tool_turn(result: str, then: str | None = None) -> str:
    """What the proxy appends after a reply: the tool result (and a user message), then the prompt."""
    user = f"<|im_start|>user\n{then}<|im_end|>\n" if then else ""
    return (
        f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n{user}"
        "<|im_start|>assistant\n"
    )


# (which system prompt the sequence starts with, token ids, which ids are the model's)
Example = tuple[str, list[int], list[bool]]


def _episode(
    tok: ChatTokenizer,
    system: str,
    tools: list[str],
    task: str,
    turns: list[tuple[str, str]],
    summary: str | None,
) -> list[tuple[list[int], list[bool]]]:
    """One context, built the way the proxy builds it; with ``summary``, also the summary call."""
    ids = tok.encode(
        tok.render(
            [{"role": "system", "content": system}, {"role": "user", "content": task}],
            [SPECS[t] for t in tools],
        )
    )
    mask = [False] * len(ids)
    for call, result in turns[:-1]:
        out, ctx = tok.encode(call), tok.encode(_tool_turn(result))
        ids, mask = ids + out + ctx, mask + [True] * len(out) + [False] * len(ctx)
    call, result = turns[-1]
    out = tok.encode(call)
    ids, mask = ids + out, mask + [True] * len(out)
    examples = [(ids, mask)]
    if summary is not None:  # the same context asked for a summary (compaction, or a sub-agent's hand-back)
        ask, text = tok.encode(_tool_turn(result, SUMMARIZE)), tok.encode(summary + "<|im_end|>")
        examples.append((ids + ask + text, mask + [False] * len(ask) + [True] * len(text)))
    return examples


def demonstrations(tok: ChatTokenizer, spec: str, rng: random.Random) -> list[Example]:
    """The training sequences of one smoke episode: partly right on purpose."""
    path = "answer.txt" if rng.random() < RIGHT_FILE else rng.choice(WRONG_FILES)
    wrote = f"wrote 4 bytes to {path}"
    summary = f"Wrote done to {path}."
    if rng.random() < DELEGATE:
        sub_task = f"Write the word done to {path}."
        main = _episode(
            tok,
            MAIN_SYSTEM,
            MAIN_TOOLS,
            spec,
            [(_call("delegate", task=sub_task), summary), (_call("finish", summary="done"), "ok")],
            None,
        )
        sub = _episode(
            tok,
            SUB_SYSTEM,
            SUB_AGENT_TOOLS,
            sub_task,
            [
                (_call("write_file", path=path, content="done"), wrote),
                (_call("finish", summary=summary), "ok"),
            ],
            summary,
        )
        return [("main", *main[0]), *(("sub", *e) for e in sub)]
    main = _episode(
        tok,
        MAIN_SYSTEM,
        MAIN_TOOLS,
        spec,
        [(_call("write_file", path=path, content="done"), wrote), (_call("finish", summary="done"), "ok")],
        summary if rng.random() < SUMMARY else None,
    )
    return [("main", *e) for e in main]


def warmstart(
    model_dir: str | Path,
    suite: str = "smoke",
    seed: int = 0,
    steps: int = STEPS,
    batch: int = 4,
    lr: float = 2e-3,
    progress: Callable[[int, int], None] = lambda done, total: None,
    family: str = "qwen3",
) -> Path:
    """Build the warm-started model into ``model_dir``; ``progress(done, total)`` after each of
    its ``steps`` optimizer steps (the CLI draws a bar: the build takes minutes). ``family``: the
    tiny model's (``qwen3_moe`` for the routed-expert one)."""
    if suite != "smoke":
        raise ValueError(f"no warm start for suite {suite!r} (only smoke)")
    model_dir = init_tiny(model_dir, seed, WORDS, family)
    tok = ChatTokenizer(model_dir)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = CausalLM.from_pretrained(model_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # Every context starts with one of two system prompts (with its tools): run that prefix once
    # per step, without gradient, and train on what follows it.
    prefixes = {
        name: tok.encode(
            tok.render(
                [{"role": "system", "content": system}],
                [SPECS[t] for t in tools],
                add_generation_prompt=False,
            )
        )
        for name, system, tools in (("main", MAIN_SYSTEM, MAIN_TOOLS), ("sub", SUB_SYSTEM, SUB_AGENT_TOOLS))
    }
    tasks = smoke(steps * batch, seed + 17)
    for step in range(steps):
        opt.zero_grad()
        with torch.no_grad():
            past = {name: model(torch.tensor([ids]))[1] for name, ids in prefixes.items()}
        examples = [
            e
            for task in tasks[step * batch : (step + 1) * batch]
            for e in demonstrations(tok, task.spec, rng)
        ]
        for name, ids, mask in examples:
            n = len(prefixes[name])
            assert ids[:n] == prefixes[name]
            x, y = torch.tensor([ids[n:-1]]), torch.tensor(ids[n + 1 :])
            weight = torch.tensor(mask[n + 1 :], dtype=torch.float32)
            logp = torch.log_softmax(model(x, past=past[name])[0][0], -1).gather(1, y[:, None])[:, 0]
            (-(logp * weight).sum() / weight.sum() / len(examples)).backward()
        opt.step()
        progress(step + 1, steps)
    save_weights(model.eval(), model_dir / "model.safetensors")
    return model_dir


if __name__ == "__main__":  # python -m gyre_hpc.builtin_models.warmstart DIR FAMILY [STEPS]: progress lines
    import sys

    steps = int(sys.argv[3]) if len(sys.argv) > 3 else STEPS
    warmstart(
        sys.argv[1],
        family=sys.argv[2],
        steps=steps,
        progress=lambda done, total: print(done, total, flush=True),
    )
