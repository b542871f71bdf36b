"""The shapes of published Qwen3 models, for planning a recipe whose model is not on this machine.

``gyre-hpc recipe check`` runs on a login node or a laptop, where ``run.model`` (a directory on
the cluster's shared storage) may not exist. The memory plan then reads the model's shape from
here, matched by the directory's name (``/shared/models/Qwen3-8B`` → ``Qwen3-8B``); a directory
that does exist is always read instead. Only the sizes are known here: no weights, no tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from gyre_hpc.models.architecture import Qwen3Config


def _qwen3(hidden: int, ffn: int, layers: int, heads: int, tied: bool) -> Qwen3Config:
    return Qwen3Config(
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


def tiny_config(vocab_size: int, eos: list[int]) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        eos_token_id=eos,
        bos_token_id=None,
    )


# Each model's config.json as published: hidden, intermediate, layers, attention heads, tied.
KNOWN: dict[str, Qwen3Config] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, False),
}


def model_shape(model: str) -> Qwen3Config | None:
    """The config of ``run.model``: its ``config.json`` where the directory exists here, the tiny
    model's for the built-ins, a published model's by the directory's name, else None."""
    if model in ("tiny", "tiny-warm"):
        return tiny_config(VOCAB_SIZE, [])
    path = Path(model)
    if (path / "config.json").is_file():
        try:
            return Qwen3Config.load(path)
        except (OSError, ValueError, KeyError, TypeError):
            return None
    name = path.name.lower()
    for base in (name, name.removesuffix("-base"), name.removesuffix("-instruct")):
        if base in KNOWN:
            return KNOWN[base]
    return None
