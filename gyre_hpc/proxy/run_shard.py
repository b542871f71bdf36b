"""Which proxy worker owns a run: a stable hash of the run id, the same in every process.

With ``proxy.workers`` > 1 the proxy is several processes, each serving the runs of its shard
and writing them to its own TITO segment; an execution is told its worker's URL, and a worker
refuses a run of another shard. Pure: no I/O.
"""

from __future__ import annotations

import zlib


def shard_of(run_id: str, workers: int) -> int:
    """The worker (0 … workers-1) that owns ``run_id``; stable across processes and restarts."""
    return zlib.crc32(run_id.encode()) % workers if workers > 1 else 0
