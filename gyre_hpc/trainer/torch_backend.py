"""The ``torch`` trainer: plain PyTorch, CPU or one GPU, AdamW on the core.

Parameters and gradients are views into two flat buffers (``models.flat``); the gradient buffer
may be memory the transport exposes (pass ``grad_buffer``), so a finished cell's gradient is
readable by the core without a copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gyre_hpc.loss.policy import token_logprobs
from gyre_hpc.models.flat import FlatLayout
from gyre_hpc.models.qwen3 import Qwen3ForCausalLM
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.trainer.base import ApplyStats, MicroStats, mean_gradient_scale, policy_micro_step
from gyre_hpc.trajectory.batch import TrainSequence


class TorchTrainer:
    def __init__(
        self,
        model_dir: str | Path,
        config: TrainerConfig,
        *,
        core: bool,
        grad_buffer: np.ndarray | None = None,
    ) -> None:
        self.config = config
        self.model = Qwen3ForCausalLM.from_pretrained(model_dir).train()
        layout = FlatLayout.of(self.model.config)
        self.numel = layout.numel
        self.flat = torch.empty(self.numel, dtype=torch.float32)
        if grad_buffer is None:
            grad_buffer = np.zeros(self.numel, dtype=np.float32)
        if grad_buffer.shape != (self.numel,) or grad_buffer.dtype != np.float32:
            raise ValueError(f"gradient buffer must be float32[{self.numel}]")
        self.grad = torch.from_numpy(grad_buffer)
        layout.bind(self.model, self.flat, self.grad)
        self.grad.zero_()
        self.version = 0
        params = list(self.model.parameters())  # tied ones once
        self.optimizer = (
            torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, foreach=False)
            if core
            else None
        )

    def weights(self) -> np.ndarray:
        return self.flat.numpy()

    def gradient(self) -> np.ndarray:
        return self.grad.numpy()

    def load_snapshot(self, flat: np.ndarray, version: int) -> None:
        self.flat.copy_(torch.from_numpy(flat))
        self.version = version

    def zero_grad(self) -> None:
        self.grad.zero_()  # in place: the parameters' .grad are views of it

    def micro_step(self, sequences: list[TrainSequence]) -> MicroStats:
        c = self.config
        logprobs = lambda ids: token_logprobs(self.model(ids)[0][0], ids[0])  # noqa: E731
        return policy_micro_step(sequences, logprobs, c.clip_low, c.clip_high)

    def apply(self, num_runs: int) -> ApplyStats:
        if self.optimizer is None:
            raise RuntimeError("only the core owns an optimizer")
        with torch.no_grad():
            norm, scale = mean_gradient_scale(
                float(torch.linalg.vector_norm(self.grad)), num_runs, self.config.grad_clip
            )
            self.grad.mul_(scale)
        self.optimizer.step()
        self.version += 1
        return ApplyStats(self.version, norm)

    # ---- checkpoint state ---------------------------------------------------------------------

    def optimizer_state(self) -> dict:
        assert self.optimizer is not None
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state)
