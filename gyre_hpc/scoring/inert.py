"""A scorer's copy is data, never configuration: what a tool run by a scorer would otherwise read
from the copy, and how each is turned off.

```
 tool        reads as configuration                      neutralised by
 any         $HOME/…  (HOME was the copy)               HOME = an empty read-only directory of
                                                         the session's, XDG_CONFIG_HOME under it
 python      user site  (~/.local/…/site-packages,       PYTHONNOUSERSITE=1 (and HOME not the copy)
             its .pth files run at start)
 python -c   the current directory first on sys.path     PYTHONSAFEPATH=1: a workspace json.py does
             (a workspace json.py shadows the stdlib)    not shadow `import json`
 git         .git/config (core.fsmonitor, core.pager,    every .git directory of the copy keeps its
             filter drivers, aliases: commands), hooks,  objects and refs; its config is rewritten
             a .git file pointing elsewhere              to the repository format alone, hooks/ and
                                                         info/ emptied; a .git that is not a
                                                         directory goes; no system or global config;
                                                         no discovery above the copy
 pytest      conftest.py, ini files, plugins             the test bench's own ini, --noconftest,
                                                         no plugin autoload (scoring.pytest_run,
                                                         VERIFIER_ENV)
```

What it does not know: which tools a task's verifier runs beyond these. A tool that reads its
configuration from the current directory by design (make's Makefile, npm's package.json scripts)
runs what the workspace says, in the sandbox: that is running the workspace's code, which a
verdict must not trust (ARCHITECTURE §5, per scorer kind).
"""

from __future__ import annotations

import configparser
import os
from pathlib import Path

from gyre_hpc.sandbox import untrusted

ENV = {
    "PYTHONNOUSERSITE": "1",
    "PYTHONSAFEPATH": "1",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
}
"""Set for every run of a scorer (with ``environment``)."""


def environment(home: Path, copy: Path) -> dict[str, str]:
    """The variables a scorer's run gets beside ``ENV``: a home outside the copy, and git kept
    from looking for a repository above the copy."""
    return {
        **ENV,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "GIT_CEILING_DIRECTORIES": str(copy.parent),
    }


def scrub(copy: Path, owner: int | None = None) -> list[str]:
    """Make every version-control directory in ``copy`` (a fresh copy nothing runs in yet) data
    only; the paths changed, for reasons."""
    changed = []
    for e in list(untrusted.walk(copy)):
        if e.rel.rsplit("/", 1)[-1] != ".git":
            continue
        if e.kind != "dir":  # a gitdir pointer (or a link) to a repository the copy does not hold
            untrusted.place(copy, e.rel, None)
            changed.append(e.rel)
            continue
        config = untrusted.read(copy, f"{e.rel}/config", 1 << 20)
        untrusted.place(copy, f"{e.rel}/config", _format_only(config), owner)
        for sub in ("hooks", "info"):
            untrusted.remove(copy / e.rel / sub)
        changed.append(e.rel)
    return changed


def _format_only(config: bytes | None) -> bytes:
    """A repository config holding only what git needs to read the repository: its format
    version and format extensions (the object format of a SHA-256 repository)."""
    parser = configparser.RawConfigParser(strict=False, interpolation=None, allow_no_value=True)
    try:
        parser.read_string((config or b"").decode(errors="replace"))
    except configparser.Error:
        parser = configparser.RawConfigParser()
    version = parser.get("core", "repositoryformatversion", fallback="0").strip()
    version = version if version in ("0", "1") else "0"
    lines = ["[core]", f"\trepositoryformatversion = {version}", "\tbare = false"]
    if version == "1" and parser.has_section("extensions"):
        fmt = parser.get("extensions", "objectformat", fallback="").strip().lower()
        if fmt in ("sha1", "sha256"):
            lines += ["[extensions]", f"\tobjectformat = {fmt}"]
    return ("\n".join(lines) + "\n").encode()


def home(session_dir: Path) -> Path:
    """The empty home every run of a session is given (shown read-only to the sandbox)."""
    path = session_dir / "home"
    path.mkdir(mode=0o755, exist_ok=True)
    os.chmod(path, 0o755)
    return path
