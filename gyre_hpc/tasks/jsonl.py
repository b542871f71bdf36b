"""Suite files: JSONL, one task per line (``tasks.task``) or one SWE-bench-style instance
(``tasks.swe``, a line with ``instance_id``), told apart line by line.

What it does not know: Harbor task directories (``tasks.harbor``) and the built-in suites
(``tasks.suites``, which picks the reader for a suite name).
"""

from __future__ import annotations

import json
from pathlib import Path

from gyre_hpc.errors import GyreError
from gyre_hpc.tasks import swe
from gyre_hpc.tasks.task import Task, task_from_json


def load_jsonl(path: str | Path) -> list[Task]:
    path = Path(path)
    tasks = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise GyreError(f"{path}: no such task suite") from None
    except IsADirectoryError:
        raise GyreError(f"{path}: a directory, not a task suite (a JSONL file, one task per line)") from None
    except (PermissionError, UnicodeDecodeError) as err:
        raise GyreError(f"{path}: not readable as a task suite ({type(err).__name__})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as err:
            raise GyreError(f"{path}:{n}: not JSON ({err.msg})") from None
        if isinstance(d, dict) and "instance_id" in d:
            tasks.append(swe.task_from_record(d, path.parent, f"{path}:{n}"))
        elif isinstance(d, dict):
            tasks.append(task_from_json(d, path.parent, f"{path}:{n}"))
        else:
            raise GyreError(f"{path}:{n}: a task is a JSON object, not {type(d).__name__}")
    return tasks


def write_jsonl(path: str | Path, tasks: list[Task]) -> None:
    Path(path).write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
