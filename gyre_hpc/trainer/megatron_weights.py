"""A model's weights between the Hugging Face layout (what engines load) and Megatron-core's (what
a ``megatron`` cell trains), one tensor at a time: one converter for every family (Llama, Mistral,
Mixtral, Qwen2, Qwen3, Qwen3-MoE), driven by what the family's config says it has (``qk_norm``,
``qkv_bias``, ``num_experts``), not a file per family.

```
 HF (one file set)                         Megatron GPTModel, local spec, TP rank r of t, PP stage s
 model.embed_tokens                   ──▶  embedding.word_embeddings      rows r/t (vocab padded)
 layers.i.input_layernorm             ──▶  decoder.layers.j.input_layernorm             (replicated)
 layers.i.self_attn.{q,k,v}_proj      ──▶  decoder.layers.j.self_attention.linear_qkv   groups r/t,
   (weights, and biases where any)         each group [its q heads | k | v]
 layers.i.self_attn.{q,k}_norm        ──▶  ….self_attention.{q,k}_layernorm             (replicated;
   (where the family has them)                                                           Qwen3)
 layers.i.self_attn.o_proj            ──▶  ….self_attention.linear_proj                 columns r/t
 layers.i.post_attention_layernorm    ──▶  ….pre_mlp_layernorm                          (replicated)
 layers.i.mlp.{gate,up}_proj          ──▶  ….mlp.linear_fc1                             [gate r/t | up r/t]
 layers.i.mlp.down_proj               ──▶  ….mlp.linear_fc2                             columns r/t
 layers.i.mlp.gate (routed experts)   ──▶  ….mlp.router                                 (replicated)
 layers.i.mlp.experts.gate_up_proj[e] ──▶  ….mlp.experts.local_experts.e.linear_fc1     (whole on
 layers.i.mlp.experts.down_proj[e]    ──▶  ….mlp.experts.local_experts.e.linear_fc2      every rank)
 model.norm                           ──▶  decoder.final_layernorm                      (last stage)
 lm_head (untied only)                ──▶  output_layer                                 rows r/t
 model.embed_tokens (tied, PP > 1)    ──▶  output_layer (a copy on the last stage)      rows r/t
```

Layer i lives on stage s = i // (layers / pp) as local layer j. With tied embeddings and more
than one stage, Megatron keeps a copy of the embedding as the last stage's output layer; both
copies take the same (summed) gradient, so they stay equal. The conversion reads one source
tensor at a time through a callback (e.g. a ``safetensors`` ``safe_open`` handle) and yields
target tensors as it goes, so a large model never needs two full copies in memory. Nothing here
imports megatron: the layout is plain tensor algebra, and the round trip is bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.flat import piece


@dataclass(frozen=True)
class MegatronLayout:
    """How a model is cut for one Megatron world: ``tp`` × ``pp``, and each stage's routed experts
    over ``ep`` of its ranks."""

    config: ModelConfig
    tp: int = 1
    pp: int = 1
    ep: int = 1
    vocab_multiple: int = 128
    """Megatron pads the vocabulary to a multiple of this × tp (``make_vocab_size_divisible_by``)."""

    def __post_init__(self) -> None:
        c = self.config
        if c.num_key_value_heads % self.tp or c.num_attention_heads % self.tp:
            raise ValueError(
                f"tensor parallel size {self.tp} must divide the {c.num_attention_heads} attention "
                f"heads and {c.num_key_value_heads} key/value heads"
            )
        if not c.num_experts and c.intermediate_size % self.tp:
            raise ValueError(
                f"tensor parallel size {self.tp} must divide intermediate_size {c.intermediate_size}"
            )
        if c.num_hidden_layers % self.pp:
            raise ValueError(f"pipeline size {self.pp} must divide the {c.num_hidden_layers} layers")
        if self.ep > 1 and (not c.num_experts or c.num_experts % self.ep):
            raise ValueError(f"expert parallel size {self.ep} must divide the {c.num_experts} routed experts")

    @property
    def padded_vocab(self) -> int:
        step = self.vocab_multiple * self.tp
        return math.ceil(self.config.vocab_size / step) * step

    def layers_of(self, stage: int) -> range:
        per = self.config.num_hidden_layers // self.pp
        return range(stage * per, (stage + 1) * per)

    def place(self, rank: int, size: int) -> tuple[int, int, int]:
        """Rank ``rank``'s (stage, TP rank, DP rank) in a replica of ``size`` ranks, in
        megatron-core's default order (tensor-parallel ranks adjacent, then data-parallel
        replicas, then stages): the same on every cell, so a rank's counterpart in another cell
        of the same layout has its number."""
        if size % (self.tp * self.pp):
            raise ValueError(f"{size} ranks are not a multiple of tp {self.tp} × pp {self.pp}")
        dp = size // (self.tp * self.pp)
        return rank // (self.tp * dp), rank % self.tp, rank // self.tp % dp

    def expert_rank(self, rank: int, size: int) -> int:
        """Rank ``rank``'s expert-parallel rank: in megatron's order for experts (whole on each
        rank, then expert-parallel ranks adjacent, then their data-parallel replicas, then stages)."""
        stage, tp_rank, dp_rank = self.place(rank, size)
        return (tp_rank + self.tp * dp_rank) % self.ep

    @property
    def local_experts(self) -> int:
        """The routed experts a rank holds of each layer."""
        return self.config.num_experts // self.ep

    def stage_of(self, hf_name: str) -> int:
        """The PP stage that holds a Hugging Face tensor (a tied embedding: the first)."""
        if hf_name.startswith("model.layers."):
            return int(hf_name.split(".")[2]) // (self.config.num_hidden_layers // self.pp)
        return 0 if hf_name == "model.embed_tokens.weight" else self.pp - 1


ReadHF = Callable[[str], torch.Tensor]
ReadShards = Callable[[str], list[torch.Tensor]]
"""Megatron tensor name (stage-local) → its tensor on every TP rank of that stage, in rank order;
for a routed expert's tensor (``is_expert``), on every expert-parallel rank, in that order."""


def is_expert(name: str) -> bool:
    """A routed expert's tensor (megatron's name): held by its expert-parallel rank alone."""
    return ".mlp.experts." in name


_NORMS = {
    "input_layernorm": "input_layernorm",
    "self_attn.q_norm": "self_attention.q_layernorm",
    "self_attn.k_norm": "self_attention.k_layernorm",
    "post_attention_layernorm": "pre_mlp_layernorm",
}


def _norms(c: ModelConfig) -> dict[str, str]:
    """The layer's norms, Hugging Face name → Megatron's: q/k norms only where the family has them."""
    return {ours: theirs for ours, theirs in _NORMS.items() if c.qk_norm or "_attn." not in ours}


def hf_to_megatron(
    read: ReadHF, layout: MegatronLayout, rank: int, stage: int, expert_rank: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict of TP rank ``rank`` (and expert-parallel rank ``expert_rank``) on PP stage
    ``stage``, tensor by tensor."""
    c, tp = layout.config, layout.tp
    if stage == 0:
        yield (
            "embedding.word_embeddings.weight",
            _rows(_pad_vocab(read("model.embed_tokens.weight"), layout), tp, rank),
        )
    for j, i in enumerate(layout.layers_of(stage)):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{j}."
        for ours, theirs in _norms(c).items():
            yield mg + theirs + ".weight", read(hf + ours + ".weight")
        q, k, v = (read(f"{hf}self_attn.{p}_proj.weight") for p in "qkv")
        yield mg + "self_attention.linear_qkv.weight", _fuse_qkv(q, k, v, c, tp, rank)
        if c.qkv_bias:
            q, k, v = (read(f"{hf}self_attn.{p}_proj.bias")[:, None] for p in "qkv")
            yield mg + "self_attention.linear_qkv.bias", _fuse_qkv(q, k, v, c, tp, rank)[:, 0]
        yield mg + "self_attention.linear_proj.weight", _cols(read(hf + "self_attn.o_proj.weight"), tp, rank)
        if c.num_experts:
            yield from _experts_to_megatron(read, hf, mg, layout, expert_rank)
            continue
        gate, up = read(hf + "mlp.gate_proj.weight"), read(hf + "mlp.up_proj.weight")
        yield mg + "mlp.linear_fc1.weight", torch.cat([_rows(gate, tp, rank), _rows(up, tp, rank)])
        yield mg + "mlp.linear_fc2.weight", _cols(read(hf + "mlp.down_proj.weight"), tp, rank)
    if stage == layout.pp - 1:
        yield "decoder.final_layernorm.weight", read("model.norm.weight")
        if not c.tie_word_embeddings or layout.pp > 1:
            head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
            yield "output_layer.weight", _rows(_pad_vocab(read(head), layout), tp, rank)


def megatron_to_hf(
    read: ReadShards, layout: MegatronLayout, stage: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors held by PP stage ``stage``, each gathered from its TP shards."""
    c, vocab = layout.config, layout.config.vocab_size
    if stage == 0:
        yield "model.embed_tokens.weight", torch.cat(read("embedding.word_embeddings.weight"))[:vocab]
    for j, i in enumerate(layout.layers_of(stage)):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{j}."
        for ours, theirs in _norms(c).items():
            yield hf + ours + ".weight", read(mg + theirs + ".weight")[0]
        q, k, v = _split_qkv(read(mg + "self_attention.linear_qkv.weight"), c)
        yield hf + "self_attn.q_proj.weight", q
        yield hf + "self_attn.k_proj.weight", k
        yield hf + "self_attn.v_proj.weight", v
        if c.qkv_bias:
            biases = _split_qkv([b[:, None] for b in read(mg + "self_attention.linear_qkv.bias")], c)
            for p, b in zip("qkv", biases, strict=True):
                yield f"{hf}self_attn.{p}_proj.bias", b[:, 0]
        yield hf + "self_attn.o_proj.weight", torch.cat(read(mg + "self_attention.linear_proj.weight"), dim=1)
        if c.num_experts:
            yield from _experts_to_hf(read, hf, mg, layout)
            continue
        fc1 = [s.chunk(2) for s in read(mg + "mlp.linear_fc1.weight")]
        yield hf + "mlp.gate_proj.weight", torch.cat([g for g, _ in fc1])
        yield hf + "mlp.up_proj.weight", torch.cat([u for _, u in fc1])
        yield hf + "mlp.down_proj.weight", torch.cat(read(mg + "mlp.linear_fc2.weight"), dim=1)
    if stage == layout.pp - 1:
        yield "model.norm.weight", read("decoder.final_layernorm.weight")[0]
        if not c.tie_word_embeddings:
            yield "lm_head.weight", torch.cat(read("output_layer.weight"))[:vocab]


def _experts_to_megatron(
    read: ReadHF, hf: str, mg: str, layout: MegatronLayout, expert_rank: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's router (on every rank) and the experts of expert-parallel rank ``expert_rank``
    (the ``local_experts`` from ``expert_rank · local_experts`` on, numbered from 0 as megatron
    numbers them), each whole on every TP rank (``expert_tensor_parallel_size`` 1). transformers
    fuses a layer's experts (``gate_up_proj`` [E, 2F, H]: each expert's gate rows, then its up
    rows, as megatron's gated ``linear_fc1`` wants them; ``down_proj`` [E, H, F]); megatron keeps
    one MLP an expert."""
    yield mg + "mlp.router.weight", read(hf + "mlp.gate.weight")
    gate_up, down = read(hf + "mlp.experts.gate_up_proj"), read(hf + "mlp.experts.down_proj")
    first = expert_rank * layout.local_experts
    for j in range(layout.local_experts):
        yield f"{mg}mlp.experts.local_experts.{j}.linear_fc1.weight", gate_up[first + j].clone()
        yield f"{mg}mlp.experts.local_experts.{j}.linear_fc2.weight", down[first + j].clone()


def _experts_to_hf(
    read: ReadShards, hf: str, mg: str, layout: MegatronLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """``_experts_to_megatron`` undone, an expert at a time (``piece``): each local expert's
    tensor is read from every expert-parallel rank (``ReadShards``) and yielded as its piece of
    the layer's fused tensor, so no more than one expert's copies are held, never the layer's."""
    at, per = f"{mg}mlp.experts.local_experts.", layout.local_experts
    yield hf + "mlp.gate.weight", read(mg + "mlp.router.weight")[0]
    for ours, theirs in (("gate_up_proj", "linear_fc1"), ("down_proj", "linear_fc2")):
        for j in range(per):
            for r, t in enumerate(read(f"{at}{j}.{theirs}.weight")):
                yield piece(f"{hf}mlp.experts.{ours}", r * per + j), t


def slice_shapes(
    layout: MegatronLayout, shapes: dict[str, torch.Size], rank: int, stage: int
) -> dict[str, torch.Size]:
    """What ``hf_to_megatron`` yields for TP rank ``rank`` of stage ``stage``, name → shape, in
    its order, from the Hugging Face tensors' ``shapes``: worked out on the meta device, so a rank
    learns what it will receive without holding any of it."""
    meta = lambda name: torch.empty(shapes[name], device="meta")  # noqa: E731
    return {name: t.shape for name, t in hf_to_megatron(meta, layout, rank, stage)}


def slice_numel(layout: MegatronLayout, shapes: dict[str, torch.Size], rank: int, stage: int) -> int:
    """Values in TP rank ``rank``'s slice of stage ``stage`` (``slice_shapes``, summed)."""
    return sum(s.numel() for s in slice_shapes(layout, shapes, rank, stage).values())


def stage_shapes(layout: MegatronLayout, shapes: dict[str, torch.Size], stage: int) -> dict[str, torch.Size]:
    """What ``megatron_to_hf`` yields for stage ``stage``, name → shape, in its order (meta)."""
    mine = slice_shapes(layout, shapes, 0, stage)  # every TP rank's shards have rank 0's shapes

    def meta(name: str) -> list[torch.Tensor]:
        return [torch.empty(mine[name], device="meta")] * (layout.ep if is_expert(name) else layout.tp)

    return {name: t.shape for name, t in megatron_to_hf(meta, layout, stage)}


def _rows(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=0)[rank].clone()


def _cols(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=1)[rank].clone()


def _pad_vocab(t: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    missing = layout.padded_vocab - t.shape[0]
    return torch.cat([t, t.new_zeros(missing, t.shape[1])]) if missing else t


def _fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: ModelConfig, tp: int, rank: int
) -> torch.Tensor:
    """Megatron's fused QKV rows for one TP rank: per query group, its q heads, then k, then v."""
    groups, d, hidden = c.num_key_value_heads, c.head_dim, q.shape[1]
    per_group = c.num_attention_heads // groups
    q = q.view(groups, per_group * d, hidden)
    fused = torch.cat([q, k.view(groups, d, hidden), v.view(groups, d, hidden)], dim=1)
    return fused.chunk(tp, dim=0)[rank].reshape(-1, hidden).clone()


def _split_qkv(shards: list[torch.Tensor], c: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = c.num_key_value_heads, c.head_dim
    per_group = c.num_attention_heads // groups
    hidden = shards[0].shape[1]
    fused = torch.cat(shards).view(groups, (per_group + 2) * d, hidden)
    q, k, v = fused.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)
