"""The shapes of published models (Qwen3 dense and MoE, Qwen2.5, Llama 3.1, Mistral, Mixtral,
SmolLM2), for planning a recipe whose model is not on this machine.

``gyre-hpc recipe check`` runs on a login node or a laptop, where ``run.model`` (a directory on
the cluster's shared storage) may not exist. The memory plan then reads the model's shape from
here, matched by the directory's name (``/shared/models/Qwen3-8B`` → ``Qwen3-8B``,
``Llama-3.1-70B-Instruct`` → ``llama-3.1-70b``); a directory
that does exist is always read instead. Only the sizes are known here: no weights, no tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.family import UnsupportedFamily


def _qwen3(hidden: int, ffn: int, layers: int, heads: int, tied: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=tied,
    )


VOCAB_SIZE = 2048
"""The tiny model's vocabulary (``models.tiny``)."""


TINY_FAMILIES: dict[str, dict] = {
    "qwen3": {},
    "qwen2": {"rope_theta": 10_000.0},
    "llama": {  # untied, with Llama 3's scaled rotary frequencies
        "tie_word_embeddings": False,
        "rope_theta": 500_000.0,
        "rms_norm_eps": 1e-5,
        "hf": {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        },
    },  # fmt: skip
    "mistral": {"tie_word_embeddings": False, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5},
    # untied, routing weights renormalised, as Qwen3-30B-A3B and 235B-A22B are published (SGLang's
    # Qwen3-MoE does not tie its head to the embedding)
    "qwen3_moe": {
        "tie_word_embeddings": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "hf": {"norm_topk_prob": True},
    },
    "mixtral": {
        "tie_word_embeddings": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 384,
    },  # fmt: skip
}
"""Each family's tiny model: the same sizes, the family's own details over them."""


def tiny_config(vocab_size: int, eos: list[int], model_type: str = "qwen3") -> ModelConfig:
    return ModelConfig(
        **{
            "vocab_size": vocab_size,
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "tie_word_embeddings": True,
            "max_position_embeddings": 32768,
            "eos_token_id": eos,
            "bos_token_id": None,
            "model_type": model_type,
            **TINY_FAMILIES[model_type],
        }
    )


def _published(model_type: str, vocab: int, hidden: int, ffn: int, layers: int, heads: int, kv: int,
               head_dim: int, tied: bool, **more: object) -> ModelConfig:  # fmt: skip
    return ModelConfig(
        model_type=model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        tie_word_embeddings=tied, **more,  # type: ignore[arg-type]
    )  # fmt: skip


# Each model's config.json as published: hidden, intermediate, layers, attention heads, tied; the
# others' vocabulary, key/value heads and head size, and their experts (total, routed a token, size).
KNOWN: dict[str, ModelConfig] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, False),
    "qwen3-30b-a3b": _published("qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 128, False,
                                num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "qwen3-235b-a22b": _published("qwen3_moe", 151936, 4096, 12288, 94, 64, 4, 128, False,
                                  num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536),
    "qwen2.5-7b": _published("qwen2", 152064, 3584, 18944, 28, 28, 4, 128, False),
    "qwen2.5-72b": _published("qwen2", 152064, 8192, 29568, 80, 64, 8, 128, False),
    "llama-3.1-8b": _published("llama", 128256, 4096, 14336, 32, 32, 8, 128, False),
    "llama-3.1-70b": _published("llama", 128256, 8192, 28672, 80, 64, 8, 128, False),
    "mistral-7b-v0.3": _published("mistral", 32768, 4096, 14336, 32, 32, 8, 128, False),
    "mixtral-8x7b-v0.1": _published("mixtral", 32000, 4096, 14336, 32, 32, 8, 128, False,
                                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
    "smollm2-135m": _published("llama", 49152, 576, 1536, 30, 9, 3, 64, True),
    # The paper's 2.4T mixture of experts, whose config is not published: Qwen3-235B-A22B's design
    # (qwen3_moe, 8 experts a token, renormalised) at Qwen2.5-72B's width (hidden 8192, 64 query
    # heads and 8 key/value heads of 128), 96 layers of 512 experts of 2048: 2.49T parameters,
    # 56.0B active a token (the memory plan's count).
    "qwen3-moe-2.4t": _published("qwen3_moe", 151936, 8192, 29568, 96, 64, 8, 128, False,
                                 num_experts=512, num_experts_per_tok=8, moe_intermediate_size=2048,
                                 hf={"norm_topk_prob": True}),
}  # fmt: skip


def model_shape(model: str) -> ModelConfig | None:
    """The config of ``run.model``: its ``config.json`` where the directory exists here, the tiny
    model's for the built-ins, a published model's by the directory's name, else None. A family
    gyre-hpc does not run raises ``UnsupportedFamily``."""
    if model in ("tiny", "tiny-warm"):
        return tiny_config(VOCAB_SIZE, [])
    if model == "tiny-moe-warm":
        return tiny_config(VOCAB_SIZE, [], "qwen3_moe")
    if model == "smollm2":
        return KNOWN["smollm2-135m"]
    path = Path(model)
    if (path / "config.json").is_file():
        try:
            return ModelConfig.load(path)
        except UnsupportedFamily:
            raise
        except (OSError, ValueError, KeyError, TypeError):
            return None
    name = path.name.lower()
    for base in (name, name.removesuffix("-base"), name.removesuffix("-instruct")):
        if base in KNOWN:
            return KNOWN[base]
    return None
