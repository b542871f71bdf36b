"""Moving weights, gradients and the micro-step counter between cells (docs/ARCHITECTURE.md §2)."""

from gyre_hpc.transport.backend import choose_backend, make_transport
from gyre_hpc.transport.base import Transport, TransportPlan

__all__ = ["Transport", "TransportPlan", "choose_backend", "make_transport"]
