"""The URL others reach a server at, from the address it binds."""

from __future__ import annotations

import socket

WILDCARDS = ("0.0.0.0", "::", "")


def reachable_url(host: str, port: int) -> str:
    """``http://host:port``, with this host's name for a wildcard address (other nodes dial it)."""
    if host in WILDCARDS:
        host = socket.gethostname()
    return f"http://{host}:{port}"
