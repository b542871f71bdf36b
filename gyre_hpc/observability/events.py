"""Events: JSON records appended to ``<run_dir>/events.jsonl``, the run's history.

Writers are the launcher (``run_start``, ``run_end``), the controller (everything between) and a
rank that fails (``rank_failed``). Each record is one ``os.write`` on an ``O_APPEND`` descriptor,
so writers in several processes never interleave inside a line; a reader drops a torn last line
left by a writer that was killed mid-write. Readers: ``status``, benchmarks, plots.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Appends events to one file; safe to share with other processes writing the same file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"t": round(time.time(), 6), "event": event, **fields}
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """All complete records; a torn last line or a garbled line is skipped."""
    return EventTail(path).new()


class EventTail:
    """Follows an events file as it grows (the launcher's progress display)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # leave a partly written last line for the next call
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out
