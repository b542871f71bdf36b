"""What one execution's processes see: a frozen record the sandbox backends render.

Paths are host paths and appear at the same path inside, so a workspace path in a tool's
output means the same thing to the agent and to the runtime — except where a task names its own
working directory (``workdir``: a Harbor task's ``/app``) and the directories its verifier is
given (``mounts``: ``/tests``, ``/logs/verifier``). Everything not named here is absent: a
sandbox starts from an empty root, not from the host's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.errors import GyreError

INSIDE = Path("/run/gyre")
"""Where a sandbox sees the relay program and the proxy's socket."""
SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
"""Top-level host directories shown read-only (those that exist; symlinks stay symlinks)."""


@dataclass(frozen=True)
class ProxyReach:
    """How a command harness reaches the proxy from a sandbox without a network."""

    socket: Path
    """A host Unix socket that forwards to the proxy (``agents.external``)."""
    port: int
    """The sandbox's loopback port the relay listens on: the harness's base URL is
    ``http://127.0.0.1:<port>``."""


@dataclass(frozen=True)
class Mount:
    """A host directory shown at another path inside: read-only unless ``writable``."""

    host: Path
    inside: Path
    writable: bool = False


@dataclass(frozen=True)
class Policy:
    workspace: Path
    """Working and home directory: the only host path the sandbox may write."""
    readonly: tuple[Path, ...] = ()
    """Host paths shown read-only besides the system: ``agent.sandbox_binds``."""
    hidden: tuple[Path, ...] = ()
    """Directories never shown, even under a read-only path: the run directory (all but the
    workspace itself), a task suite's directory."""
    hidden_files: tuple[Path, ...] = ()
    """Files never shown, likewise: a task suite's JSONL file."""
    uid: int = 65534
    """The uid and gid inside (and outside, when the runtime is root: ``confine``)."""
    proxy: ProxyReach | None = None
    """None: no network at all (tool commands). Set: loopback only, relayed to the proxy."""
    workdir: Path | None = None
    """Where the workspace appears inside; None: at its host path."""
    mounts: tuple[Mount, ...] = ()
    """Directories shown at paths of their own (a verifier's tests and its log directory)."""

    @property
    def inside(self) -> Path:
        """The workspace's path as the sandbox's processes see it."""
        return self.workdir or self.workspace


@dataclass(frozen=True)
class System:
    """The host's read-only system (bwrap; under apptainer the image is the system): directories
    bound as they are, merged-/usr symlinks, and the runtime's Python (the relay runs on it)."""

    dirs: tuple[str, ...]
    links: tuple[tuple[str, str], ...] = ()
    """(path, target): ``/bin`` → ``usr/bin`` on a merged-/usr system."""
    root: str = ""
    """An image's root filesystem the directories are bound from (``/usr`` from ``root/usr``);
    empty: the host's own."""


def image_system(root: Path) -> System:
    """A root filesystem directory as the system: its directories and links, nothing of the host
    (the runtime's Python neither: commands run the image's own)."""
    dirs, links = _system_of(root)
    return System(tuple(dirs), tuple(links), str(root))


def host_system(root: Path = Path("/")) -> System:
    dirs, links = _system_of(root)
    return System((*dirs, *map(str, python_paths())), tuple(links))


def _system_of(root: Path) -> tuple[list[str], list[tuple[str, str]]]:
    dirs, links = [], []
    for name in SYSTEM:
        p = root / name
        if p.is_symlink():
            links.append((f"/{name}", str(p.readlink())))
        elif p.is_dir():
            dirs.append(f"/{name}")
    return dirs, links


def python_paths() -> tuple[Path, ...]:
    """The interpreter and its packages, so that ``python`` and the relay run inside."""
    prefixes = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    return tuple(sorted(p for p in prefixes if not _under_system(p)))


def _under_system(p: Path) -> bool:
    return any(p.is_relative_to(f"/{name}") for name in SYSTEM)


def policy(
    workspace: Path,
    *,
    uid: int,
    binds: tuple[Path, ...] = (),
    hidden: tuple[Path, ...] = (),
    proxy: ProxyReach | None = None,
    workdir: Path | None = None,
    mounts: tuple[Mount, ...] = (),
) -> Policy:
    """The policy for one workspace; one line naming the conflict if a bind would show a hidden path
    or a path of its own (``workdir``, ``mounts``) is not an absolute path outside the system."""
    for where in (workdir, *(m.inside for m in mounts)):
        if where is not None and (not where.is_absolute() or _under_system(where) or where == Path("/")):
            raise GyreError(f"{where}: a sandbox path must be absolute and outside {', '.join(SYSTEM)}")
    workspace = workspace.resolve()
    readonly = tuple(dict.fromkeys(p.resolve() for p in binds))
    hidden = tuple(p.resolve() for p in hidden)
    for bind in readonly:
        for h in hidden:
            if bind.is_relative_to(h):
                raise GyreError(f"agent.sandbox_binds: {bind} is inside {h}, which a sandbox never shows")
    shown = [h for h in hidden if any(h.is_relative_to(b) for b in readonly)]  # others are absent anyway
    return Policy(
        workspace,
        readonly,
        tuple(h for h in shown if h.is_dir()),
        tuple(h for h in shown if h.is_file()),
        uid,
        proxy,
        workdir,
        mounts,
    )
