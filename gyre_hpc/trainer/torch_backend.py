"""The ``torch`` trainer: plain PyTorch, CPU or one GPU (``trainer.device``), AdamW on the core.

Parameters and gradients are views into two flat buffers (``models.flat``) on the device it
computes on. On the CPU those are the host buffers themselves: the gradient buffer may be memory
the transport exposes (pass ``grad_buffer``), so a finished cell's gradient is readable by the
core without a copy. On a GPU the host buffers are mirrors, written when asked (``weights``,
``gradient``: once a step) and read back where the core's summed gradient arrives (``apply``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from gyre_hpc.loss.policy_loss import Surrogate
from gyre_hpc.loss.vocab_logprobs import selected_logprobs
from gyre_hpc.models.causal_lm import KV, CausalLM
from gyre_hpc.models.flat import FlatLayout
from gyre_hpc.models.routing import routed
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.rundir import checkpoint_optimizer
from gyre_hpc.step.claims import MicroStats, micro_stats
from gyre_hpc.trainer import weight_shards
from gyre_hpc.trainer.base import (
    ApplyStats,
    entry_rows,
    mean_gradient_scale,
    packed_loss,
    policy_micro_step,
    tree_inputs,
)
from gyre_hpc.trainer.offload import Offload, moments
from gyre_hpc.trainer.state_files import read_state, write_state
from gyre_hpc.trajectory.packing import PackedTree, pack_tree
from gyre_hpc.trajectory.sequences import TrainSequence


class TorchTrainer:
    def __init__(
        self,
        model_dir: str | Path,
        config: TrainerConfig,
        *,
        core: bool,
        grad_buffer: np.ndarray | None = None,
        packing: str = "paths",
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.packing = packing
        """``tree``: a micro-step's sequences forwarded as one packed tree (``trajectory.packing``)."""
        self.device = torch.device(device)
        self.model = CausalLM.from_pretrained(model_dir).train().to(self.device)
        layout = self.layout = FlatLayout.of(self.model.config)
        self.numel = layout.numel
        if grad_buffer is None:
            grad_buffer = np.zeros(self.numel, dtype=np.float32)
        if grad_buffer.shape != (self.numel,) or grad_buffer.dtype != np.float32:
            raise ValueError(f"gradient buffer must be float32[{self.numel}]")
        self.host_grad = torch.from_numpy(grad_buffer)
        on_host = self.device.type == "cpu"
        self.flat = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        self.host_flat = self.flat if on_host else torch.empty(self.numel, pin_memory=True)
        self.grad = self.host_grad if on_host else torch.zeros(self.numel, device=self.device)
        layout.bind(self.model, self.flat, self.grad)
        self.grad.zero_()
        self.version = 0
        self.replay = config.routing_replay and bool(self.model.config.num_experts)
        self.offload = Offload()
        params = list(self.model.parameters())  # tied ones once
        self.optimizer = (
            torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, foreach=False)
            if core
            else None
        )

    def weights(self) -> np.ndarray:
        if self.host_flat is not self.flat:
            self.host_flat.copy_(self.flat)
        return self.host_flat.numpy()

    def gradient(self) -> np.ndarray:
        if self.host_grad is not self.grad:
            self.host_grad.copy_(self.grad)
        return self.host_grad.numpy()

    def hf_gradient(self) -> np.ndarray:
        """The whole gradient in the shared layout: its gradient, one rank holding it all."""
        return self.gradient()

    def load_snapshot(self, flat: np.ndarray, version: int) -> None:
        self.flat.copy_(torch.from_numpy(flat))
        self.version = version

    def zero_grad(self) -> None:
        self.grad.zero_()  # in place: the parameters' .grad are views of it
        if self.host_grad is not self.grad:
            self.host_grad.zero_()

    def micro_step(self, sequences: list[TrainSequence]) -> MicroStats:
        c = self.config
        if self.packing == "tree":
            return self._tree_micro_step(sequences)

        def hidden(ids: torch.Tensor, s: TrainSequence) -> torch.Tensor:
            with self._replaying(s.routes):
                return self.model.hidden(ids)[0][0]

        return policy_micro_step(sequences, hidden, self._head, Surrogate.of(c), self.version, self.device)

    def _head(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of ``targets`` from the rows before them (``base.Head``)."""
        return selected_logprobs(hidden, self.model.lm_head.weight, targets, chunk=self.config.logprob_chunk)

    def _replaying(self, routes: np.ndarray | None):  # noqa: ANN202 - a context manager
        """Send each token through the experts the engine routed it to (``trainer.routing_replay``):
        ``routes`` [tokens, layers, top-k] of the forward inside, -1 where none is known."""
        if routes is None or not self.replay:
            return contextlib.nullcontext()
        given = torch.from_numpy(np.asarray(routes, dtype=np.int64)).to(self.device)
        return routed(self.model, given, self.model.config.renormalizes_topk)

    def _tree_micro_step(self, sequences: list[TrainSequence]) -> MicroStats:
        c = self.config
        tree = pack_tree(sequences)
        if not len(tree):
            return micro_stats(sequences, 0.0, tokens=0)
        hidden = self._tree_hidden(tree)
        rows, targets, has_parent = entry_rows(tree, self.device)
        picked, entropy = self._head(hidden[rows], targets)
        logp, entropy = torch.where(has_parent, picked, 0.0), torch.where(has_parent, entropy, 0.0)
        loss, stats = packed_loss(tree, logp, Surrogate.of(c), self.version, entropy)
        loss.backward()
        return micro_stats(sequences, float(loss.detach()), stats, len(tree))

    def _tree_hidden(self, tree: PackedTree) -> torch.Tensor:
        """Last hidden state of every packed token [N, H]: the chains in order, each forwarded over the keys
        and values its ancestors left (gathered, so gradients flow back to them), causal inside.
        No N × N mask: each token attends to exactly its ancestors, as in its paths."""
        ids, positions = tree_inputs(tree, self.device)
        layers: list[list[KV]] = []  # per forwarded chain: each layer's keys and values
        out = []
        for start, end in tree.chains():
            seen = torch.from_numpy(tree.ancestors(start)).to(self.device)
            past = None
            if len(seen):
                whole = [(torch.cat([c[i][0] for c in layers], 2), torch.cat([c[i][1] for c in layers], 2))
                         for i in range(len(layers[0]))]  # fmt: skip
                past = [(k.index_select(2, seen), v.index_select(2, seen)) for k, v in whole]
            with self._replaying(None if tree.routes is None else tree.routes[start:end]):
                hidden, kv = self.model.hidden(ids[:, start:end], positions[:, start:end], past=past)
            layers.append(kv)
            out.append(hidden[0])
        return torch.cat(out)

    def apply(self, num_runs: int) -> ApplyStats:
        if self.optimizer is None:
            raise RuntimeError("only the core owns an optimizer")
        if self.host_grad is not self.grad:  # the core's sum over every contributor is on the host
            self.grad.copy_(self.host_grad)
        with torch.no_grad():
            norm, scale = mean_gradient_scale(
                float(torch.linalg.vector_norm(self.grad)), num_runs, self.config.grad_clip
            )
            self.grad.mul_(scale)
        self.optimizer.step()
        self.version += 1
        return ApplyStats(self.version, norm)

    def release_memory(self) -> None:
        """On a GPU: the weights (taken into the host mirror first), the gradient buffer and
        Adam's moments to host memory, the allocator's cache emptied. On the CPU nothing."""
        if self.host_flat is self.flat or self.offload.released:
            return
        self.weights()
        self.offload.release(self._resident())
        self._point()
        torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        if self.offload.released:
            self.offload.resume(self._resident(), self.device)
            self._point()

    def _resident(self) -> list[tuple[str, torch.Tensor]]:
        out = [("flat", self.flat), ("grad", self.grad)]
        if self.optimizer is not None:
            out += moments(self.optimizer, {id(p): n for n, p in self.model.named_parameters()})
        return out

    def _point(self) -> None:
        """The parameters and their gradients are views of the flat buffers wherever these now are."""
        self.layout.point(self.model, self.flat, self.grad)

    # ---- checkpoint state ---------------------------------------------------------------------

    def optimizer_state(self) -> dict:
        assert self.optimizer is not None
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state)

    def save_weights(self, directory: Path, rank: int | None = None) -> dict[str, str]:
        return weight_shards.write_whole(self.layout, self.weights(), directory)

    def load_weights(self, directory: Path, version: int, rank: int | None = None) -> None:
        self.load_snapshot(weight_shards.read_flat(directory, self.layout), version)

    def save_optimizer(self, directory: Path, rank: int | None = None) -> dict[str, str]:
        """Its optimizer state written into ``directory`` (as rank ``rank``'s of a replica):
        file name → sha256."""
        return write_state(self.optimizer_state(), checkpoint_optimizer(directory, rank))

    def load_optimizer(self, directory: Path, rank: int | None = None) -> None:
        self.load_optimizer_state(read_state(checkpoint_optimizer(directory, rank)))
