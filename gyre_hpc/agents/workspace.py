"""An execution's workspace: file access confined to it, shell commands sandboxed with limits.

File tools resolve every path inside the workspace (symlinks included) and refuse anything
that leaves it. Shell commands run in the run's sandbox (``gyre_hpc.sandbox``: nothing of the
host but a read-only system and this workspace, no network, no other process), with the
workspace as working and home directory, a scrubbed environment, CPU/memory/file-size limits,
in their own process group, and are killed with the whole group at their timeout. Under
``agent.sandbox = none`` only the limits remain: a shell is not a security boundary.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.sandbox.confine import UNCONFINED, Sandbox

FILE_SIZE_BYTES = 64 << 20
"""The largest file one command may write."""


def limits(cpu_s: int, memory_bytes: int) -> list[str]:
    """The command's CPU, memory and file-size limits, set by ``prlimit`` (util-linux) as the
    first program it execs.

    Not by ``preexec_fn``: Python code between fork and exec makes CPython fork the whole
    runtime instead of vfork-ing it, and that fork's cost grows with the runtime's memory
    (measured: 24 ms a command from a process of 300 MB, against 2 ms; ``tools/bench_sandbox.py``).
    """
    return ["prlimit", f"--cpu={cpu_s}", f"--as={memory_bytes}", f"--fsize={FILE_SIZE_BYTES}", "--"]


class ToolError(Exception):
    """A tool call that cannot be carried out; its message goes back to the model."""


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    output: str
    timed_out: bool


class Workspace:
    def __init__(
        self,
        root: Path,
        sandbox: Sandbox = UNCONFINED,
        max_read_bytes: int = 64_000,
        max_output_bytes: int = 16_000,
    ) -> None:
        self.root = root.resolve()
        self.sandbox = sandbox
        self.max_read = max_read_bytes
        self.max_output = max_output_bytes

    def path(self, rel: str) -> Path:
        if not isinstance(rel, str) or not rel:
            raise ToolError("path must be a non-empty string")
        p = (self.root / rel).resolve()
        if not p.is_relative_to(self.root):
            raise ToolError(f"{rel!r} is outside the workspace")
        return p

    def read(self, rel: str) -> str:
        p = self.path(rel)
        if not p.is_file():
            raise ToolError(f"{rel} is not a file")
        data = p.read_bytes()[: self.max_read]
        return data.decode(errors="replace")

    def write(self, rel: str, content: str) -> str:
        p = self.path(rel)
        new = [d for d in (p.parent, *p.parent.parents) if d.is_relative_to(self.root) and not d.exists()]
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        if (owner := self.sandbox.owner) is not None:  # the sandbox's commands may edit what a tool wrote
            for q in (p, *new):
                os.chown(q, owner, owner)
        return f"wrote {len(content.encode())} bytes to {rel}"

    def listing(self, rel: str = ".") -> str:
        p = self.path(rel)
        if not p.is_dir():
            raise ToolError(f"{rel} is not a directory")
        entries = sorted(
            str(q.relative_to(self.root)) + ("/" if q.is_dir() else "")
            for q in p.rglob("*")
            if ".git" not in q.parts and "__pycache__" not in q.parts
        )
        return "\n".join(entries[:500]) or "(empty)"

    def run(self, command: str, timeout_s: float, memory_bytes: int = 2 << 30) -> CommandResult:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "LANG": "C.UTF-8",
            "TMPDIR": str(self.root),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        launch = self.sandbox.launch(self.root, ["bash", "-c", command], env)
        proc = subprocess.Popen(
            [*limits(int(timeout_s) + 1, memory_bytes), *launch.argv],
            **launch.popen(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the command and everything it started
            out, _ = proc.communicate()
            timed_out = True
        text = out[: self.max_output].decode(errors="replace")
        return CommandResult(-9 if timed_out else proc.returncode, text, timed_out)
