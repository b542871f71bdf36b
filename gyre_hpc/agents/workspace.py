"""An execution's workspace: file access confined to it, shell commands sandboxed with limits.

File tools resolve every path inside the workspace (symlinks included), refuse anything that
leaves it, and open only regular files, without blocking (a FIFO the policy made is refused, not
waited on) and reading a bounded amount. Shell commands run in the run's sandbox
(``gyre_hpc.sandbox``: nothing of the host but a read-only system and this workspace, no
network, no other process), with the workspace as working and home directory, a scrubbed
environment, in the execution's limits group (processes, memory and CPU bounded together), with
their output streamed and cut, the workspace's quota watched, and the whole group killed at the
time limit (``sandbox.supervise``). Under ``agent.sandbox = none`` only the limits remain: a
shell is not a security boundary.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.sandbox import supervise, untrusted
from gyre_hpc.sandbox.confine import UNCONFINED, Sandbox
from gyre_hpc.sandbox.limits import Group


class ToolError(Exception):
    """A tool call that cannot be carried out; its message goes back to the model."""


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    output: str
    timed_out: bool
    killed: str = ""
    """Why it was killed before it ended ("" if it ended by itself): time limit, quota, output."""


class Workspace:
    def __init__(
        self,
        root: Path,
        sandbox: Sandbox = UNCONFINED,
        max_read_bytes: int = 64_000,
        max_output_bytes: int = 16_000,
        group: Group | None = None,
    ) -> None:
        self.root = root.resolve()
        self.sandbox = sandbox
        self.max_read = max_read_bytes
        self.max_output = max_output_bytes
        self.group = group
        """The execution's limits group; None: each command gets one of its own."""
        self._over: untrusted.Usage | None = None

    def path(self, rel: str) -> Path:
        if not isinstance(rel, str) or not rel:
            raise ToolError("path must be a non-empty string")
        if len(rel) > 4000:  # a path the kernel could not open anyway
            raise ToolError(f"{rel[:80]!r}… is longer than 4000 characters")
        p = (self.root / rel).resolve()
        if not p.is_relative_to(self.root):
            raise ToolError(f"{rel!r} is outside the workspace")
        return p

    def read(self, rel: str) -> str:
        p = self.path(rel)
        try:
            fd = untrusted.open_regular(p, os.O_RDONLY)
        except OSError:
            raise ToolError(f"{rel} is not a file") from None
        try:
            data = untrusted.read_fd(fd, self.max_read) or b""
        finally:
            os.close(fd)
        return data.decode(errors="replace")

    def write(self, rel: str, content: str) -> str:
        p = self.path(rel)
        new = [d for d in (p.parent, *p.parent.parents) if d.is_relative_to(self.root) and not d.exists()]
        try:
            for d in reversed(new):  # one level at a time: Path.mkdir(parents=True) recurses
                d.mkdir(exist_ok=True)
            fd = untrusted.open_regular(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except OSError as err:
            raise ToolError(f"{rel} cannot be written: {err.strerror or err}") from None
        with os.fdopen(fd, "wb") as fh:
            fh.write(content.encode())
        owner = self.sandbox.owner if self.group is None else self.sandbox.owner_in(self.group)
        if owner is not None:  # the sandbox's commands may edit what a tool wrote
            for q in (p, *new):
                os.chown(q, owner, owner, follow_symlinks=False)
        return f"wrote {len(content.encode())} bytes to {rel}"

    def listing(self, rel: str = ".") -> str:
        p = self.path(rel)
        if not p.is_dir():
            raise ToolError(f"{rel} is not a directory")
        entries = [
            e.rel + ("/" if e.kind == "dir" else "")
            for e in untrusted.walk(p, max_entries=5000)
            if ".git" not in e.rel.split("/") and "__pycache__" not in e.rel.split("/")
        ]
        prefix = "" if p == self.root else f"{p.relative_to(self.root)}/"
        return "\n".join(sorted(prefix + e for e in entries)[:500]) or "(empty)"

    def run(self, command: str, timeout_s: float) -> CommandResult:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "LANG": "C.UTF-8",
            "TMPDIR": str(self.root),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        limits = self.sandbox.limits
        own = contextlib.nullcontext(self.group) if self.group is not None else self.sandbox.group("command")
        with own as group:
            launch = self.sandbox.launch(
                self.root, ["bash", "-c", command], env, group=group, cpu_s=int(timeout_s) + 1
            )
            # Over its quota already (it went over in an earlier command): it may shrink, not grow.
            over = self._over
            quota = supervise.Quota(
                self.root,
                max(limits.workspace_entries, over.entries if over else 0),
                max(limits.workspace_bytes, over.bytes if over else 0),
            )
            done = supervise.run(
                launch.argv, launch.popen(), group=group, timeout_s=timeout_s,
                keep_bytes=self.max_output, quota=quota,
            )  # fmt: skip
            # Counted well past the quota: what it holds is how far its next command may not grow it.
            use = untrusted.usage(self.root, 16 * limits.workspace_entries, 16 * limits.workspace_bytes)
        why = use.over(limits.workspace_entries, limits.workspace_bytes)
        self._over = use if why else None
        text = done.output.decode(errors="replace")
        if why and not done.killed:
            text += f"\n[the workspace is over its quota: {why}; delete files]\n"
        return CommandResult(done.exit_code, text, done.timed_out, done.killed)
