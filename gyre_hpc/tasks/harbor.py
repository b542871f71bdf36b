"""Harbor task directories (Harbor / terminal-bench), read as tasks.

```
 hello-file/
   instruction.md        the task's spec, as the agent reads it
   task.toml             [agent] timeout_sec · [verifier] timeout_sec · [environment] cpus,
                         memory / memory_mb, storage / storage_mb, allow_internet, docker_image
   environment/          Dockerfile: its WORKDIR is where the workspace appears (default /app);
                         its COPY of the task's own files into that directory seeds the workspace
   tests/test.sh         the verifier: writes /logs/verifier/reward.txt (or reward.json)
   solution/solve.sh     the reference solution (optional)
```

A suite path that is a task directory is one task; a directory of task directories is a
dataset (each subdirectory with a ``task.toml``). The whole directory is hidden from executions
(``suites.private_paths``): the agent sees its instruction and its workspace, never the tests.

What it does not know: how to build an image. A Dockerfile's RUN lines, and files it copies
anywhere but the workdir, need the prebuilt image (``[environment] docker_image``); without
one the task runs on the sandbox's own system, and ``notes`` says so (``gyre-hpc tasks check``).
Scoring is ``scoring.harbor``; the sandbox applies cpus, memory and storage
(``sandbox.confine.task_limits``).
"""

from __future__ import annotations

import math
import re
import shlex
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gyre_hpc.errors import GyreError
from gyre_hpc.tasks.task import TASK_ID, Task, check_workdir, image_path

WORKDIR = "/app"
"""Where a Harbor task's workspace appears when its Dockerfile names no WORKDIR."""
SECTIONS: dict[str, tuple[str, ...] | None] = {
    "metadata": None,  # anything: the task author's
    "task": None,
    "agent": ("timeout_sec", "user"),
    "verifier": ("timeout_sec", "env", "user"),
    "environment": (
        "build_timeout_sec",
        "cpus",
        "memory",
        "memory_mb",
        "storage",
        "storage_mb",
        "gpus",
        "allow_internet",
        "docker_image",
        "env",
    ),  # fmt: skip
    "solution": ("env",),
}
TOP = ("version", "schema_version", "source", "split", "artifacts")
SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", re.IGNORECASE)


@dataclass(frozen=True)
class HarborParts:
    """What a Harbor task carries besides the common record."""

    tests: str
    """The task's ``tests/`` (host path): shown to the verifier only, at ``/tests``."""
    solution: str = ""
    """Its ``solution/`` (host path), if any: ``solve.sh`` there is the reference solution."""
    verifier_timeout_s: float | None = None
    image: str = ""
    """``[environment] docker_image``: the prebuilt image (also the task's ``image``)."""
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    allow_internet: bool = False
    verifier_env: dict[str, str] = field(default_factory=dict)


def is_task(path: Path) -> bool:
    return (path / "task.toml").is_file()


def load_dir(path: str | Path) -> list[Task]:
    """The tasks of a Harbor task directory or dataset directory, in name order."""
    return [read_task(d)[0] for d in task_dirs(Path(path))]


def task_dirs(path: Path) -> list[Path]:
    if is_task(path):
        return [path]
    dirs = sorted(d for d in path.iterdir() if d.is_dir() and is_task(d)) if path.is_dir() else []
    if not dirs:
        raise GyreError(f"{path}: no task.toml in it or in its subdirectories (not a Harbor task or dataset)")
    return dirs


def read_task(root: Path) -> tuple[Task, list[str]]:
    """One Harbor task, and notes on what of it does not run as written here (one line each)."""
    root = root.resolve()
    if not TASK_ID.fullmatch(root.name):
        raise GyreError(f"{root}: a task directory's name is its id: letters, digits and ._- (at most 96)")
    spec = _text(root / "instruction.md")
    config = _toml(root / "task.toml")
    tests = root / "tests"
    if not (tests / "test.sh").is_file():
        raise GyreError(f"{tests / 'test.sh'}: missing (a Harbor task's verifier)")
    where = root / "task.toml"
    agent, verifier, env = (config.get(k, {}) for k in ("agent", "verifier", "environment"))
    notes: list[str] = []
    workdir, seed = _dockerfile(root / "environment", notes)
    image = image_path(_str(env, "docker_image", where, "environment"), root)
    if notes and image:
        notes = [f"{n} (run here without the image {image!r}, which has them)" for n in notes]
    if not image:
        notes.append("no [environment] docker_image: it runs on the sandbox's own system")
    allow = env.get("allow_internet", False)
    if not isinstance(allow, bool):
        raise GyreError(f"{where}: environment.allow_internet must be true or false")
    if allow:
        notes.append("allow_internet = true: executions here reach the model's proxy and nothing else")
    solution = root / "solution"
    parts = HarborParts(
        tests=str(tests),
        solution=str(solution) if (solution / "solve.sh").is_file() else "",
        verifier_timeout_s=_seconds(verifier, where, "verifier"),
        image=image,
        cpus=_positive(env, "cpus", where),
        memory_mb=_megabytes(env, "memory", where),
        storage_mb=_megabytes(env, "storage", where),
        allow_internet=allow,
        verifier_env={str(k): str(v) for k, v in _table(verifier, "env", where).items()},
    )
    task = Task(
        id=root.name, spec=spec, scorer="harbor", seed=seed, timeout_s=_seconds(agent, where, "agent"),
        workdir=workdir, image=image, format="harbor", harbor=asdict(parts),
    )  # fmt: skip
    return task, notes


def _text(path: Path) -> str:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise GyreError(f"{path}: missing (a Harbor task's instruction)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise GyreError(f"{path}: not readable ({type(err).__name__})") from None
    if not text.strip():
        raise GyreError(f"{path}: empty (the instruction is what the agent is asked)")
    return text


def _toml(path: Path) -> dict[str, Any]:
    try:
        config = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise GyreError(f"{path}: not TOML ({err})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise GyreError(f"{path}: not readable ({type(err).__name__})") from None
    for key, value in config.items():
        if key in TOP:
            continue
        if key not in SECTIONS:
            valid = ", ".join([*TOP, *(f"[{s}]" for s in SECTIONS)])
            raise GyreError(f"{path}: unknown key {key}; valid: {valid}")
        if not isinstance(value, dict):
            raise GyreError(f"{path}: {key} must be a table ([{key}])")
        known = SECTIONS[key]
        if known is not None and (unknown := sorted(set(value) - set(known))):
            raise GyreError(
                f"{path}: unknown key {key}.{unknown[0]}; valid keys of [{key}]: {', '.join(known)}"
            )
    return config


def _str(table: dict[str, Any], key: str, where: Path, section: str) -> str:
    value = table.get(key, "")
    if not isinstance(value, str):
        raise GyreError(f"{where}: {section}.{key} must be a string")
    return value


def _table(table: dict[str, Any], key: str, where: Path) -> dict[str, Any]:
    value = table.get(key, {})
    if not isinstance(value, dict):
        raise GyreError(f"{where}: {key} must be a table of strings")
    return value


def _number(table: dict[str, Any], key: str, where: Path, section: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise GyreError(f"{where}: {section}.{key} = {value!r}: a positive number")
    return float(value)


def _seconds(table: dict[str, Any], where: Path, section: str) -> float | None:
    return _number(table, "timeout_sec", where, section)


def _positive(table: dict[str, Any], key: str, where: Path) -> float | None:
    return _number(table, key, where, "environment")


def _megabytes(table: dict[str, Any], key: str, where: Path) -> int | None:
    """``memory = "4G"`` or ``memory_mb = 4096`` (likewise storage), in MB."""
    if (mb := _number(table, f"{key}_mb", where, "environment")) is not None:
        return int(mb)
    value = table.get(key)
    if value is None:
        return None
    m = SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if m is None:
        raise GyreError(f'{where}: environment.{key} = {value!r}: a size such as "4G" or "512M"')
    scale = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}[m.group(2).upper()]
    return max(1, int(float(m.group(1)) * scale))


def _dockerfile(environment: Path, notes: list[str]) -> tuple[str, dict[str, str]]:
    """The workdir a Dockerfile sets, and the workspace seed its COPY lines put there (files of
    the build context, ``environment/``); what it does that cannot be done here goes to ``notes``."""
    path = environment / "Dockerfile"
    if not path.is_file():
        return WORKDIR, {}
    workdir, seed = WORKDIR, {}
    text = path.read_text(errors="replace").replace("\\\n", " ")
    for n, line in enumerate(text.splitlines(), 1):
        words = line.strip()
        if not words or words.startswith("#"):
            continue
        op, _, rest = words.partition(" ")
        op = op.upper()
        at = f"{path}:{n}"
        if op == "WORKDIR":
            target = rest.strip()
            workdir = target if target.startswith("/") else f"{workdir.rstrip('/')}/{target}"
            check_workdir(workdir, f"{at}: WORKDIR")
        elif op in ("COPY", "ADD"):
            args = [a for a in shlex.split(rest) if not a.startswith("--")]
            if len(args) < 2:
                raise GyreError(f"{at}: {op} needs a source and a destination")
            *sources, dest = args
            seed |= _copied(environment, sources, dest, workdir, at, notes)
        elif op == "RUN":
            notes.append(f"{at}: RUN is not run here")
        elif op not in ("FROM", "ENV", "ARG", "LABEL", "USER", "CMD", "ENTRYPOINT", "SHELL", "EXPOSE"):
            notes.append(f"{at}: {op} is not applied here")
    return workdir, seed


def _copied(
    context: Path, sources: list[str], dest: str, workdir: str, at: str, notes: list[str]
) -> dict[str, str]:
    target = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
    inside = Path(target).is_relative_to(workdir)
    out: dict[str, str] = {}
    for src in sources:
        if "://" in src:
            notes.append(f"{at}: {src} is not fetched here")
            continue
        local = (context / src).resolve()
        if not local.is_relative_to(context.resolve()) or not local.exists():
            raise GyreError(f"{at}: {src} is not a file of the build context {context}")
        if not inside:
            notes.append(f"{at}: {src} goes to {target}, outside the workdir {workdir}: not copied here")
            continue
        rel = Path(target).relative_to(workdir)
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for f in files:
            into = rel / f.relative_to(local) if local.is_dir() else (
                rel / f.name if dest.endswith("/") or len(sources) > 1 else rel
            )  # fmt: skip
            try:
                out[str(into) if str(into) != "." else f.name] = f.read_text()
            except UnicodeDecodeError:
                raise GyreError(f"{at}: {f} is not text (a seed file is text here)") from None
    return out
