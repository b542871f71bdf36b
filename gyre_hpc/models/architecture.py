"""A model's architecture as its ``config.json`` says it, without torch: what the planners (the memory
plan, the catalog of shapes) and the command line read, and what the torch decoder
(``models.qwen3``) builds from."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen3Config:
        known = {f.name for f in fields(cls)}
        d = {**d}
        d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
            d["rope_theta"] = d["rope_parameters"].get("rope_theta", 1_000_000.0)
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, model_dir: str | Path) -> Qwen3Config:
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "torch_dtype": "float32",
            "use_cache": True,
            **{f.name: getattr(self, f.name) for f in fields(self)},
        }

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)
