"""Real servers on loopback for tests: embedded engines and the proxy, each on a free port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gyre_hpc.models.causal_lm import CausalLM, save_weights
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.models.tokenizer import ChatTokenizer
from gyre_hpc.proxy.loopback import LoopbackServing
from gyre_hpc.recipe.schema import ProxyConfig


class Stack(LoopbackServing):
    """``n`` embedded engines and a proxy in front of them, as ``eval`` runs them."""

    def __init__(
        self, model: Path, run_dir: Path, n: int = 1, config: ProxyConfig | None = None, **engine_kw: Any
    ) -> None:
        super().__init__(model, run_dir, n, config or ProxyConfig(), capacity=8, **engine_kw)

    async def __aenter__(self) -> Stack:
        await super().__aenter__()
        self.urls = self.engine_urls
        self.url = self.proxy_url
        return self

    def key(self, run: str, role: str = "main") -> str:
        return super().key(run, role)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
]


def tool_calling_model(path: Path, seed: int = 0, steps: int = 200, turns: int = 6) -> Path:
    """The tiny model, briefly trained so that every assistant turn is one ``run_shell`` tool call.

    It learns from one rendered conversation of ``turns`` tool calls and tool responses, built
    the way the proxy builds contexts, with the loss on the assistant tokens only.
    """
    init_tiny(path, seed)
    tok = ChatTokenizer(path)
    history = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}]
    ids, mask = tok.encode(tok.render(history, TOOLS)), []
    mask = [False] * len(ids)
    call = tok.encode(
        '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
    )
    for turn in range(turns):
        response = tok.encode(
            f"\n<|im_start|>user\n<tool_response>\nran ({turn})\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        ids, mask = ids + call + response, mask + [True] * len(call) + [False] * len(response)
    model = CausalLM.from_pretrained(path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, target = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
    weight = torch.tensor(mask[1:], dtype=torch.float32)
    for _ in range(steps):
        logp = torch.log_softmax(model(x)[0][0], -1).gather(1, target[:, None])[:, 0]
        loss = -(logp * weight).sum() / weight.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_weights(model.eval(), path / "model.safetensors")
    return path
