"""The seccomp filter bwrap installs before a sandboxed command runs: no new user namespaces.

Inside a sandbox the policy has no capabilities, but on a kernel that lets anyone create a user
namespace, ``unshare -r`` would hand it a namespace in which it holds them all: mounts of its
own, a root to attack kernel code that only root can reach. The filter refuses that and lets
everything else through:

```
 arch is not the host's             ─▶ EPERM   (the 32-bit and x32 entry points: no way around)
 clone3                             ─▶ ENOSYS  (its flags are in memory a filter cannot read; libc
                                                falls back to clone, which the filter can check)
 unshare / clone with CLONE_NEWUSER ─▶ EPERM
 anything else                      ─▶ allowed
```

``program`` is a pure function of the architecture (golden-tested); ``write`` puts it in a file,
named by its content, that bwrap reads on fd 9 (``limits.JOIN`` opens it). Only x86_64 and aarch64 are
known; elsewhere there is no filter, and ``problem`` says so.
"""

from __future__ import annotations

import hashlib
import os
import platform
import struct
import tempfile
from pathlib import Path

CLONE_NEWUSER = 0x10000000
EPERM, ENOSYS = 1, 38
# seccomp_data: nr (u32) at 0, arch (u32) at 4, args[0] at 16 (its low half on little-endian hosts)
NR, ARCH, ARG0 = 0, 4, 16
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
ALLOW, ERRNO = 0x7FFF0000, 0x00050000
X32_BIT = 0x40000000
ARCHES = {
    # machine: (AUDIT_ARCH_*, unshare, clone, clone3)
    "x86_64": (0xC000003E, 272, 56, 435),
    "aarch64": (0xC00000B7, 97, 220, 435),
}


def program(machine: str) -> bytes:
    """The filter as ``struct sock_filter`` records (what bwrap's ``--seccomp`` reads)."""
    arch, unshare, clone, clone3 = ARCHES[machine]
    ins = [
        (LD_ABS, 0, 0, ARCH),
        (JEQ, 1, 0, arch),
        (RET, 0, 0, ERRNO | EPERM),  # another architecture's entry point
        (LD_ABS, 0, 0, NR),
        (JGE, 0, 1, X32_BIT),
        (RET, 0, 0, ERRNO | EPERM),  # x32 numbers
        (JEQ, 0, 1, clone3),
        (RET, 0, 0, ERRNO | ENOSYS),
        (JEQ, 1, 0, unshare),
        (JEQ, 0, 3, clone),
        (LD_ABS, 0, 0, ARG0),
        (JSET, 0, 1, CLONE_NEWUSER),
        (RET, 0, 0, ERRNO | EPERM),
        (RET, 0, 0, ALLOW),
    ]
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


def problem() -> str | None:
    """Why there is no filter on this machine, or None."""
    machine = platform.machine()
    return None if machine in ARCHES else f"no seccomp filter for {machine} (known: {', '.join(ARCHES)})"


def write(directory: Path | None = None) -> Path | None:
    """The file holding this machine's filter, named by its content (written once, then shared by
    every run on the machine); None where there is none."""
    if problem() is not None:
        return None
    data = program(platform.machine())
    where = Path(directory or tempfile.gettempdir())
    path = where / f"gyre-seccomp-{hashlib.sha256(data).hexdigest()[:16]}.bpf"
    if not path.exists() or path.read_bytes() != data:
        fd, tmp = tempfile.mkstemp(prefix=".gyre-seccomp-", dir=where)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # whole or absent, whoever else writes it at the same time
    return path
