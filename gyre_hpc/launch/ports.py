"""A TCP port free on a host now, for a server or a rendezvous store another process opens next.

The port is free when this returns, not reserved: the process that takes it binds it moments
later, and one that finds it taken fails with its own error (SGLang's server, torch's store).
"""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port the OS would give a socket bound on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
