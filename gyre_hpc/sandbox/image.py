"""A task's image, as a sandbox can run it.

```
 /path/to/rootfs/          a root filesystem directory (an unpacked OCI/Docker image, mmdebstrap's)
 /path/to/rootfs.tar[.gz]  a tarball of one: unpacked once into the image cache, then as above
        └─▶ bwrap: its usr, etc, … are the system (read-only); the runtime's Python is not shown
 docker://…, oras://…, library://…, *.sif
        └─▶ apptainer runs it (agent.sandbox = apptainer)
```

A registry name alone (``python:3.11-slim``) is neither: nothing is pulled at run time here.
Export it to a tarball (``podman export``, ``docker export``) or name it as ``docker://`` for
Apptainer. The cache (``GYRE_IMAGE_CACHE``, default ``~/.cache/gyre-hpc/images``) keys a
tarball by its path, size and modification time.

What it does not know: the image's entrypoint, environment or user — an execution runs its
commands with the sandbox's environment and uid, as on the host system.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.errors import GyreError

APPTAINER = ("docker://", "oras://", "library://", "shub://", "docker-archive:")
TARBALLS = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".tar.zst")


@dataclass(frozen=True)
class Image:
    kind: str
    """``rootfs`` (a directory bwrap shows as the system) or ``apptainer`` (a reference)."""
    ref: str


def cache_dir() -> Path:
    return Path(os.environ.get("GYRE_IMAGE_CACHE") or Path.home() / ".cache" / "gyre-hpc" / "images")


def resolve(ref: str) -> Image:
    """What ``ref`` names; one line saying why if it is nothing a sandbox here can run."""
    if ref.startswith(APPTAINER) or ref.endswith(".sif"):
        return Image("apptainer", ref)
    path = Path(ref)
    if path.is_dir():
        if not (path / "usr").is_dir():
            raise GyreError(f"image {ref}: a directory without usr/ is not a root filesystem")
        return Image("rootfs", str(path.resolve()))
    if path.is_file() and ref.endswith(TARBALLS):
        return Image("rootfs", str(unpacked(path.resolve(), cache_dir())))
    raise GyreError(
        f"image {ref!r} is not a root filesystem directory, a tarball of one, a .sif nor docker://…; "
        "nothing is pulled here: export it to a tarball (podman export) or use agent.sandbox = apptainer"
    )


def unpacked(tarball: Path, cache: Path) -> Path:
    """``tarball`` unpacked under ``cache``, once (concurrent callers: the first rename wins)."""
    st = tarball.stat()
    key = hashlib.sha256(f"{tarball}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    dest = cache / f"{tarball.name.split('.')[0]}-{key}"
    if dest.is_dir():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{dest.name}.{os.getpid()}"
    tmp.mkdir()
    owners = "--no-same-owner" if os.getuid() else "--same-owner"
    done = subprocess.run(
        ["tar", "--numeric-owner", owners, "-xpf", str(tarball)], cwd=tmp, capture_output=True, text=True
    )
    if done.returncode or not (tmp / "usr").is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        why = (done.stderr.strip().splitlines() or ["no usr/ in it"])[-1]
        raise GyreError(f"image {tarball}: not a root filesystem tarball ({why})")
    try:
        tmp.rename(dest)
    except OSError:  # another process unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
