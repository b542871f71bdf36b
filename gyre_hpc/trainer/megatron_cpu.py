"""megatron-core on a machine without a GPU: the few ``torch.cuda`` calls it makes, sent to the CPU.

megatron-core builds and runs its models on the CPU over gloo, except that its RNG tracker and
its rotary embedding ask CUDA for a device and random states, and its all-to-all token dispatcher
for a side stream. ``redirect_cuda_to_cpu`` points
exactly those calls at the CPU equivalents. It is used only when ``torch.cuda.is_available()``
is false (tests, laptops); with a GPU nothing is touched. The causal mask is always passed
explicitly by the trainer, so megatron's default (CUDA) mask is never built.
"""

from __future__ import annotations

import contextlib

import torch


def redirect_cuda_to_cpu() -> bool:
    """Redirect megatron-core's CUDA device and RNG calls to the CPU; False (and nothing done)
    when a GPU exists. Idempotent."""
    if torch.cuda.is_available():
        return False
    import megatron.core.tensor_parallel.random as megatron_random

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # The all-to-all token dispatcher copies its token counts to the host on a side stream.
    torch.cuda.Stream = _HostStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *args, **kwargs: _HOST_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]
    # ... and turns them into numpy only when they were on the GPU: gloo's all-to-all takes
    # sequences of ints, not tensors.
    from megatron.core.transformer.moe import token_dispatcher

    to_host = token_dispatcher.maybe_move_tensor_to_cpu
    if not getattr(to_host, "on_host", False):

        def on_host(tensor: object, as_numpy: bool = False, record_stream: bool = False) -> object:
            if as_numpy and torch.is_tensor(tensor):
                return tensor.numpy()
            return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

        on_host.on_host = True  # type: ignore[attr-defined]
        token_dispatcher.maybe_move_tensor_to_cpu = on_host
    return True


class _HostStream:
    """A CUDA stream as megatron uses one, on the host, where every copy is done when it returns."""

    def __init__(self, *args: object, **kwargs: object) -> None: ...

    def wait_stream(self, stream: object) -> None: ...

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None: ...


_HOST_STREAM = _HostStream()


def without_transformer_engine() -> None:
    """megatron-core 0.16's router names ``te_general_gemm`` whether or not Transformer Engine
    imported (its MoE layers raise NameError without it, CPU or GPU): absent, it is None, which
    megatron reads as "use torch's matmul". Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
