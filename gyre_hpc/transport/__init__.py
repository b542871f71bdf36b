"""Moving weights, gradients and the micro-step counter between cells (DESIGN.md §6)."""

from gyre_hpc.transport.base import Transport, TransportPlan, choose_backend, make_transport

__all__ = ["Transport", "TransportPlan", "choose_backend", "make_transport"]
