"""Which transport backend a run uses, and building it: ``auto`` takes verbs where RDMA exists.

The interface (``transport.base``) names no implementation; this module is the one place that
knows them all.
"""

from __future__ import annotations

import logging
from typing import Any

from gyre_hpc.recipe.schema import TransportConfig
from gyre_hpc.transport.base import Transport, TransportPlan

log = logging.getLogger(__name__)


def rdma_devices() -> list[str]:
    """RDMA device names; [] when pyverbs is missing or the kernel has no RDMA subsystem."""
    try:
        from pyverbs.device import get_device_list
    except ImportError:
        return []
    try:
        devices = get_device_list()
    except Exception:  # raises instead of returning [] when there is no RDMA subsystem at all
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


def choose_backend(config: TransportConfig) -> tuple[str, str]:
    """(backend, why): ``auto`` takes verbs only where an RDMA device exists."""
    if config.backend == "mpi":
        return "mpi", "transport.backend = mpi"
    devices = rdma_devices()
    if config.backend == "verbs":
        if not devices:
            raise RuntimeError("transport.backend = verbs but no RDMA device exists on this node")
        return "verbs", f"transport.backend = verbs ({', '.join(devices)})"
    if devices:
        return "verbs", f"auto: RDMA devices {', '.join(devices)}"
    return "mpi", "auto: no RDMA device (pyverbs missing or no RDMA subsystem): MPI one-sided"


def make_transport(comm: Any, plan: TransportPlan, config: TransportConfig) -> Transport:
    """Collective over ``comm``: every rank calls it, with the same plan."""
    name, why = choose_backend(config)
    # Every rank must take the same backend: one without a device would otherwise wait forever.
    names = comm.allgather(name)
    if len(set(names)) > 1:
        name, why = "mpi", f"not every rank has an RDMA device ({names.count('verbs')}/{len(names)}): MPI"
    log.info("transport: %s (%s)", name, why)
    if name == "verbs":
        from gyre_hpc.transport.verbs import VerbsTransport

        return VerbsTransport(comm, plan, config)
    from gyre_hpc.transport.mpi import MpiTransport

    return MpiTransport(comm, plan, config.mpi_chunk_mb << 20)
