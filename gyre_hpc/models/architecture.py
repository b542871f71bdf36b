"""A model's architecture as its ``config.json`` says it, without torch: what the planners (the memory
plan, the catalog of shapes) and the command line read, and what ``models.causal_lm`` builds
transformers' implementation from.

Every family (``models.family``) reads into the same ``ModelConfig``: the sizes every part of
gyre-hpc asks about are fields, and the whole ``config.json`` rides along (``hf``) for
transformers and SGLang, which know the rest (rope scaling, sliding windows, biases).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gyre_hpc.models.family import Family, family_of

_EXPERTS = ("num_experts", "num_local_experts")  # qwen3_moe, mixtral


@dataclass(frozen=True)
class ModelConfig:
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
    model_type: str = "qwen3"
    num_experts: int = 0
    """Routed experts a layer (0: dense)."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    """An expert's hidden size (``intermediate_size`` where the family has no own key)."""
    sliding_window: int | None = None
    """Keys a query sees where attention slides (None: all before it)."""
    hf: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The whole ``config.json`` it was read from (empty for a config built here)."""

    def __post_init__(self) -> None:
        family_of(self.model_type)

    @property
    def family(self) -> Family:
        return family_of(self.model_type)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> ModelConfig:
        family_of(d.get("model_type"), where)
        known = {f.name for f in fields(cls)} - {"hf"}
        hf, d = d, {**d}
        if d.get("head_dim") is None:  # absent, or null as some families write it
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
            d["rope_theta"] = d["rope_parameters"].get("rope_theta", 1_000_000.0)
        if not d.get("use_sliding_window", "sliding_window" in d):  # qwen2/3 keep a window they do not use
            d["sliding_window"] = None
        for key in _EXPERTS:
            if d.get(key):
                d["num_experts"] = d[key]
        if d.get("num_experts"):
            d.setdefault("moe_intermediate_size", d["intermediate_size"])
        return cls(**{k: v for k, v in d.items() if k in known}, hf=hf)

    @classmethod
    def load(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        return cls.from_dict(json.loads(path.read_text()), str(path))

    def to_hf(self) -> dict[str, Any]:
        """``config.json``: the one it was read from with these fields over it, or a fresh one."""
        mine = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "hf"}
        experts = mine.pop("num_experts"), mine.pop("num_experts_per_tok"), mine.pop("moe_intermediate_size")
        if experts[0]:
            key = "num_local_experts" if self.model_type == "mixtral" else "num_experts"
            mine |= {key: experts[0], "num_experts_per_tok": experts[1]}
            if self.model_type != "mixtral":
                mine["moe_intermediate_size"] = experts[2]
        fresh = {
            "architectures": [self.family.architecture],
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "torch_dtype": "float32",
            "use_cache": True,
        }
        merged = {**fresh, **self.hf, **mine}
        merged["architectures"] = merged.get("architectures") or fresh["architectures"]
        return merged

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    @property
    def qkv_bias(self) -> bool:
        return self.family.qkv_bias or bool(self.hf.get("attention_bias"))

    @property
    def dense_layers(self) -> list[int]:
        """The layers of a model with routed experts whose MLP is dense (Qwen3-MoE's
        ``mlp_only_layers``, and those ``decoder_sparse_step`` skips); none for a dense model."""
        if not self.num_experts:
            return []
        only, step = self.hf.get("mlp_only_layers") or [], self.hf.get("decoder_sparse_step") or 1
        return [i for i in range(self.num_hidden_layers) if i in only or (i + 1) % step]

    @property
    def renormalizes_topk(self) -> bool:
        """A token's top-k routing weights are rescaled to sum to 1 (Mixtral always; Qwen3-MoE
        where ``norm_topk_prob``), not left as their share of the softmax over all experts."""
        return self.model_type == "mixtral" or bool(self.hf.get("norm_topk_prob"))

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """Scaled rotary frequencies (Llama 3's ``rope_type = "llama3"``), as config.json says them."""
        found = self.hf.get("rope_scaling") or self.hf.get("rope_parameters") or {}
        return found if found.get("rope_type", found.get("type")) not in (None, "default") else None

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)
