"""The run's sandbox: the backend ``agent.sandbox`` names, checked once, turning commands into launches.

``auto`` takes bwrap where a probe sandbox runs, and otherwise says why in one line and runs
unconfined; ``bwrap`` and ``apptainer`` asked for by name are required: a run that asked for a
sandbox never silently runs without one.

When the runtime is root, sandboxed processes also leave root outside: they run as
``agent.sandbox_uid`` (nobody by default) and the workspace is handed to that uid. (Inside a
user namespace created by root, a "uid 65534" would still be root to the files of every bound
path: ``/etc/shadow`` would be readable.)
"""

from __future__ import annotations

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
from gyre_hpc.sandbox import apptainer, bwrap
from gyre_hpc.sandbox.policy import ProxyReach, System, host_system, policy
from gyre_hpc.tasks.task import private_paths

KINDS = ("bwrap", "apptainer", "none")


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


class Sandbox:
    """How an execution's processes start: ``kind`` (bwrap, apptainer, none), the extra read-only
    ``binds``, the ``hidden`` paths (never shown), the ``uid`` they run as when the runtime is root."""

    def __init__(
        self,
        kind: str = "none",
        *,
        uid: int = 65534,
        image: str = "",
        binds: tuple[Path, ...] = (),
        hidden: tuple[Path, ...] = (),
        system: System | None = None,
    ) -> None:
        if kind not in KINDS:
            raise GyreError(f"agent.sandbox = {kind!r}; valid: auto, {', '.join(KINDS)}")
        self.kind, self.image = kind, image
        self.binds = tuple(b.resolve() for b in binds)
        self.hidden = tuple(h.resolve() for h in hidden)
        self.uid = uid if os.getuid() == 0 else os.getuid()
        self._system = system

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
        kind = "bwrap" if config.sandbox == "auto" else config.sandbox
        box = cls(kind, uid=config.sandbox_uid, image=config.sandbox_image, binds=binds, hidden=hidden)
        why = box.problem()
        if why is None:
            return box
        if config.sandbox == "auto":
            warn(f"agent.sandbox = auto: {why}; executions run unconfined (agent.sandbox = none)")
            return cls("none", hidden=hidden)
        raise GyreError(
            f"agent.sandbox = {config.sandbox}: {why}; set agent.sandbox = none to run unconfined"
        )

    def showing(self, paths: list[Path]) -> Sandbox:
        """This sandbox, also showing ``paths`` read-only, even one hidden from executions
        (``scoring.sandbox_binds``: only scorers are given those)."""
        binds = tuple(dict.fromkeys((*self.binds, *(p.resolve() for p in paths))))
        hidden = tuple(h for h in self.hidden if h not in binds)
        box = Sandbox(self.kind, uid=self.uid, image=self.image, binds=binds, hidden=hidden)
        box._system = self._system
        return box

    @property
    def confined(self) -> bool:
        return self.kind != "none"

    @property
    def owner(self) -> int | None:
        """The uid a workspace must belong to; None when its processes run as the runtime."""
        return self.uid if self.confined and os.getuid() == 0 else None

    def path(self, host_path: str) -> str:
        """``PATH`` inside: the runtime's interpreter first (``python`` is the one with the runtime's
        packages), then the host's entries the sandbox shows."""
        entries = [str(Path(sys.executable).parent)]
        entries += [e for e in host_path.split(":") if e and self.shows(Path(e)) and e not in entries]
        return ":".join(entries)

    def shows(self, path: Path) -> bool:
        """Whether a bwrap sandbox sees ``path`` (read-only): under the system or a bind, not hidden."""
        roots = [*map(Path, self.system.dirs), *(Path(link) for link, _ in self.system.links), *self.binds]
        p = path.absolute()
        return any(p.is_relative_to(r) for r in roots) and not any(p.is_relative_to(h) for h in self.hidden)

    def prepare(self, workspace: Path) -> None:
        """Hand ``workspace`` (and all in it) to the sandbox's uid, so that its commands may write it."""
        if (uid := self.owner) is None or not workspace.exists():
            return
        os.chown(workspace, uid, uid)
        # Never through a link: a workspace the policy wrote may link to /etc.
        for root, dirs, files in os.walk(workspace, followlinks=False):
            for name in (*dirs, *files):
                os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)

    def launch(
        self, workspace: Path, command: list[str], env: dict[str, str], proxy: ProxyReach | None = None
    ) -> Launch:
        """How to start ``command`` in ``workspace`` as an execution's process."""
        if not self.confined:
            return Launch(command, env, workspace)
        p = policy(workspace, uid=self.uid, binds=self.binds, hidden=self.hidden, proxy=proxy)
        env = {**env, "TMPDIR": "/tmp"}  # its own, private
        if self.kind == "bwrap":
            env["PATH"] = self.path(env.get("PATH", ""))
            privileged = os.getuid() == 0  # then bwrap drops to the uid itself, after mounting
            return Launch(bwrap.argv(p, command, self.system, sys.executable, privileged), env, workspace)
        host = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")}
        inner = {f"APPTAINERENV_{k}": v for k, v in env.items() if k not in ("HOME", "PATH")}
        return Launch(apptainer.argv(p, self.image, command), host | inner, workspace, self.owner)

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
        with tempfile.TemporaryDirectory(prefix="gyre-sandbox-check-") as tmp:
            self.prepare(Path(tmp))
            launch = self.launch(Path(tmp), ["true"], {"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
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
