"""The ``megatron`` trainer: a megatron-core GPTModel built from the config the engines load (a
dense family: Llama, Mistral, Qwen2, Qwen3).

```
 HF flat snapshot (transport) ──load_snapshot──▶ Megatron params (fused QKV, [gate|up] fc1)
 micro_step: GPTModel forward (explicit causal mask per path, or one packed tree: its mask,
           rope at the tokens' depths) → the torch backend's loss → backward
           └─▶ Megatron grads (reduced) ──▶ this rank's gradient slice, the buffer the transport exposes
 core: apply(R): each rank's summed slice → /R → clip (the norm all-reduced) → AdamW → weights() in HF layout
```

Snapshots keep the layout every other part uses (``models.flat``): engines load them
unchanged and checkpoints stay Hugging Face directories. Conversion happens at those
boundaries, tensor by tensor (``megatron_weights``): a rank loads its own shards of its own
stage; shards are gathered over the tensor-parallel group, and each stage's tensors are sent
to the replica's first rank, wherever a whole tensor is needed. Only that rank (the cell's
leader, which talks to the transport) holds the whole flat weights; every other rank holds its
slice alone, its parameters (and on the core its fp32 masters and Adam's moments), and the
leader hands each rank its slice of a snapshot, tensor by tensor:

```
 leader: flat ──hf_to_megatron(rank r, stage s)──▶ send ─▶ rank (r, s): its parameters
 leader: flat ◀── its stage's tensors ◀── recv ◀── stage s, TP rank 0: megatron_to_hf (TP gathered)
```

Gradients never leave their rank whole: each rank keeps its slice in megatron's layout, fp32,
its parameters in ``slice_shapes`` order (``grad_slices``), with every reduction inside the
replica done (tied copies, q/k norms, data-parallel replicas). Cells of one layout sum slices
rank by rank (``trainer.data_parallel``), and the clipping norm is one all-reduce of each slice's
squares, each replicated tensor counted once (``counted``).

Ranks beyond tp × pp are data-parallel replicas: they split each micro-step's sequences and sum
gradients.

With pipeline stages, a micro-step runs a GPipe schedule whose micro-batches are its sequences
(every rank has them all, so each hidden-state shape is known on both ends; no padding):

```
 stage 0           stage 1  …  last stage
 fwd s1 ──h──▶     fwd s1 ──▶  fwd s1 → loss
 fwd s2 ──h──▶     fwd s2 ──▶  fwd s2 → loss
 bwd s1 ◀──∂h──    bwd s1 ◀──  bwd s1
 bwd s2 ◀──∂h──    bwd s2 ◀──  bwd s2
```

A tied embedding is untied across stages: the last stage keeps a copy as its output layer, and
the two take the summed gradient of both uses, so they stay equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from gyre_hpc.launch.ports import free_port
from gyre_hpc.loss.policy_loss import Surrogate
from gyre_hpc.loss.token_stats import TokenStats
from gyre_hpc.loss.vocab_logprobs import selected_logprobs
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.flat import FlatLayout, whole
from gyre_hpc.models.hf_files import hf_weight_files
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.rundir import checkpoint_expert_shard, checkpoint_optimizer, checkpoint_shard
from gyre_hpc.step.claims import MicroStats, micro_stats
from gyre_hpc.trainer import weight_shards
from gyre_hpc.trainer.base import (
    ApplyStats,
    entry_rows,
    loss_logprobs,
    mean_gradient_scale,
    packed_loss,
    sequence_loss,
    tree_inputs,
)
from gyre_hpc.trainer.megatron_cpu import redirect_cuda_to_cpu, without_transformer_engine
from gyre_hpc.trainer.megatron_weights import (
    MegatronLayout,
    hf_to_megatron,
    is_expert,
    megatron_to_hf,
    slice_shapes,
    stage_shapes,
)
from gyre_hpc.trainer.offload import Offload, moments
from gyre_hpc.trainer.state_files import read_state, write_state
from gyre_hpc.trainer.tree_attention import (
    block_mask,
    dense_mask,
    flex,
    is_block_mask,
    padded_ends,
    padded_length,
)
from gyre_hpc.trajectory.packing import PackedTree, by_run, forward_trees
from gyre_hpc.trajectory.sequences import TrainSequence

CPU = torch.device("cpu")


def transformer_config(
    c: ModelConfig,
    layout: MegatronLayout,
    dtype: torch.dtype,
    recompute: str = "none",
    device: torch.device = CPU,
    aux_loss: float = 0.0,
    z_loss: float = 0.0,
) -> Any:
    """megatron's config of the model; ``recompute`` is ``trainer.recompute``: full keeps each
    layer's input and recomputes the layer in backward, one layer at a time; ``aux_loss`` and
    ``z_loss`` are the router's loss coefficients (``experts``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    again = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=c.head_dim,
        ffn_hidden_size=c.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        qk_layernorm=c.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=c.qkv_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # Fusions need CUDA kernels; on the CPU the plain paths compute the same thing.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Elsewhere megatron allocates on ``torch.cuda.current_device()``: this rank's GPU.
        use_cpu_initialization=device.type == "cpu",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # Mixed precision as megatron means it: the attention softmax is upcast to fp32.
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        **(again if recompute == "full" else {}),
        **(experts(c, layout, aux_loss, z_loss) if c.num_experts else {}),
    )


def experts(
    c: ModelConfig, layout: MegatronLayout, aux_loss: float = 0.0, z_loss: float = 0.0
) -> dict[str, Any]:
    """megatron's arguments for ``c``'s routed experts, routed as transformers routes them: a
    softmax over the experts, the top k, renormalised where the family renormalises (megatron's
    top-k of the logits then a softmax over them is the same). Every expert whole on its rank
    (``expert_tensor_parallel_size`` 1), the experts split over ``layout.ep`` ranks; with TP > 1
    megatron trains experts under sequence parallelism only. The router's auxiliary losses
    (``trainer.moe_aux_loss_coeff``, ``moe_z_loss_coeff``) are off unless asked: RL updates the
    policy, and a load-balancing term moves the router away from the choices it sampled with."""
    return {
        "num_moe_experts": c.num_experts,
        "moe_router_topk": c.num_experts_per_tok,
        "moe_ffn_hidden_size": c.moe_intermediate_size,
        "moe_router_pre_softmax": not c.renormalizes_topk,
        "moe_router_load_balancing_type": "aux_loss" if aux_loss else "none",
        "moe_aux_loss_coeff": aux_loss,
        "moe_z_loss_coeff": z_loss or None,
        "moe_token_dispatcher_type": "alltoall",
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": 1,
        "sequence_parallel": layout.tp > 1,
    }


def build_model(
    c: ModelConfig,
    layout: MegatronLayout,
    dtype: torch.dtype,
    stage: int = 0,
    block_masks: bool = False,
    recompute: str = "none",
    device: torch.device = CPU,
    aux_loss: float = 0.0,
    z_loss: float = 0.0,
) -> Any:
    """The GPTModel part of this rank's stage (model parallel state must be initialised), every
    tensor of it on ``device``. ``block_masks``: its attention also takes FlexAttention block
    masks (packed trees on CUDA)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    config = transformer_config(c, layout, dtype, recompute, device, aux_loss, z_loss)
    spec = get_gpt_layer_local_spec(
        num_experts=c.num_experts or None, qk_layernorm=c.qk_norm, normalization="RMSNorm"
    )
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if c.qk_norm:
        layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = RMSNorm
    tree_mask = TreeMask()
    if block_masks:
        attention = block_mask_attention()
        attention.tree_mask = tree_mask
        layer.self_attention.submodules.core_attention = attention
    block = TransformerBlockSubmodules([spec] * get_num_layers_to_build(config, pp_rank=stage), RMSNorm)
    # Under ``device``: megatron's local spec builds its norms as plain torch modules, which
    # would otherwise stay on the host while the rest of the model is on the GPU.
    with torch.device(device):
        model = GPTModel(
            config,
            block,
            vocab_size=layout.padded_vocab,
            max_sequence_length=c.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=int(c.rope_theta),
            **rope_scaling(c),
            # Across stages the trainer keeps a tied embedding's two copies equal itself (module doc).
            share_embeddings_and_output_weights=c.tie_word_embeddings and layout.pp == 1,
            pre_process=stage == 0,
            post_process=stage == layout.pp - 1,
            parallel_output=True,  # each TP rank keeps its vocabulary shard: log-probs are vocab-parallel
        )
    model.tree_mask = tree_mask  # what its attention reads a block mask from (``TreeMask``)
    elsewhere = {str(t.device) for t in (*model.parameters(), *model.buffers()) if t.device != device}
    if elsewhere:
        raise RuntimeError(
            f"megatron model built for {device} holds tensors on {', '.join(sorted(elsewhere))}"
        )
    return model


class RMSNorm:
    """The local spec's norm (torch's RMSNorm), which also runs under sequence parallelism:
    megatron's wrapper refuses it because a torch norm's gradient is not summed over the TP
    group, which this trainer does itself (``MegatronTrainer._whole_grad``) for every weight
    marked ``sequence_parallel``."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> torch.nn.RMSNorm:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


class RouteReplay:
    """One router's replay, in megatron's own hook for it (``TopKRouter.router_replay``, which
    its routing consults whenever set): its top-k, then the given experts wherever one is given
    (-1: none), their scores gathered from the router's, so the router still learns. megatron's
    own ``RouterReplay`` (``moe_enable_routing_replay``) keeps every instance in a class-wide list
    and replays every token; this one is per router and leaves a position without a route to the
    router."""

    def __init__(self) -> None:
        self.given: torch.Tensor | None = None
        """[tokens, top-k] of the forward under way (set by the trainer per unit)."""

    def get_replay_topk(
        self, scores: torch.Tensor, topk: int, num_groups: Any = None, group_topk: Any = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        assert default_compute_topk is not None
        probs, chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.given is None:
            return probs, chosen
        if self.given.shape != chosen.shape:
            raise ValueError(f"replayed routes {tuple(self.given.shape)} for {tuple(chosen.shape)} routed")
        chosen = torch.where(self.given >= 0, self.given, chosen)
        return scores.gather(1, chosen), chosen


def replay_hooks(model: torch.nn.Module) -> dict[int, RouteReplay]:
    """A ``RouteReplay`` in each routed layer's router of this stage, by global layer index."""
    hooks = {}
    for layer in model.decoder.layers:  # type: ignore[union-attr]
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            router.router_replay = hooks[layer.layer_number - 1] = RouteReplay()
    return hooks


def rope_scaling(c: ModelConfig) -> dict[str, Any]:
    """megatron's arguments for ``c``'s scaled rotary frequencies: Llama 3's (megatron applies
    them with Llama 3.1's constants, checked here); any other scaling is refused in one line."""
    scaling = c.rope_scaling
    if scaling is None:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    llama31 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if kind != "llama3" or any(float(scaling.get(k, v)) != v for k, v in llama31.items()):
        raise ValueError(
            f"rope scaling {scaling}: the megatron trainer scales rotary frequencies as Llama 3.1 "
            f"does (rope_type llama3, {llama31}) or not at all"
        )
    return {"rope_scaling": True, "rope_scaling_factor": float(scaling.get("factor", 8.0))}


class TreeMask:
    """The block mask of the tree being forwarded, which every layer's attention reads: it goes
    beside megatron's arguments, because activation recomputation saves those for backward and
    takes only tensors."""

    mask: Any = None


def block_mask_attention() -> type:
    """Megatron's local core attention, which also takes a FlexAttention block mask (as its
    ``attention_mask`` or from its ``tree_mask``): a packed tree's attention without the
    [heads, N, N] scores the local kernel materialises."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class BlockMaskAttention(DotProductAttention):
        tree_mask = TreeMask()

        def forward(self, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN202
            mask = attention_mask if is_block_mask(attention_mask) else self.tree_mask.mask
            if mask is None:
                return super().forward(query, key, value, attention_mask, **kwargs)
            # [s, b, heads, d] → [b, heads, s, d] and back to [s, b, heads · d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = flex(q, k, v, mask, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    return BlockMaskAttention


class PositionedRotary(torch.nn.Module):
    """Megatron's rotary table read at given positions: a packed tree's tokens sit at their depth
    in their path, not at their index in the packed sequence (GPTModel's rope takes a length)."""

    def __init__(self, table: torch.nn.Module) -> None:
        super().__init__()
        self.table = table
        self.positions: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.table.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        emb = self.table(max_seq_len, *args, **kwargs)  # [S, 1, 1, dim] for positions 0 … S-1
        return emb if self.positions is None else emb[self.positions]


@dataclass(frozen=True)
class _Unit:
    """One forward of a micro-step: a path, or a packed tree; ``loss(logits)`` on the last stage."""

    ids: torch.Tensor
    positions: torch.Tensor
    hidden: Any
    """[1, 1, T, T], True = hidden; or a FlexAttention block mask (True = attend)."""
    loss: Callable[[torch.Tensor], tuple[torch.Tensor, TokenStats]]
    tokens: int
    """The tokens it trains on: its length less the padding a tree is given on CUDA."""
    routes: torch.Tensor | None = None
    """[length, layers, top-k]: the experts to route each position to (-1: the router's own
    choice), under ``trainer.routing_replay``; None routes freely."""

    @property
    def length(self) -> int:
        """The tokens it forwards, padding included."""
        return self.ids.shape[1]


@dataclass(frozen=True)
class MegatronWorld:
    """The ranks of one cell as a torch.distributed world: this rank, their number, where rank 0
    keeps the rendezvous store (a cell shares it over MPI; one rank picks its own), and the GPU
    this rank computes on (None: the current one, or the CPU)."""

    rank: int = 0
    size: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    gpu: int | None = None
    timeout_s: float = 1800.0
    """How long a rank waits at the rendezvous for the others (``runtime.cell_host.rendezvous_timeout_s``)."""

    @classmethod
    def alone(cls) -> MegatronWorld:
        return cls(0, 1, "127.0.0.1", free_port("127.0.0.1"))


class RendezvousTimeout(RuntimeError):
    """The ranks of a replica did not all reach its rendezvous in time."""


def init_megatron(world: MegatronWorld, tp: int, pp: int, seed: int, ep: int = 1) -> None:
    """torch.distributed (gloo on the CPU, nccl on GPUs) and megatron's parallel state, once per process."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    redirect_cuda_to_cpu()
    without_transformer_engine()
    if world.gpu is not None and torch.cuda.is_available():
        torch.cuda.set_device(world.gpu % torch.cuda.device_count())
    if not torch.distributed.is_initialized():
        # torch's default (300 s for the store) is shorter than an engine may take to start, and
        # a cell's leader starts its engine before it joins.
        wait = timedelta(seconds=world.timeout_s)
        try:
            store = torch.distributed.TCPStore(
                world.host, world.port, world.size, is_master=world.rank == 0, timeout=wait
            )
        except RuntimeError as err:  # DistStoreError: a peer never came
            raise RendezvousTimeout(
                f"rank {world.rank} of {world.size}: the replica's rendezvous at {world.host}:{world.port} "
                f"did not complete within {world.timeout_s:g} s ({err})"
            ) from err
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(
            backend, store=store, rank=world.rank, world_size=world.size, timeout=wait
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
        )
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


class MegatronTrainer:
    def __init__(
        self,
        model_dir: str | Path,
        config: TrainerConfig,
        *,
        core: bool,
        grad_buffer: np.ndarray | None = None,
        seed: int = 0,
        world: MegatronWorld | None = None,
        packing: str = "paths",
    ) -> None:
        from megatron.core import parallel_state

        self.config = config
        self.packing = packing
        self.model_config = ModelConfig.load(model_dir)
        self.layout = MegatronLayout(
            self.model_config, tp=config.tp_size, pp=config.pp_size, ep=config.ep_size
        )
        init_megatron(world or MegatronWorld.alone(), config.tp_size, config.pp_size, seed, config.ep_size)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        # Ranks beyond tp × pp are data-parallel replicas of the model inside the cell.
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        # A rank's experts are whole (``experts``): the ranks that hold the same ones (its TP
        # group's and the replicas') each route their own tokens to them, and sum their gradients.
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group()
        self.expert_dp_rank = parallel_state.get_expert_data_parallel_rank()
        self.expert_rank = parallel_state.get_expert_model_parallel_rank()
        self.expert_group = parallel_state.get_expert_model_parallel_group()
        if self.layout.pp > 1:
            self.pp_group = parallel_state.get_pipeline_model_parallel_group()
            self.prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
            self.next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        bf16 = config.dtype == "bfloat16"
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        on_cuda = self.device.type == "cuda"
        self.model = build_model(
            self.model_config, self.layout, self.dtype, self.stage, block_masks=on_cuda,
            recompute=config.recompute, device=self.device,
            aux_loss=config.moe_aux_loss_coeff, z_loss=config.moe_z_loss_coeff,
        )  # fmt: skip
        self.sequence_parallel = self.model.config.sequence_parallel
        """Each TP rank holds a 1/tp share of the positions between its attention blocks
        (``experts``: megatron trains experts beside TP only so): a forward's length is padded to
        a multiple of tp."""
        self.pad_trees = on_cuda
        """Pad each tree to a bucket's length (``tree_attention.padded_length``), so the compiled
        block mask and attention see a bounded number of lengths."""
        self.rotary = self.model.rotary_pos_emb = PositionedRotary(self.model.rotary_pos_emb)
        self.head_weight: torch.Tensor | None = None
        """The output layer's weight (this rank's vocabulary shard) of the last forward."""
        if self.stage == self.layout.pp - 1:
            self._emit_hidden(self.model.output_layer)
        self.replays = replay_hooks(self.model) if config.routing_replay else {}
        """Global layer index → the replay its router consults (routed-expert models only)."""
        self.model.train()
        self.params = dict(self.model.named_parameters())
        # bfloat16 parameters compute; the core steps fp32 master copies and casts them back.
        self.master = (
            {n: torch.zeros_like(p, dtype=torch.float32, requires_grad=True) for n, p in self.params.items()}
            if bf16 and core
            else None
        )
        self.flat_layout = FlatLayout.of(self.model_config)
        self.slots = self.flat_layout.slots
        self.numel = self.flat_layout.numel
        self.shapes = {name: shape for name, (_, shape) in self.slots.items()}
        dist = torch.distributed
        self.lead = dist.get_rank() == 0
        """The replica's first rank: it alone holds the whole flat weights (the cell's leader)."""
        self.places: list[tuple[int, int, int]] = [(0, 0, 0)] * dist.get_world_size()
        """Each rank's (stage, TP rank, DP rank): where the leader sends slices, whence it gathers."""
        dist.all_gather_object(self.places, (self.stage, self.tp_rank, self.dp_rank))
        expected = [self.layout.place(r, len(self.places)) for r in range(len(self.places))]
        if self.places != expected:  # the transport pairs ranks of two cells by this order
            raise RuntimeError(f"megatron placed ranks at {self.places}, not {expected}")
        expert_ranks = [0] * len(self.places)
        dist.all_gather_object(expert_ranks, self.expert_rank)
        self.expert_ranks = [self.layout.expert_rank(r, len(self.places)) for r in range(len(self.places))]
        """Each rank's expert-parallel rank: which of a stage's experts it holds."""
        if expert_ranks != self.expert_ranks:
            raise RuntimeError(f"megatron placed experts at {expert_ranks}, not {self.expert_ranks}")
        self.flat = np.zeros(0, dtype=np.float32)
        """The whole weights on the leader, made by the first ``weights()``: engines that load a
        cell's slices (``hf_tensors``) never make it."""
        mine = slice_shapes(self.layout, self.shapes, self.tp_rank, self.stage)
        if {n: p.shape for n, p in self.params.items()} != dict(mine):
            raise RuntimeError("the model's parameters are not the slice megatron_weights cuts")
        size = sum(shape.numel() for shape in mine.values())
        if grad_buffer is None:
            grad_buffer = np.zeros(size, dtype=np.float32)
        if grad_buffer.shape != (size,) or grad_buffer.dtype != np.float32:
            raise ValueError(f"gradient buffer must be float32[{size}] on this rank (its slice)")
        self.grad = grad_buffer
        """This rank's gradient slice (``grad_slices``): the transport reads it."""
        self.grad_slices = _views(torch.from_numpy(self.grad), mine)
        self.counted = self._counted()
        """The parameters whose gradient this rank adds to the norm: each replicated one once."""
        # Each backward's gradient is added, in fp32 on the trainer's device, to ``main_grad``
        # and dropped; reduced and copied into ``grad`` once, when ``gradient()`` is asked.
        self.main_grad: dict[str, torch.Tensor] = {}
        self.pending = False
        """Micro-steps were trained since the gradient was last copied into ``grad``."""
        for name, p in self.params.items():
            p.register_post_accumulate_grad_hook(self._accumulator(name))
        self.load_files(Path(model_dir))
        self.version = 0
        self.fresh = False
        """``flat`` holds the current weights (gathered since the last change)."""
        self.offload = Offload()
        self.optimizer = (
            torch.optim.AdamW(
                (self.master or self.params).values(),
                lr=config.lr,
                weight_decay=config.weight_decay,
                foreach=False,
            )
            if core
            else None
        )

    # ---- the Trainer protocol ------------------------------------------------------------------

    def weights(self) -> np.ndarray:
        """The whole flat weights on the replica's first rank (an empty buffer on the others,
        which take part in gathering them)."""
        if not self.fresh:  # the shards are gathered on the device (NCCL: the GPU)
            if self.lead and self.flat.size != self.numel:
                # Snapshots leave through host memory: pinned, so a GPU copies at full speed into it.
                self.flat = torch.zeros(self.numel, pin_memory=torch.cuda.is_available()).numpy()
            source = self.master or self.params
            # A released trainer's parameter visits its device for its own gather, as in hf_tensors.
            self._to_leader(self.flat, lambda name: source[name].detach().to(self.device, torch.float32))
            self.fresh = True
        return self.flat

    def release_memory(self) -> None:
        """While the cell samples: the parameters, fp32 masters and Adam's moments to host memory
        and the allocator's cache emptied, so the engine resumes into the GPU. Not collective:
        whoever needs ``weights`` meanwhile (the core's engine) took them before. On the CPU
        there is nothing to hand back."""
        if self.device.type != "cuda" or self.offload.released:
            return
        self.offload.release(self._resident())
        torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Before the cell trains (its engine released): everything back on the GPU."""
        if self.offload.released:
            self.offload.resume(self._resident(), self.device)

    def _resident(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What this rank keeps on its device between micro-steps, by name."""
        yield from (("param:" + n, p) for n, p in self.params.items())
        yield from (("master:" + n, m) for n, m in (self.master or {}).items())
        if self.optimizer is not None:
            yield from moments(self.optimizer, {id(p): n for n, p in (self.master or self.params).items()})

    def gradient(self) -> np.ndarray:
        """This rank's gradient slice, with every micro-step since ``zero_grad`` in it: the fp32
        sums on the device are reduced (tied copies, q/k norms, replicas) and added to the host
        slice here, once, by every rank of the replica together."""
        if self.pending:  # every rank of the replica trained the same micro-steps: all flush
            for n, p in self.params.items():  # what this rank did not forward adds nothing
                self.main_grad.setdefault(n, torch.zeros_like(p, dtype=torch.float32))
            if self.layout.pp > 1:
                self._sum_tied_embedding_grads()
            # in the parameters' order: the order backward filled it is a replica's own
            for n in self.params:
                group = self.expert_dp_group if is_expert(n) else self.dp_group
                if group.size() > 1:
                    torch.distributed.all_reduce(self.main_grad[n], group=group)
            with torch.no_grad():
                for n, g in self.grad_slices.items():
                    g.add_(self._whole_grad(n).cpu())
            self.main_grad, self.pending = {}, False
        return self.grad

    def hf_gradient(self) -> np.ndarray:
        """The replica's whole gradient in the shared layout (``models.flat``), on the first rank
        (empty elsewhere): for inspecting and comparing backends; training never gathers it.
        Collective over the replica."""
        self.gradient()
        whole = np.zeros(self.numel if self.lead else 0, dtype=np.float32)
        self._to_leader(whole, self.grad_slices.__getitem__)
        return whole

    def load_snapshot(self, flat: np.ndarray, version: int) -> None:
        """The leader's ``flat``, each rank its slice of it (``flat`` is read on the leader only)."""
        self._load(self._slices(flat))
        self.version = version
        self.fresh = False

    def weight_slice(self) -> np.ndarray:
        """This rank's parameters as bytes, in ``slice_shapes`` order and the dtype each is kept
        in (bf16 where the recipe trains in bf16; the fp32 masters stay here): what a
        counterpart in another cell loads with ``load_slice``. Not collective."""
        out = np.empty(self._slice_offsets()[-1], np.uint8)
        for name, view in self._byte_views(out):
            view.copy_(self.params[name].detach())
        return out

    def load_slice(self, data: np.ndarray, version: int) -> None:
        """Parameters from a counterpart's ``weight_slice`` (the same layout and dtypes).
        Not collective: each rank loads its own."""
        self._load(self._byte_views(data.reshape(-1).view(np.uint8)))
        self.version = version
        self.fresh = False

    def _slice_offsets(self) -> list[int]:
        """Where each parameter's bytes start in a weight slice (each at a multiple of its
        element size, so it can be viewed in place), and the slice's length last."""
        offsets, at = [], 0
        for name in self.grad_slices:
            p = self.params[name]
            at = -(-at // p.element_size()) * p.element_size()
            offsets.append(at)
            at += p.numel() * p.element_size()
        return [*offsets, at]

    def _byte_views(self, data: np.ndarray) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter's bytes in ``data``, viewed as the parameter (in ``slice_shapes`` order)."""
        offsets = self._slice_offsets()
        if data.size != offsets[-1]:
            raise ValueError(f"a weight slice of {data.size} bytes; this rank's is {offsets[-1]}")
        raw = torch.from_numpy(data)
        for name, at in zip(self.grad_slices, offsets, strict=False):
            p = self.params[name]
            yield name, raw[at : at + p.numel() * p.element_size()].view(p.dtype).view(p.shape)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
        self.main_grad, self.pending = {}, False
        self.grad[:] = 0.0

    def _counted(self) -> list[str]:
        """The parameters this rank adds to the gradient's norm: those of the first replica,
        tensor-parallel duplicates (norms) on TP rank 0 only, a routed expert on the first rank
        that holds it (which may be in another replica), and not the last stage's copy of a tied
        embedding (the first stage's holds the same sum)."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        tied_copy = self.model_config.tie_word_embeddings and self.layout.pp > 1

        def counted(n: str, p: torch.Tensor) -> bool:
            if is_expert(n):
                return self.expert_dp_rank == 0
            return self.dp_rank == 0 and param_is_not_tensor_parallel_duplicate(p)

        return [
            n
            for n, p in self.params.items()
            if counted(n, p) and not (tied_copy and n == "output_layer.weight")
        ]

    def _accumulator(self, name: str) -> Callable[[torch.Tensor], None]:
        def add(p: torch.Tensor) -> None:
            g = self.main_grad.get(name)
            if g is None:
                self.main_grad[name] = p.grad.to(torch.float32, copy=True)
            else:
                g.add_(p.grad)
            p.grad = None  # the parameter-dtype copy lives for one backward only

        return add

    def micro_step(self, sequences: list[TrainSequence]) -> MicroStats:
        # Data-parallel replicas inside the cell split the sequences (a tree keeps a run whole).
        if self.packing == "tree":
            mine = [s for run in by_run(sequences)[self.dp_rank :: self.dp] for s in run]
            # Pipeline micro-batches are runs; on one stage, one tree of them all under block masks.
            sparse = self.device.type == "cuda" and self.layout.pp == 1
            units = [self._tree_unit(t) for t in forward_trees(mine, block_sparse=sparse)]
        else:
            mine = sequences[self.dp_rank :: self.dp]
            units = [self._path_unit(s) for s in mine]
        units = [u for u in units if u.tokens]  # a replica's empty share forwards no padding
        if self.layout.ep > 1 and self.dp > 1:  # the expert-parallel group spans replicas
            units = self._as_many(units)
        stats = self._pipeline(units) if self.layout.pp > 1 else self._forward_backward(units)
        self.model.tree_mask.mask = None
        stats = micro_stats(mine, *stats)
        if self.dp > 1:
            stats = self._sum_over_replicas(sequences, stats)
        self.pending = True
        return stats

    def _replayed(self, routes: np.ndarray | None, length: int) -> torch.Tensor | None:
        """``routes`` [n ≤ length, layers, k] padded with free rows to ``length``; None when not
        replaying."""
        if not self.replays or routes is None:
            return None
        given = torch.from_numpy(np.asarray(routes, dtype=np.int64))
        return F.pad(given, (0, 0, 0, 0, 0, length - len(given)), value=-1).to(self.device)

    def _path_unit(self, s: TrainSequence) -> _Unit:
        ids = torch.from_numpy(np.asarray(s.tokens, dtype=np.int64))[None].to(self.device)
        n = ids.shape[1]
        length = self._multiple(n)  # padding after the path: no real position sees it
        ids = F.pad(ids, (0, length - n))
        routes = self._replayed(s.routes, length)
        hidden, positions = self._causal(length), torch.arange(length, device=self.device)[None]
        c = self.config

        def loss(hidden: torch.Tensor) -> tuple[torch.Tensor, TokenStats]:
            head = lambda h, t: self._logprobs(h[None], torch.arange(len(h), device=self.device), t)  # noqa: E731
            logp, entropy = loss_logprobs(hidden[0, :n], ids[0, :n], s.loss_mask, head)
            return sequence_loss(s, logp, Surrogate.of(c), self.version, entropy)

        return _Unit(ids, positions, hidden, loss, n, routes)

    def _tree_unit(self, tree: PackedTree) -> _Unit:
        ids, positions = tree_inputs(tree, self.device)
        ends = tree.ends
        length = padded_length(len(tree), self.config.micro_step_tokens) if self.pad_trees else len(tree)
        length = self._multiple(length)
        if length > len(tree):  # padding tokens see only themselves; the loss reads real rows only
            ends = padded_ends(ends, length)
            ids, positions = (F.pad(t, (0, length - len(tree))) for t in (ids, positions))
        if self.device.type == "cuda":  # block-sparse: no N² tensor (models.tree_attention)
            hidden = block_mask(ends, self.device)
        else:
            hidden = ~dense_mask(ends, self.device)[None, None]
        c = self.config

        def loss(hidden: torch.Tensor) -> tuple[torch.Tensor, TokenStats]:
            rows, tokens, has_parent = entry_rows(tree, self.device)
            logp, entropy = self._logprobs(hidden, rows, tokens)
            logp, entropy = torch.where(has_parent, logp, 0.0), torch.where(has_parent, entropy, 0.0)
            return packed_loss(tree, logp, Surrogate.of(c), self.version, entropy)

        return _Unit(ids, positions, hidden, loss, len(tree), self._replayed(tree.routes, length))

    def _as_many(self, units: list[_Unit]) -> list[_Unit]:
        """``units`` and, after them, idle ones, so that every replica forwards as many: each
        routed-expert layer exchanges tokens with the other replicas' ranks of its expert-parallel
        group, collectively, forward and backward."""
        most = torch.tensor([len(units)], device=self.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=self.dp_group)
        return units + [self._idle_unit() for _ in range(int(most[0]) - len(units))]

    def _idle_unit(self) -> _Unit:
        """A forward of ``tp`` padding tokens that trains nothing: its loss is zero, so is every
        gradient it adds."""
        n = self._multiple(1)
        ids = torch.zeros(1, n, dtype=torch.int64, device=self.device)

        def loss(hidden: torch.Tensor) -> tuple[torch.Tensor, TokenStats]:
            return hidden.sum() * 0.0, TokenStats()

        return _Unit(ids, torch.arange(n, device=self.device)[None], self._causal(n), loss, 0)

    def _causal(self, length: int) -> torch.Tensor:
        """[1, 1, length, length], True = hidden: every position sees itself and what precedes it."""
        return torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool, device=self.device), diagonal=1)

    def _multiple(self, length: int) -> int:
        """``length`` padded to what a forward takes: a multiple of tp under sequence parallelism."""
        tp = self.layout.tp if self.sequence_parallel else 1
        return -(-length // tp) * tp

    def _forward(self, unit: _Unit) -> torch.Tensor:
        """This stage's output: on the last stage the final hidden states [1, T, H], whole on
        every TP rank (``_emit_hidden``); hidden states [T, 1, H] (this rank's share) before it."""
        self.rotary.positions = unit.positions[0]
        blocks = self._attend(unit)
        try:
            return self.model(unit.ids, unit.positions, attention_mask=None if blocks else unit.hidden)
        finally:
            self.rotary.positions = None

    def _attend(self, unit: _Unit) -> bool:
        """Hand ``unit``'s block mask to the attention, and its routes to the routers, for its
        forward and for the layers recomputed in its backward; False (nothing handed) for a dense
        mask."""
        if self.replays:
            # each rank's routers see its share of the positions under sequence parallelism
            routes = unit.routes
            if routes is not None and self.sequence_parallel:
                share = unit.length // self.layout.tp
                routes = routes[self.tp_rank * share : (self.tp_rank + 1) * share]
            for layer, replay in self.replays.items():
                replay.given = None if routes is None else routes[:, layer]
        blocks = is_block_mask(unit.hidden)
        self.model.tree_mask.mask = unit.hidden if blocks else None
        return blocks

    def _forward_backward(self, units: list[_Unit]) -> tuple[float, TokenStats, int]:
        loss_sum, stats = 0.0, TokenStats()
        for u in units:
            loss, out = u.loss(self._forward(u))
            loss.backward()  # recomputed layers, if any, still see u's mask
            loss_sum, stats = loss_sum + float(loss.detach()), stats + out
        return loss_sum, stats, sum(u.tokens for u in units)

    def _pipeline(self, units: list[_Unit]) -> tuple[float, TokenStats, int]:
        """The GPipe schedule of the module doc: every forward, then every backward, in order."""
        dist = torch.distributed
        first, last = self.stage == 0, self.stage == self.layout.pp - 1
        hidden = self.model_config.hidden_size
        kept = []  # per unit: (input hidden state or None, output)
        for u in units:
            x = None
            if not first:
                # between stages a rank holds its share of the positions (sequence parallelism)
                share = u.length // self.layout.tp if self.sequence_parallel else u.length
                x = torch.empty(share, 1, hidden, dtype=self.dtype, device=self.device)
                dist.recv(x, self.prev_rank)
                x.requires_grad_()
            self.model.set_input_tensor(x)
            out = self._forward(u)
            if last:
                out = u.loss(out)
            else:
                dist.send(out.detach().contiguous(), self.next_rank)
            kept.append((x, out))
        loss_sum, stats = 0.0, TokenStats()
        for u, (x, out) in zip(units, kept, strict=True):
            self._attend(u)
            if last:
                loss, unit_stats = out
                loss.backward()
                loss_sum, stats = loss_sum + float(loss.detach()), stats + unit_stats
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, self.next_rank)
                torch.autograd.backward(out, grad)
            if not first:
                dist.send(x.grad.contiguous(), self.prev_rank)
        # The loss is known on the last stage; every rank reports it.
        totals = torch.tensor([loss_sum, *stats.as_list()], dtype=torch.float64, device=self.device)
        dist.broadcast(totals, dist.get_global_rank(self.pp_group, self.layout.pp - 1), group=self.pp_group)
        return float(totals[0]), TokenStats.from_list(totals[1:].tolist()), sum(u.tokens for u in units)

    def _logprobs(
        self, hidden: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-prob of ``tokens`` [M] after the hidden states of ``rows`` [M] and their
        distributions' entropies, from this rank's vocabulary shard in chunks of rows
        (``loss.vocab_logprobs``): the softmax is reduced over the tensor-parallel group, so no
        rank holds the whole vocabulary, nor a micro-step's logits. Padding columns are excluded,
        as the engines' logits have none."""
        weight = self.head_weight
        assert weight is not None, "the output layer has not run"
        tp = self.layout.tp > 1
        return selected_logprobs(
            hidden[0, rows], weight, tokens, chunk=self.config.logprob_chunk,
            vocab=self.model_config.vocab_size, first=self.tp_rank * weight.shape[0] if tp else 0,
            group=self.tp_group if tp else None,
        )  # fmt: skip

    def _emit_hidden(self, layer: Any) -> None:
        """The output layer hands on its input, made whole on every TP rank as it would make it
        (gathered from the sequence-parallel shares, or copied: its gradient summed back), and
        keeps the weight it would multiply it by: log-probs are taken in chunks from there
        (``_logprobs``), never as [positions × vocabulary] logits."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        def forward(hidden: torch.Tensor, weight: torch.Tensor | None = None, **unused: Any) -> tuple:
            self.head_weight = layer.weight if weight is None else weight
            if self.layout.tp > 1:
                whole = gather_from_sequence_parallel_region if layer.sequence_parallel else (
                    copy_to_tensor_model_parallel_region)  # fmt: skip
                hidden = whole(hidden, group=self.tp_group)
            return hidden, None

        layer.forward = forward

    def _sum_over_replicas(self, sequences: list[TrainSequence], mine: MicroStats) -> MicroStats:
        """The micro-step's loss and counts summed over the data-parallel replicas of the cell
        (their gradients are summed once a step, in ``gradient``)."""
        dist = torch.distributed
        totals = [mine.loss_sum, float(mine.tokens), *mine.token_stats.as_list()]
        totals = torch.tensor(totals, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, group=self.dp_group)
        largest = torch.tensor([mine.token_stats.mismatch_max], dtype=torch.float64, device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.dp_group)
        stats = TokenStats.from_list(totals[2:].tolist())
        stats = dataclasses.replace(stats, mismatch_max=float(largest[0]))
        return micro_stats(sequences, float(totals[0]), stats, int(totals[1]))

    def _sum_tied_embedding_grads(self) -> None:
        """A tied embedding's two copies (first stage: embedding, last: output layer) take the sum
        of both gradients, as megatron's finalize_model_grads does."""
        from megatron.core import parallel_state

        if not self.model_config.tie_word_embeddings or self.stage not in (0, self.layout.pp - 1):
            return
        name = "embedding.word_embeddings.weight" if self.stage == 0 else "output_layer.weight"
        torch.distributed.all_reduce(self.main_grad[name], group=parallel_state.get_embedding_group())

    def _whole_grad(self, name: str) -> torch.Tensor:
        """A parameter's gradient on this rank; q/k norms act on this rank's heads only, and under
        sequence parallelism norms and routers on its positions only, so their gradient is the
        sum over the TP group (as megatron's finalize_model_grads does)."""
        g = self.main_grad[name]
        positional = self.sequence_parallel and getattr(self.params[name], "sequence_parallel", False)
        if self.layout.tp > 1 and (positional or "q_layernorm" in name or "k_layernorm" in name):
            g = g.clone()
            torch.distributed.all_reduce(g, group=self.tp_group)
        return g

    def apply(self, num_runs: int) -> ApplyStats:
        if self.optimizer is None:
            raise RuntimeError("only the core owns an optimizer")
        # Each rank holds its slice of the summed gradient: the norm is one all-reduce of squares.
        self.gradient()
        squares = torch.zeros(1, dtype=torch.float64)
        for n in self.counted:
            squares += torch.linalg.vector_norm(self.grad_slices[n], dtype=torch.float64) ** 2
        squares = squares.to(self.device)  # NCCL reduces device tensors
        torch.distributed.all_reduce(squares)
        norm, scale = mean_gradient_scale(float(squares[0]) ** 0.5, num_runs, self.config.grad_clip)
        stepped = self.master or self.params
        with torch.no_grad():
            for name, t in self.grad_slices.items():
                # A copy: ``t`` is a view of the gradient buffer the transport exposes.
                stepped[name].grad = t.to(stepped[name].device, torch.float32, copy=True).mul_(scale)
        self.optimizer.step()
        for t in stepped.values():  # a model's worth of fp32 the GPU would keep while it samples
            t.grad = None
        if self.master is not None:
            with torch.no_grad():
                for name, m in self.master.items():
                    self.params[name].copy_(m)
        self.version += 1
        self.fresh = False
        return ApplyStats(self.version, norm)

    def optimizer_state(self) -> dict:
        assert self.optimizer is not None
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        """On a GPU the state lands in host memory, with the rest of the trainer released: a
        core restores while its engine holds the GPU, and takes it all back on its first switch
        to training. Nothing is gathered: whoever needs the weights next gathers them from the
        released slices (``weights``, ``hf_tensors``)."""
        assert self.optimizer is not None
        if self.device.type == "cuda":
            self.release_memory()
        self.optimizer.load_state_dict(state)  # onto its parameters' device: the host, released

    def save_weights(self, directory: Path, rank: int | None = None) -> dict[str, str]:
        """Its weights written into ``directory``: Hugging Face's file when it is a replica of
        one rank (``rank`` None), else this rank's shard (the fp32 masters where it keeps them),
        written by the first data-parallel replica's ranks, each its own, in parallel."""
        if rank is None:
            return weight_shards.write_whole(self.flat_layout, self.weights(), directory)
        source = self.master or self.params
        tensors = {name: t.detach().to("cpu", torch.float32) for name, t in source.items()}
        split = self.layout.ep > 1  # experts go to their expert-parallel rank's shard
        written = {}
        if self.dp_rank == 0:  # the other replicas hold the same
            dense = {n: t for n, t in tensors.items() if not (split and is_expert(n))}
            written |= weight_shards.write_shard(directory, dense, self.layout, self.stage, self.tp_rank)
        if split and self.expert_dp_rank == 0:
            experts = {n: t for n, t in tensors.items() if is_expert(n)}
            written |= weight_shards.write_shard(
                directory, experts, self.layout, self.stage, self.tp_rank, self.expert_rank
            )
        return written

    def load_weights(self, directory: Path, version: int, rank: int | None = None) -> None:
        """This rank's slice from ``directory``: its own shard when the checkpoint was written in
        this layout, else resharded from another layout's shards or cut from Hugging Face files,
        one tensor at a time (not collective: each rank reads its own)."""
        written = weight_shards.layout_of(directory, self.model_config)
        if written is not None and weight_shards.same_cut(written, self.layout):
            mine = [checkpoint_shard(directory, self.stage, self.tp_rank)]
            if self.layout.ep > 1:
                mine.append(checkpoint_expert_shard(directory, self.stage, self.expert_rank))
            for f in mine:
                with safe_open(f, framework="pt") as h:
                    self._load((name, h.get_tensor(name)) for name in h.keys())  # noqa: SIM118
        elif written is not None:
            reader = weight_shards.HFReader(directory, written)
            self._load(hf_to_megatron(reader, self.layout, self.tp_rank, self.stage, self.expert_rank))
        else:
            self.load_files(directory)
        self.version = version
        self.fresh = False

    def save_optimizer(self, directory: Path, rank: int | None = None) -> dict[str, str]:
        """Its optimizer state written into ``directory`` (as rank ``rank``'s of a replica):
        file name → sha256."""
        return write_state(self.optimizer_state(), checkpoint_optimizer(directory, rank))

    def load_optimizer(self, directory: Path, rank: int | None = None) -> None:
        self.load_optimizer_state(read_state(checkpoint_optimizer(directory, rank)))

    # ---- layout boundaries ---------------------------------------------------------------------

    def load_files(self, model_dir: Path) -> None:
        """This rank's slice read from a Hugging Face directory's files (each rank its own, one
        tensor at a time; not collective)."""
        self._load(
            hf_to_megatron(
                _reader(model_dir, self.flat_layout), self.layout, self.tp_rank, self.stage, self.expert_rank
            )
        )

    def _view(self, flat: np.ndarray):  # noqa: ANN202 - a reader callback
        return self.flat_layout.views(flat).__getitem__

    def _load(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, t in tensors:
                self.params[name].copy_(t)
                if self.master is not None:
                    self.master[name].copy_(t)

    def _slices(self, flat: np.ndarray) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's slice of the leader's whole ``flat``, tensor by tensor in megatron's
        layout: the leader cuts every other rank's and sends it, then yields its own; the others
        receive theirs (``slice_shapes`` says what arrives). Collective over the replica."""
        dist = torch.distributed
        if not self.lead:
            for name, shape in slice_shapes(self.layout, self.shapes, self.tp_rank, self.stage).items():
                t = torch.empty(shape, dtype=torch.float32, device=self.device)
                dist.recv(t, 0)
                yield name, t
            return
        read = self._view(flat)
        for rank, (stage, tp_rank, _) in enumerate(self.places[1:], start=1):
            for _, t in hf_to_megatron(read, self.layout, tp_rank, stage, self.expert_ranks[rank]):
                dist.send(t.to(self.device, torch.float32).contiguous(), rank)
        yield from hf_to_megatron(read, self.layout, self.tp_rank, self.stage, self.expert_rank)

    def _shards(self, name: str, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` (tensor ``name``) from every rank of the tensor-parallel group, in rank order; a
        routed expert's from every rank of the expert-parallel group (``megatron_weights.ReadShards``)."""
        size, group = (
            (self.layout.ep, self.expert_group) if is_expert(name) else (self.layout.tp, self.tp_group)
        )
        if size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(size)]
        torch.distributed.all_gather(out, t.contiguous(), group=group)
        return out

    def _to_leader(self, flat: np.ndarray, tensor_of, add: bool = False) -> None:  # noqa: ANN001
        """Gather each tensor (``tensor_of(name)``) into the leader's ``flat`` in the shared layout,
        or add it (``_on_hosts``). Collective over the replica."""
        out = torch.from_numpy(flat)
        for name, t in self._on_hosts(tensor_of):
            at, shape = self.flat_layout.span(name)  # a tensor, or a piece of one (an expert)
            part = out[at : at + shape.numel()]
            if add:
                part.add_(t.reshape(-1).cpu())
            else:
                part.copy_(t.reshape(-1))

    def _on_hosts(self, tensor_of, hosts: Sequence[int] = (0,)) -> Iterator[tuple[str, torch.Tensor]]:  # noqa: ANN001
        """Each Hugging Face tensor whole (``tensor_of(name)`` of each rank's slice), one at a
        time, on each of ``hosts`` (ranks of the replica); nothing elsewhere. Stage by stage, its
        ranks of the first data-parallel replica assemble its tensors (TP shards gathered: each
        of them then holds every tensor whole), and its first rank sends each to every host that
        did not assemble it. Collective over the replica."""
        dist = torch.distributed
        me = dist.get_rank()
        with torch.no_grad():
            for stage in range(self.layout.pp):
                first = self.places.index((stage, 0, 0))
                away = [h for h in hosts if not self._assembles(h, stage)]
                if self._assembles(me, stage):
                    for name, t in megatron_to_hf(
                        lambda n: self._shards(n, tensor_of(n)), self.layout, stage
                    ):
                        if me == first:
                            for host in away:
                                dist.send(t.float().contiguous(), host)
                        kept = whole(name)[0] in self.slots  # a tied lm_head is the embedding's slot
                        if me in hosts and kept:
                            yield name, t
                elif me in hosts:
                    for name, t in self._received(stage):
                        if whole(name)[0] in self.slots:
                            yield name, t

    def _assembles(self, rank: int, stage: int) -> bool:
        """Rank ``rank`` assembles stage ``stage``'s tensors in ``_on_hosts``: the stage's ranks of
        the first data-parallel replica; with experts split, every rank of the stage (the experts
        are gathered over their expert-parallel group, which spans replicas)."""
        at, _, dp_rank = self.places[rank]
        return at == stage and (dp_rank == 0 or self.layout.ep > 1)

    def hf_tensors(self, hosts: Sequence[int] = (0,)) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights as whole Hugging Face tensors, one at a time, on each rank of
        ``hosts`` (the replica's ranks whose engines take weights; the leader by default), the
        fp32 masters where kept: what an engine loads, a bucket at a time, with no whole-model
        buffer anywhere. Each is gathered on the replica's devices (a released trainer's
        parameter visits its device for its gather). The other ranks yield nothing; every rank
        must read it to its end. Collective over the replica."""
        source = self.master or self.params

        def tensor_of(name: str) -> torch.Tensor:
            return source[name].detach().to(self.device, torch.float32)

        yield from self._on_hosts(tensor_of, hosts)

    def _received(self, stage: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Stage ``stage``'s Hugging Face tensors, as its first rank sends them to a host."""
        src = self.places.index((stage, 0, 0))
        for name, shape in stage_shapes(self.layout, self.shapes, stage).items():
            t = torch.empty(shape, dtype=torch.float32, device=self.device)
            torch.distributed.recv(t, src)
            yield name, t


def _views(flat: torch.Tensor, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """``flat`` cut into one view a tensor, in ``shapes``' order."""
    views, at = {}, 0
    for name, shape in shapes.items():
        views[name] = flat[at : at + shape.numel()].view(shape)
        at += shape.numel()
    return views


def _reader(model_dir: Path, layout: FlatLayout):  # noqa: ANN202 - a reader callback
    """Tensors of ``layout`` by name from a model directory's files, one at a time (fused experts
    joined from the checkpoint's tensors they are made of, ``FlatLayout.read``)."""
    files = hf_weight_files(model_dir)
    where = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            where.update(dict.fromkeys(h.keys(), f))

    def read_checkpoint(name: str) -> torch.Tensor:
        with safe_open(where[name], framework="pt") as h:
            return h.get_tensor(name)

    return lambda name: layout.read(name, read_checkpoint)
