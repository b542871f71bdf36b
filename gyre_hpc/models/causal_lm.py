"""Any supported family's decoder (``models.family``), as transformers implements it, behind the one
forward pass gyre-hpc's trainers and embedded engine call.

``CausalLM(config)`` builds transformers' own model class for the family and keeps its two parts,
``model`` and ``lm_head``, as its own: parameter names are the Hugging Face checkpoint's, so
checkpoints load with ``load_state_dict`` and the flat layout (``models.flat``) names them alike.

The forward pass takes and returns the attention keys/values explicitly (``Exchange``, a cache
that holds what the caller passes in and records what the layers add), so an engine can keep
them per sequence, reuse a cached prefix, batch sequences of different lengths, and move them to
another engine, and a trainer can forward a tree's chains over their ancestors' keys. The model
knows nothing about tokenization or sampling.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from gyre_hpc.models.architecture import ModelConfig

KV = tuple[torch.Tensor, torch.Tensor]  # per layer: keys, values [batch, kv_heads, length, head_dim]


class Exchange:
    """A transformers cache that hands each layer the caller's past keys/values and records the
    new ones (``new``): nothing is kept between forward passes. Keys are post-rotary, as SGLang
    and transformers' own caches hold them."""

    is_compileable = False

    def __init__(self, past: list[KV] | None, layers: int) -> None:
        self.past = past
        self.new: list[KV | None] = [None] * layers

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs) -> KV:  # noqa: ANN002, ANN003
        self.new[layer_idx] = (keys, values)
        if self.past is None:
            return keys, values
        k, v = self.past[layer_idx]
        return torch.cat([k, keys], 2), torch.cat([v, values], 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.past is None else self.past[0][0].shape[2]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


_IMPORTING = threading.Lock()


@functools.cache
def _transformers() -> SimpleNamespace:
    """What this module uses of transformers, imported once under a lock: its lazy attributes are
    not safe to resolve from two threads at once (two engines built side by side raised
    ImportError), and importing it costs ~2 s that a process which builds no model does not pay."""
    with _IMPORTING:
        import importlib

        import transformers

        return SimpleNamespace(
            AutoConfig=transformers.AutoConfig,
            AutoModelForCausalLM=transformers.AutoModelForCausalLM,
            no_init_weights=importlib.import_module("transformers.initialization").no_init_weights,
            conversion_mapping=importlib.import_module("transformers.conversion_mapping"),
            core_model_loading=importlib.import_module("transformers.core_model_loading"),
        )


def hf_config(config: ModelConfig):  # noqa: ANN201 - a transformers PretrainedConfig
    AutoConfig = _transformers().AutoConfig  # noqa: N806

    fields = config.to_hf()
    c = AutoConfig.for_model(fields.pop("model_type"), **fields)
    c._attn_implementation = "sdpa"  # boolean masks, and causal without one
    return c


class CausalLM(nn.Module):
    """Tensor names match Hugging Face's, so checkpoints load with ``load_state_dict``."""

    def __init__(self, config: ModelConfig, init: bool = True) -> None:
        transformers = _transformers()

        super().__init__()
        self.config = config
        # without ``init`` every weight is loaded next: the random initialisation is skipped
        with contextlib.nullcontext() if init else transformers.no_init_weights():
            hf = transformers.AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.float32)
        self.model, self.lm_head = hf.model, hf.lm_head
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        object.__setattr__(self, "hf", hf)  # for its name conversions; not a submodule (no second name)
        # transformers 5.2x renamed ``past_key_values`` to ``cache`` (SGLang's environment pins an older one)
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )

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
        hidden, kv = self.hidden(input_ids, positions, past, mask)
        return self.lm_head(hidden), kv

    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        past: list[KV] | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """``forward`` before the output layer: the last hidden states [batch, time, hidden] (a
        trainer turns the rows it needs into log-probs with ``lm_head.weight``,
        ``loss.vocab_logprobs``) and the new keys/values."""
        b, t = input_ids.shape
        start = 0 if past is None else past[0][0].shape[2]
        if positions is None:
            positions = torch.arange(start, start + t, device=input_ids.device).expand(b, -1)
        cache = Exchange(past, self.config.num_hidden_layers)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=None if mask is None else mask[:, None],
            use_cache=True,
            **{self._cache_kw: cache},
        )
        return out.last_hidden_state, cache.new  # type: ignore[return-value]

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
        model_dir = Path(model_dir)
        model = cls(ModelConfig.load(model_dir), init=False)
        state: dict[str, torch.Tensor] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(f))
        state = model_names(model.hf, state)
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(
                f"{model_dir}: checkpoint does not fit {model.config.family.architecture} "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
        return model.to(dtype).eval()


def save_weights(model: CausalLM, path: Path) -> None:
    """``model``'s weights as a checkpoint names them (``checkpoint_names``), in one file."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v.contiguous() for k, v in checkpoint_names(model.hf, state).items()}
    save_file(state, str(path), metadata={"format": "pt"})


def checkpoint_names(hf, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """``state`` (the model's parameter names) as a checkpoint names its tensors. The same for a
    dense family; a family whose experts transformers fuses into one tensor a layer gets them one
    per expert again (copies), by transformers' own conversion of the family."""
    if not _conversions(hf):
        return state
    return _transformers().core_model_loading.revert_weight_conversion(hf, state)


def model_names(hf, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """A checkpoint's tensors (``state``) under the model's parameter names: ``checkpoint_names``
    undone, by the same conversions transformers' ``from_pretrained`` applies."""
    conversions = _conversions(hf)
    params = dict(hf.named_parameters())
    if not conversions or all(k in params for k in state):
        return state
    from copy import deepcopy

    loading = _transformers().core_model_loading
    renamings = [c for c in conversions if isinstance(c, loading.WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, loading.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pending: dict[str, Any] = {}
    for key, tensor in sorted(state.items(), key=lambda kv: loading.dot_natural_key(kv[0])):
        renamed, pattern = loading.rename_source_key(key, renamings, converters)
        if pattern is None:
            pattern, op = key, pending.setdefault(renamed, loading.WeightRenaming(key, renamed))
        else:
            op = pending.setdefault(renamed, deepcopy(by_pattern[pattern]))
        op.add_tensor(renamed, key, pattern, tensor)
    out = {}
    for name, op in pending.items():
        for target, value in op.convert(name, model=hf, config=hf.config).items():
            out[target] = value[0] if isinstance(value, list) else value
    return out


def _conversions(hf) -> list:  # noqa: ANN001
    """transformers' conversions between ``hf``'s parameters and its checkpoints' tensors (none
    for a dense family)."""
    transformers = _transformers()
    get_model_conversion_mapping = transformers.conversion_mapping.get_model_conversion_mapping
    PrefixChange = transformers.core_model_loading.PrefixChange  # noqa: N806

    found = get_model_conversion_mapping(hf, add_legacy=False)
    return [c for c in found if not isinstance(c, PrefixChange)]
