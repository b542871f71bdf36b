"""The Qwen3 decoder in plain torch, loading Hugging Face checkpoints by their own tensor names.

RMSNorm, RoPE, grouped-query attention with per-head q/k RMSNorm, SwiGLU MLP, tied or untied
embeddings as ``config.json`` says. The same code path loads the offline tiny model and a real
Qwen3 checkpoint directory (``config.json`` + ``*.safetensors``).

The forward pass takes and returns the attention keys/values explicitly, so an engine can
keep them per sequence, reuse a cached prefix, batch sequences of different lengths, and move
them to another engine. The model knows nothing about tokenization or sampling.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from gyre_hpc.models.architecture import Qwen3Config

KV = tuple[torch.Tensor, torch.Tensor]  # per layer: keys, values [batch, kv_heads, length, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` [batch, heads, time, dim] at ``positions`` [batch, time]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    freqs = positions.float()[:, None, :, None] * inv_freq  # [b, 1, t, dim/2]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, past: KV | None, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, KV]:
        b, t, _ = x.shape
        c = self.c
        q = self.q_norm(self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        new = (k, v)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        if mask is None:  # plain causal over [past | new]
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=past is None or past[0].shape[2] == 0
            )
        else:
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), new


class MLP(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, past: KV | None, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, KV]:
        h, new = self.self_attn(self.input_layernorm(x), positions, past, mask)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), new


class Backbone(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Tensor names match Hugging Face's, so checkpoints load with ``load_state_dict``."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        past: list[KV] | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """Logits for ``input_ids`` [batch, time] and the new keys/values of every layer.

        ``past``: keys/values of earlier positions per layer; ``mask`` [batch, time, past+time]
        (True = attend) for batches whose sequences differ in length. Without a mask the
        attention is causal over past + new.
        """
        b, t = input_ids.shape
        start = 0 if past is None else past[0][0].shape[2]
        at = input_ids.device
        if positions is None:
            positions = torch.arange(start, start + t, device=at).expand(b, -1)
        if mask is None and start and t > 1:  # causal over [past | new], new queries offset by the past
            keys, queries = torch.arange(start + t, device=at), start + torch.arange(t, device=at)
            mask = (keys[None, :] <= queries[:, None]).expand(b, -1, -1)
        x = self.model.embed_tokens(input_ids)
        new_kv = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, positions, None if past is None else past[i], mask)
            new_kv.append(kv)
        return self.lm_head(self.model.norm(x)), new_kv

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
        model_dir = Path(model_dir)
        model = cls(Qwen3Config.load(model_dir))
        state: dict[str, torch.Tensor] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(f))
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(
                f"{model_dir}: checkpoint does not fit Qwen3 (missing {missing[:5]}, "
                f"unexpected {unexpected[:5]})"
            )
        return model.to(dtype).eval()
