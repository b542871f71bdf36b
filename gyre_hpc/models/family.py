"""The model families gyre-hpc trains and serves, read from a model directory's ``config.json``.

A family is Hugging Face's ``model_type``. Its implementation is transformers' own (built by
``models.causal_lm``); this table says only what the rest of gyre-hpc must know about it without
torch: the architecture class ``config.json`` names, whether its experts are routed, and the
tool-call format its chat template writes (what the
proxy has to parse). It knows nothing about weights or shapes (``models.architecture``).

Llama 3 and SmolLM2 are ``llama``; Qwen2 and Qwen2.5 are ``qwen2``; Mistral is ``mistral``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    """The transformers class ``config.json``'s ``architectures`` names."""
    experts: bool = False
    """Routed experts (mixture of experts): total and active parameters differ."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before the rotary embedding (Qwen3)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2; any family whose config.json says
    ``attention_bias``)."""
    tool_format: str | None = None
    """The tool-call format its chat template writes, where the proxy parses it; None: not yet."""


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM"),
        Family("mistral", "MistralForCausalLM"),
        Family("mixtral", "MixtralForCausalLM", experts=True),
        Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, tool_format="hermes"),
        Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, tool_format="hermes"),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            experts=True,
            qk_norm=True,
            tool_format="hermes",
        ),
    )
}


class UnsupportedFamily(ValueError):
    """A model directory of a family gyre-hpc does not run (one line, naming what does)."""


def family_of(model_type: str | None, where: str = "config.json") -> Family:
    """The family of ``model_type``; anything else is refused in one line naming what is supported."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    supported = ", ".join(sorted(FAMILIES))
    raise UnsupportedFamily(
        f"{where}: model_type {model_type!r} is not a supported family; supported: {supported}"
    )
