"""A trainer's optimizer state as checkpoint files: one per rank that holds some, each written
by its own rank with its digest, so no rank gathers another's state and the digests are taken
in parallel.

```
 a trainer of one rank:        optimizer.pt
 a replica over n ranks:       optimizer-rank-0.pt … optimizer-rank-<n-1>.pt  (each its slice's)
```

The names are ``rundir``'s (``checkpoint_optimizer``); this module knows nothing of what the
state holds.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_state(state: dict, path: Path) -> dict[str, str]:
    """``state`` saved to ``path``: its name → its sha256."""
    torch.save(state, path)
    return {path.name: sha256(path)}


def read_state(path: Path) -> dict:
    """A state file read into host memory, wherever its tensors lived when it was written."""
    return torch.load(path, weights_only=True, map_location="cpu")
