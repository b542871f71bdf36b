"""The run's sandbox: the backend ``agent.sandbox`` names, checked once, turning commands into launches.

``auto`` takes bwrap where a probe sandbox runs, and otherwise says why in one line and runs
unconfined; ``bwrap`` and ``apptainer`` asked for by name are required: a run that asked for a
sandbox never silently runs without one.

When the runtime is root, sandboxed processes also leave root outside: they run as
``agent.sandbox_uid`` (nobody by default) and the workspace is handed to that uid. (Inside a
user namespace created by root, a "uid 65534" would still be root to the files of every bound
path: ``/etc/shadow`` would be readable.)

Every process an execution starts belongs to its ``limits.Group`` (``group``): its processes,
memory and CPU are bounded together, and it is killed whole when the execution ends. Under
bwrap, a seccomp filter (``seccomp``) refuses new user namespaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.errors import GyreError
from gyre_hpc.recipe.schema import AgentConfig
from gyre_hpc.sandbox import apptainer, bwrap, seccomp, untrusted
from gyre_hpc.sandbox.image import Image
from gyre_hpc.sandbox.image import resolve as resolve_image
from gyre_hpc.sandbox.limits import Group, Groups, Limits, choose
from gyre_hpc.sandbox.spec import Mount, ProxyReach, System, host_system, image_system, policy
from gyre_hpc.tasks.suites import private_paths
from gyre_hpc.tasks.task import Task

KINDS = ("bwrap", "apptainer", "none")
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""``PATH`` in an image (the Debian default)."""
FILE_SIZE_BYTES = 64 << 20
"""The largest file one process may write (``RLIMIT_FSIZE``)."""


@dataclass(frozen=True)
class Launch:
    """What to start: ``argv`` with ``env`` in ``cwd``, as ``user`` (uid and gid) if set."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    user: int | None = None

    def popen(self) -> dict:
        """Keyword arguments for ``subprocess.Popen`` / ``asyncio.create_subprocess_exec``."""
        kw: dict = {"env": self.env, "cwd": self.cwd}
        if self.user is not None:
            kw |= {"user": self.user, "group": self.user, "extra_groups": []}
        return kw


def bind_paths(values: list[str], key: str) -> tuple[Path, ...]:
    """A recipe's list of paths to show (``key``), resolved; one line naming any that do not exist."""
    paths = tuple(Path(v).expanduser().resolve() for v in values)
    if missing := [str(p) for p in paths if not p.exists()]:
        raise GyreError(f"{key}: {', '.join(missing)} does not exist")
    return paths


def limits_of(config: AgentConfig) -> Limits:
    """An execution's limits as the recipe sets them (``agent.*``)."""
    return Limits(
        processes=config.max_processes,
        memory_bytes=config.memory_mb << 20,
        cpus=config.cpus,
        workspace_bytes=config.workspace_mb << 20,
        workspace_entries=config.workspace_files,
        output_bytes=config.command_output_mb << 20,
    )


class Sandbox:
    """How an execution's processes start: ``kind`` (bwrap, apptainer, none), the extra read-only
    ``binds``, the ``hidden`` paths (never shown), the ``uid`` they run as when the runtime is root,
    and the ``groups`` each execution's processes are limited together in."""

    def __init__(
        self,
        kind: str = "none",
        *,
        uid: int = 65534,
        image: str = "",
        binds: tuple[Path, ...] = (),
        hidden: tuple[Path, ...] = (),
        system: System | None = None,
        groups: Groups | None = None,
        workdir: Path | None = None,
        mounts: tuple[Mount, ...] = (),
    ) -> None:
        if kind not in KINDS:
            raise GyreError(f"agent.sandbox = {kind!r}; valid: auto, {', '.join(KINDS)}")
        self.kind, self.image = kind, image
        self.binds = tuple(b.resolve() for b in binds)
        self.hidden = tuple(h.resolve() for h in hidden)
        self.uid = uid if os.getuid() == 0 else os.getuid()
        self._system = system
        self.groups = groups if groups is not None else Groups("none", Limits())
        self.workdir, self.mounts = workdir, mounts
        self._seccomp: Path | None = None
        self._paths: dict[str, str] = {}
        self._roots: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    @property
    def limits(self) -> Limits:
        return self.groups.limits

    def group(self, name: str) -> contextlib.AbstractContextManager[Group]:
        """A new group for one execution's (or one scorer run's) processes, killed and removed at
        the end of the block."""
        return self.groups.group(name)

    @property
    def seccomp(self) -> Path | None:
        """The filter bwrap installs (``sandbox.seccomp``), written on first use."""
        if self.kind == "bwrap" and (self._seccomp is None or not self._seccomp.exists()):
            self._seccomp = seccomp.write()  # again if something cleaned /tmp under a long run
        return self._seccomp

    @property
    def system(self) -> System:
        if self._system is None:
            self._system = host_system()
        return self._system

    @classmethod
    def from_config(
        cls, config: AgentConfig, hidden: tuple[Path, ...], warn: Callable[[str], None]
    ) -> Sandbox:
        """The sandbox ``config`` asks for, hiding ``hidden`` (the run directory, the task suite)."""
        binds = bind_paths(config.sandbox_binds, "agent.sandbox_binds")
        groups, note = choose(config.limits, limits_of(config))
        if note is not None:
            warn(note)
        kind = "bwrap" if config.sandbox == "auto" else config.sandbox
        box = cls(
            kind,
            uid=config.sandbox_uid,
            image=config.sandbox_image,
            binds=binds,
            hidden=hidden,
            groups=groups,
        )
        why = box.problem()
        if why is None:
            return box
        if config.sandbox == "auto":
            warn(f"agent.sandbox = auto: {why}; executions run unconfined (agent.sandbox = none)")
            return cls("none", hidden=hidden, groups=groups)
        raise GyreError(
            f"agent.sandbox = {config.sandbox}: {why}; set agent.sandbox = none to run unconfined"
        )

    def showing(self, paths: list[Path]) -> Sandbox:
        """This sandbox, also showing ``paths`` read-only, even one hidden from executions
        (``scoring.sandbox_binds``: only scorers are given those)."""
        binds = tuple(dict.fromkeys((*self.binds, *(p.resolve() for p in paths))))
        hidden = tuple(h for h in self.hidden if h not in binds)
        return self._with(binds=binds, hidden=hidden)

    def for_task(self, task: Task) -> Sandbox:
        """The sandbox ``task``'s commands run in: at its workdir, in its image, within the
        limits it names for itself (``task_limits``)."""
        box = self.at(task.workdir, image=task.image)
        limits = task_limits(box.limits, task)
        return box if limits == box.limits else box._with(groups=box.groups.limited(limits))

    def at(self, workdir: str | Path | None, mounts: tuple[Mount, ...] = (), image: str = "") -> Sandbox:
        """This sandbox with the workspace shown at ``workdir`` (a task's own working directory;
        None or empty: its host path), ``mounts`` added, and ``image`` (``sandbox.image``) as the
        system. Unconfined, nothing can be moved: the same sandbox, or for an image, one line."""
        if image and not self.confined:
            raise GyreError(f"image {image}: a task in an image of its own needs agent.sandbox = bwrap")
        if not self.confined or (not workdir and not mounts and not image):
            return self
        changes: dict[str, object] = {}
        if workdir:
            changes["workdir"] = Path(workdir)
        if mounts:
            changes["mounts"] = (*self.mounts, *mounts)
        if image:
            found = _image(image)
            if self.kind == "apptainer":
                changes["image"] = found.ref  # a root filesystem directory runs there as well
            elif found.kind != "rootfs":
                raise GyreError(f"image {image}: bwrap runs a root filesystem (a directory or tarball); "
                                "this one needs agent.sandbox = apptainer")  # fmt: skip
            else:
                changes["system"] = image_system(Path(found.ref))
        return self._with(**changes)

    @property
    def rooted(self) -> Path | None:
        """The image root filesystem bwrap runs commands in; None: the host's system."""
        return Path(self.system.root) if self.kind == "bwrap" and self.system.root else None

    def seed(self, workspace: Path) -> None:
        """Copy what the image holds at the workdir into a fresh ``workspace`` (an image's own
        project files: a Harbor task's /app), never over what is already there."""
        root = self.rooted
        if root is None or self.workdir is None:
            return
        src = root / self.workdir.relative_to("/")
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, workspace, symlinks=True, dirs_exist_ok=True,
                            copy_function=_copy_new)  # fmt: skip

    def _with(self, **changes: object) -> Sandbox:
        now = dict(uid=self.uid, image=self.image, binds=self.binds, hidden=self.hidden, groups=self.groups,
                   workdir=self.workdir, mounts=self.mounts, system=self._system)  # fmt: skip
        box = Sandbox(self.kind, **{**now, **changes})  # type: ignore[arg-type]
        box._seccomp = self._seccomp
        return box

    @property
    def confined(self) -> bool:
        return self.kind != "none"

    @property
    def owner(self) -> int | None:
        """The uid a workspace must belong to; None when its processes run as the runtime."""
        return self.uid if self.confined and os.getuid() == 0 else None

    def owner_in(self, group: Group) -> int | None:
        """The uid ``group``'s processes run as, and so own their workspace: its own uid (the
        ``uid`` limits), else ``owner``."""
        return group.uid if group.uid is not None else self.owner

    def path(self, host_path: str) -> str:
        """``PATH`` inside: the runtime's interpreter first (``python`` is the one with the runtime's
        packages), then the host's entries the sandbox shows; in an image, the image's own."""
        if self.rooted is not None:
            return IMAGE_PATH
        if host_path not in self._paths:
            entries = [str(Path(sys.executable).parent)]
            entries += [e for e in host_path.split(":") if e and self.shows(Path(e)) and e not in entries]
            self._paths[host_path] = ":".join(entries)
        return self._paths[host_path]

    def shows(self, path: Path) -> bool:
        """Whether a bwrap sandbox sees ``path`` (read-only): under the system or a bind, not hidden."""
        if self._roots is None:  # strings: this is asked for every PATH entry of every launch
            roots = [*self.system.dirs, *(link for link, _ in self.system.links), *map(str, self.binds)]
            self._roots = (tuple(roots), tuple(map(str, self.hidden)))
        shown, hidden = self._roots
        p = os.path.abspath(path)

        def under(root: str) -> bool:
            return p == root or p.startswith(root.rstrip("/") + "/")

        return any(map(under, shown)) and not any(map(under, hidden))

    def prepare(self, workspace: Path, group: Group | None = None) -> None:
        """Hand ``workspace`` (and all in it) to the uid the sandbox's processes (``group``'s, if
        given) run as, so that its commands may write it. Never through a link: a workspace the
        policy wrote may link to /etc."""
        uid = self.owner if group is None else self.owner_in(group)
        if uid is not None and workspace.exists():
            untrusted.own_tree(workspace, uid)

    def launch(
        self,
        workspace: Path,
        command: list[str],
        env: dict[str, str],
        proxy: ProxyReach | None = None,
        *,
        group: Group,
        cpu_s: int,
    ) -> Launch:
        """How to start ``command`` in ``workspace`` as one of ``group``'s processes, with at most
        ``cpu_s`` seconds of CPU."""
        head = [*group.prefix(str(self.seccomp or "/dev/null")), *group.rlimits(cpu_s, FILE_SIZE_BYTES)]
        uid = self.owner_in(group)
        if not self.confined:
            as_user = group.uid if group.uid is not None else None  # a uid of its own, or the runtime's
            return Launch([*head, *command], env, workspace, as_user)
        p = policy(workspace, uid=uid if uid is not None else self.uid, binds=self.binds, hidden=self.hidden,
                   proxy=proxy, workdir=self.workdir, mounts=self.mounts)  # fmt: skip
        # Variables naming the workspace name it as its processes see it.
        env = {k: str(p.inside) if v == str(workspace) else v for k, v in env.items()}
        env = {**env, "TMPDIR": "/tmp"}  # its own, private
        if self.kind == "bwrap":
            env["PATH"] = self.path(env.get("PATH", ""))
            privileged = os.getuid() == 0  # then bwrap drops to the uid itself, after mounting
            fd = bwrap.SECCOMP_FD if self.seccomp is not None else None
            python = sys.executable if self.rooted is None else "python3"  # the relay's: the image's own
            inner = bwrap.argv(p, command, self.system, python, privileged, fd)
            return Launch([*head, *inner], env, workspace)
        host = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")}
        inner_env = {f"APPTAINERENV_{k}": v for k, v in env.items() if k not in ("HOME", "PATH")}
        return Launch([*head, *apptainer.argv(p, self.image, command)], host | inner_env, workspace, uid)

    def problem(self) -> str | None:
        """Why this sandbox cannot run here; None if a probe command ran in it."""
        if self.kind == "none":
            return None
        tool = "bwrap" if self.kind == "bwrap" else "apptainer"
        if shutil.which(tool) is None:
            return f"{tool} is not installed" + (
                " (Debian: apt-get install bubblewrap)" if tool == "bwrap" else ""
            )
        if self.kind == "apptainer" and not self.image:
            return "agent.sandbox_image is empty (a .sif path or docker://…)"
        with tempfile.TemporaryDirectory(prefix="gyre-sandbox-check-") as tmp, self.group("probe") as group:
            self.prepare(Path(tmp), group)
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            launch = self.launch(Path(tmp), ["true"], env, group=group, cpu_s=60)
            try:
                proc = subprocess.run(
                    launch.argv, capture_output=True, text=True, timeout=120, **launch.popen()
                )
            except (OSError, subprocess.TimeoutExpired) as err:
                return f"{tool} did not run: {err}"
        if proc.returncode:
            last = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
            return f"{tool} failed: {last[0]}"
        return None


def task_limits(limits: Limits, task: Task) -> Limits:
    """``limits`` (``agent.*``) with what ``task`` names for itself instead: a Harbor task's
    ``[environment]`` cpus, memory (the group's memory) and storage (its workspace's bytes). The
    task file is the user's, not the policy's, so its values replace the recipe's either way."""
    own = {
        "cpus": task.harbor.get("cpus"),
        "memory_bytes": (task.harbor.get("memory_mb") or 0) << 20,
        "workspace_bytes": (task.harbor.get("storage_mb") or 0) << 20,
    }
    return dataclasses.replace(limits, **{k: v for k, v in own.items() if v})


def _copy_new(src: str, dst: str) -> None:
    if not os.path.lexists(dst):
        shutil.copy2(src, dst)


@functools.cache
def _image(ref: str) -> Image:
    return resolve_image(ref)


UNCONFINED = Sandbox("none")
"""Processes run as the runtime's user, in the workspace (tests, and ``agent.sandbox = none``)."""


def for_run(
    config: AgentConfig,
    run_dir: Path | None,
    suite: str,
    warn: Callable[[str], None],
    scoring_binds: list[str] | None = None,
) -> Sandbox:
    """The run's sandbox. It hides the run directory, a JSONL task suite with its hidden tests'
    directories, and ``scoring_binds`` (``scoring.sandbox_binds``, which only scorers see)."""
    hidden = [run_dir] if run_dir is not None else []
    hidden += [*private_paths(suite), *bind_paths(scoring_binds or [], "scoring.sandbox_binds")]
    return Sandbox.from_config(config, tuple(hidden), warn)
