"""One execution's limits across all its processes: how many, how much memory, how much CPU.

```
 Groups (the run's, chosen once)              Group (one per execution, and one per scorer run)
   cgroup-v2  <base>/gyre-<pid>/<name>/         pids.max · memory.max + memory.swap.max · cpu.max
   cgroup-v1  <pids|memory|cpu>/…/gyre-<pid>/<name>/  pids.max · memory(.memsw).limit_in_bytes · cfs_quota
              (and <freezer>/…, where it is mounted)
   uid        a uid of its own (root, no cgroups): RLIMIT_NPROC counts that uid's processes only
   none       per-process limits only (not root and no writable cgroups: said once, at start)

 every process an execution starts:  sh (joins the group) ─▶ prlimit (cpu, as, fsize[, nproc]) ─▶ …
 the execution ends:                 the group frozen, every process in it killed, the group removed
```

Killing a group freezes it first where the kernel can (v1's freezer, when it is mounted; v2's
``cgroup.kill`` kills the whole group at once), so no process forks a child that escapes the list
being killed; a uid's processes are killed by ``kill -1`` run as that uid, which the kernel applies
to all of them together. Only the ``none`` kind has no group to kill.

A process joins its group as the first program it runs (a few lines of ``sh``), so nothing it
forks ever runs outside it; the per-process limits (CPU seconds, address space, file size) are
set by ``prlimit`` after that, as before. Cgroups are made under the runtime's own (v1: in each
controller's hierarchy; v2: where its controllers are delegated, or under the root when the
runtime is root), so a job's own limits still hold over them.

This module knows nothing of sandboxes or workspaces: it bounds processes, whoever starts them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gyre_hpc.errors import GyreError

KINDS = ("cgroup", "uid", "none")
UID_BASE = 3_000_000
"""The uid mode's first uid: executions run as UID_BASE + slot, far from users' and subuid ranges."""
JOIN = 'f=$1; shift; while [ "$1" != -- ]; do echo $$ >"$1" || exit 125; shift; done; shift; exec "$@" 9<"$f"'
"""The first program of every process: join the group's cgroups, open the seccomp filter (the
first argument, or /dev/null) on fd 9 for bwrap, then exec the rest."""
CONTROLLERS = ("pids", "memory", "cpu")
FREEZER = "freezer"
"""v1's freezer: joined where it is mounted, so a group is frozen before it is killed."""
FREEZE_WAIT_S = 2.0


@dataclass(frozen=True)
class Limits:
    """What one execution's processes may use, together."""

    processes: int = 512
    memory_bytes: int = 4 << 30
    cpus: float = 2.0
    workspace_bytes: int = 2 << 30
    workspace_entries: int = 200_000
    output_bytes: int = 256 << 20
    """A command printing more than this is killed (what is kept of its output is far less)."""


@dataclass
class Group:
    """One execution's processes (a cgroup, or a uid of their own)."""

    name: str
    limits: Limits
    dirs: tuple[Path, ...] = ()
    """The cgroup directories it joins (one per hierarchy: several under v1)."""
    uid: int | None = None
    """Its own uid (the uid mode), else None: the sandbox's."""
    v2: bool = False
    release: Callable[[], None] | None = field(default=None, repr=False)
    """What ``close`` hands back (the uid mode's slot)."""

    @property
    def procs(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def prefix(self, seccomp: str = "/dev/null") -> list[str]:
        """The argv before a command: join, then exec the rest (``seccomp`` opened on fd 9)."""
        return ["sh", "-c", JOIN, "gyre-limits", seccomp, *self.procs, "--"]

    def rlimits(self, cpu_s: int, file_bytes: int) -> list[str]:
        """``prlimit`` with the per-process limits; ``--nproc`` bounds the uid mode's processes."""
        a = ["prlimit", f"--cpu={cpu_s}", f"--as={self.limits.memory_bytes}", f"--fsize={file_bytes}"]
        if self.uid is not None:
            a.append(f"--nproc={self.limits.processes}")
        return [*a, "--"]

    def pids(self) -> list[int]:
        out: set[int] = set()
        for p in self.procs:
            with contextlib.suppress(OSError, ValueError):
                out.update(int(line) for line in Path(p).read_text().split())
        return sorted(out)

    def kill(self) -> None:
        """SIGKILL every process in the group (a uid's: every process of that uid), until none is
        left; frozen first (or killed at once by v2's ``cgroup.kill``) so that none forks meanwhile."""
        freezer = next((d for d in self.dirs if (d / "freezer.state").exists()), None)
        if freezer is not None:
            _freeze(freezer, "FROZEN")
            try:
                self._signal(self.pids())
            finally:
                _freeze(freezer, "THAWED")  # the killed die as they thaw
        elif self.v2:
            with contextlib.suppress(OSError):
                (self.dirs[0] / "cgroup.kill").write_text("1\n")
        elif self.uid is not None:
            _kill_all_of(self.uid)
        for _ in range(1000):  # what is still there: not frozen, or on its way out
            pids = self.pids() if self.dirs else _pids_of_uid(self.uid) if self.uid is not None else []
            if not pids:
                return
            self._signal(pids)
            time.sleep(0.001)  # the kernel takes the killed out of the group as they exit

    @staticmethod
    def _signal(pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def events(self) -> dict[str, int]:
        """How often a limit was hit: ``processes`` (forks refused), ``memory`` (OOM kills)."""
        counts = {"processes": 0, "memory": 0}
        for d in self.dirs:
            for name, key, field_ in (
                ("pids.events", "processes", "max"),
                ("memory.events", "memory", "oom_kill"),
                ("memory.oom_control", "memory", "oom_kill"),
            ):
                with contextlib.suppress(OSError, ValueError):
                    for line in (d / name).read_text().splitlines():
                        k, _, v = line.partition(" ")
                        if k == field_:
                            counts[key] += int(v)
        return counts

    def peak_memory(self) -> int:
        """The group's peak memory in bytes (0 where it is not known)."""
        for d in self.dirs:
            for name in ("memory.max_usage_in_bytes", "memory.peak"):
                with contextlib.suppress(OSError, ValueError):
                    return int((d / name).read_text())
        return 0

    def set_limits(self) -> None:
        """Write the limits into the group's cgroup files, as the cgroup version names them."""
        lim = self.limits
        period = 100_000
        quota = max(1000, int(lim.cpus * period))
        if self.v2:
            (d,) = self.dirs
            (d / "pids.max").write_text(f"{lim.processes}\n")
            (d / "memory.max").write_text(f"{lim.memory_bytes}\n")
            with contextlib.suppress(FileNotFoundError):
                (d / "memory.swap.max").write_text("0\n")
            (d / "cpu.max").write_text(f"{quota} {period}\n")
            return
        for d in self.dirs:
            if (d / "pids.max").exists():
                (d / "pids.max").write_text(f"{lim.processes}\n")
            if (d / "memory.limit_in_bytes").exists():
                (d / "memory.limit_in_bytes").write_text(f"{lim.memory_bytes}\n")
                with contextlib.suppress(FileNotFoundError):  # no swap accounting: nothing to bound
                    (d / "memory.memsw.limit_in_bytes").write_text(f"{lim.memory_bytes}\n")
            if (d / "cpu.cfs_quota_us").exists():
                (d / "cpu.cfs_period_us").write_text(f"{period}\n")
                (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    def close(self) -> None:
        self.kill()
        for d in self.dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # processes still leaving it
                    self.kill()
                    time.sleep(0.01)
        if self.release is not None:
            self.release()


def _freeze(d: Path, state: str) -> None:
    """Set a v1 freezer group's state and wait (a bounded while) until the kernel has reached it."""
    with contextlib.suppress(OSError):
        (d / "freezer.state").write_text(f"{state}\n")
        deadline = time.monotonic() + FREEZE_WAIT_S
        while (d / "freezer.state").read_text().strip() != state and time.monotonic() < deadline:
            time.sleep(0.001)


def _kill_all_of(uid: int) -> None:
    """``kill -KILL -1`` as ``uid``: the kernel signals every process of that uid in one pass."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["kill", "-KILL", "-1"], user=uid, group=uid, timeout=10, capture_output=True)


def _pids_of_uid(uid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                if p.stat().st_uid == uid:
                    out.append(int(p.name))
    return out


@dataclass
class Groups:
    """The run's way of making groups: ``kind`` is cgroup-v1, cgroup-v2, uid or none."""

    kind: str
    limits: Limits
    roots: tuple[Path, ...] = ()
    """Per hierarchy, the directory (``gyre-<pid>``) this runtime's groups are made in."""
    _slots: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _made: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def limited(self, limits: Limits) -> Groups:
        """The same groups with other limits (a task that names its own): one directory, one
        counter of names and one set of uid slots with this one, so their groups never collide."""
        return dataclasses.replace(self, limits=limits)

    @contextlib.contextmanager
    def group(self, name: str) -> Iterator[Group]:
        """A new group for one execution (or scorer run), removed with all its processes at the end."""
        g = self.open(name)
        try:
            yield g
        finally:
            g.close()

    def open(self, name: str) -> Group:
        if self.kind == "uid":
            with self._lock:
                slot = next(i for i in range(len(self._slots) + 1) if i not in self._slots)
                self._slots.add(slot)
            return Group(name, self.limits, uid=UID_BASE + slot, release=lambda: self._free(slot))
        if self.kind == "none":
            return Group(name, self.limits)
        with self._lock:
            leaf = f"{_safe(name)}-{next(self._made)}"
        dirs = []
        for root in self.roots:
            d = root / leaf
            d.mkdir()
            dirs.append(d)
        g = Group(name, self.limits, tuple(dirs), v2=self.kind == "cgroup-v2")
        try:
            g.set_limits()
        except OSError as err:
            g.close()
            raise GyreError(f"cannot set the limits of cgroup {dirs[0]}: {err.strerror or err}") from None
        return g

    def _free(self, slot: int) -> None:
        with self._lock:
            self._slots.discard(slot)

    def close(self) -> None:
        """Remove this runtime's directory of groups (what is left of them)."""
        for root in self.roots:
            for d in root.glob("*"):
                if d.is_dir():
                    Group(d.name, self.limits, (d,)).close()
            with contextlib.suppress(OSError):
                root.rmdir()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80] or "group"


# -- choosing the backend ---------------------------------------------------------------------


@dataclass(frozen=True)
class Hierarchies:
    """Where this process's cgroups are: v1 controller → its directory, or the v2 directory."""

    v1: dict[str, Path]
    v2: Path | None
    v2_mount: Path | None = None


def hierarchies(mounts: str, cgroups: str) -> Hierarchies:
    """Read from ``/proc/self/mounts`` and ``/proc/self/cgroup`` (pure: golden-tested)."""
    own_v1: dict[str, str] = {}
    own_v2 = None
    for line in cgroups.splitlines():
        num, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if num == "0" and ctrls == "":
            own_v2 = path
        for c in ctrls.split(","):
            if c:
                own_v1[c] = path
    v1: dict[str, Path] = {}
    v2 = v2_mount = None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        where, fstype, opts = parts[1], parts[2], parts[3].split(",")
        if fstype == "cgroup":
            for c in (*CONTROLLERS, FREEZER):
                if c in opts and c in own_v1:
                    v1[c] = Path(where) / own_v1[c].lstrip("/")
        elif fstype == "cgroup2" and own_v2 is not None:
            v2, v2_mount = Path(where) / own_v2.lstrip("/"), Path(where)
    return Hierarchies(v1, v2, v2_mount)


def choose(kind: str, limits: Limits, root: Path = Path("/")) -> tuple[Groups, str | None]:
    """The run's groups for ``agent.limits`` = ``kind`` (auto, cgroup, uid, none), and a line saying
    what ``auto`` fell back to (None when it did not). ``cgroup`` or ``uid`` asked for by name are
    required: one line if they cannot be had."""
    if kind not in ("auto", *KINDS):
        raise GyreError(f"agent.limits = {kind!r}; valid: auto, {', '.join(KINDS)}")
    why = "cgroups not asked for"
    if kind in ("auto", "cgroup"):
        groups, why = _cgroups(limits, root)
        if groups is not None:
            return groups, None
        if kind == "cgroup":
            raise GyreError(f"agent.limits = cgroup: {why}; set agent.limits = auto")
    if kind in ("auto", "uid"):
        if os.getuid() == 0:
            note = (
                None
                if kind == "uid"
                else f"agent.limits = auto: {why}; each execution runs as a uid of its own"
            )
            return Groups("uid", limits), note
        if kind == "uid":
            raise GyreError(
                "agent.limits = uid needs the runtime to run as root (to give each execution a uid)"
            )
    note = None
    if kind == "auto":
        note = (
            f"agent.limits = auto: {why}, and the runtime is not root; an execution's processes are "
            "limited one by one (CPU time, memory, file size), not together"
        )
    return Groups("none", limits), note


def _cgroups(limits: Limits, root: Path) -> tuple[Groups | None, str]:
    try:
        mounts = (root / "proc/self/mounts").read_text()
        cgroups = (root / "proc/self/cgroup").read_text()
    except OSError as err:
        return None, f"cgroups cannot be read ({err.strerror})"
    h = hierarchies(mounts, cgroups)
    name = f"gyre-{os.getpid()}"
    if h.v2 is not None and (h.v2 / "cgroup.controllers").exists():
        base = _v2_base(h.v2, h.v2_mount)
        if base is not None:
            return _made(Groups("cgroup-v2", limits, (base / name,)))
    if all(c in h.v1 for c in CONTROLLERS):
        joined = (*CONTROLLERS, FREEZER) if FREEZER in h.v1 else CONTROLLERS
        return _made(Groups("cgroup-v1", limits, tuple(h.v1[c] / name for c in joined)))
    missing = [c for c in CONTROLLERS if c not in h.v1]
    return None, f"no writable cgroup with the {', '.join(missing or CONTROLLERS)} controllers"


def _v2_base(own: Path, mount: Path | None) -> Path | None:
    """Where v2 groups may go: our own cgroup if its children get the controllers (delegated), else
    the hierarchy's root (where root may put them)."""
    for base in (own, mount):
        if base is None:
            continue
        with contextlib.suppress(OSError):
            enabled = set((base / "cgroup.subtree_control").read_text().split())
            if set(CONTROLLERS) <= enabled and os.access(base, os.W_OK):
                return base
    return None


def _made(groups: Groups) -> tuple[Groups | None, str]:
    made: list[Path] = []
    try:
        for d in groups.roots:
            _sweep(d.parent)
            d.mkdir(exist_ok=True)
            made.append(d)
        if groups.kind == "cgroup-v2":
            (groups.roots[0] / "cgroup.subtree_control").write_text("+pids +memory +cpu\n")
    except OSError as err:
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        return None, f"cgroups are not writable here ({err.strerror or err})"
    atexit.register(groups.close)  # a runtime that is killed leaves them to the next one's sweep
    return groups, ""


def _sweep(parent: Path) -> None:
    """Remove what runtimes that died left behind (``gyre-<pid>`` of a pid that is gone)."""
    with contextlib.suppress(OSError):
        for d in parent.glob("gyre-*"):
            pid = d.name.removeprefix("gyre-")
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                Groups("cgroup-v1", Limits(), (d,)).close()
