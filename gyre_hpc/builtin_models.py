"""Which model directory a recipe's ``run.model`` names: a path, or a built-in built offline.

Built-ins are built once into a cache directory (``$GYRE_CACHE`` or ``~/.cache/gyre-hpc``):
``tiny`` (random weights) and ``tiny-warm`` (warm-started on the smoke suite).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from gyre_hpc.errors import GyreError


def cache_dir() -> Path:
    return Path(os.environ.get("GYRE_CACHE") or Path.home() / ".cache" / "gyre-hpc")


def builtins() -> dict[str, Callable[[Path], object]]:
    from gyre_hpc.models.tiny import init_tiny
    from gyre_hpc.tasks.suites import WORDS
    from gyre_hpc.warmstart import warmstart

    return {"tiny": lambda d: init_tiny(d, 0, WORDS), "tiny-warm": lambda d: warmstart(d, "smoke", seed=0)}


def _cache_name(name: str) -> str:
    from gyre_hpc.warmstart import fingerprint

    return f"{name}-{fingerprint()}" if name == "tiny-warm" else name


def resolve_model(name: str) -> Path:
    table = builtins()
    if name in table:
        target = cache_dir() / "models" / _cache_name(name)
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
            table[name](tmp)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)  # atomic: a half-built model is never found
        return target
    path = Path(name)
    if (path / "config.json").exists():
        return path
    raise GyreError(
        f"run.model = {name!r} is neither a model directory (with config.json) nor a built-in "
        f"({', '.join(table)})"
    )
