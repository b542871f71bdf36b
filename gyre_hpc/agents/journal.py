"""The execution journal: what each execution has done so far, so a restarted run continues it.

```
 journal/step-0007/s0007-t03-g1.jsonl      one line per completed model call, appended:
   {"keep": 12, "add": [new messages], "calls": 14, "counters": {...}, "seconds": 81.2}
   …
   {"outcome": {execution + score}}        once the execution is scored
```

The built-in harness journals an execution after every completed model call (and the tool
results that answered it): the messages added since the previous line (``keep`` says how many
earlier ones stay: a compaction keeps fewer), its call counts and elapsed time. Its workspace is
on disk already. A line holds only what is new, so an execution of 800 calls over a 1M-token
context writes each message once, not 800 times.

After a restart the dispatcher hands a running execution's ``JournalEntry`` back to the harness, which
sends the same messages again: the proxy recognises the recorded transcript and extends its ids
exactly, so the trajectory tree continues where it stopped. A finished execution is not run again;
its scored outcome is returned as it was. A line torn by a crash is ignored (the call it described
is made again).

The journal knows nothing of the proxy, the TITO log or training; ``runtime.resume`` decides
which journalled executions a restarted run keeps.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_hpc.diskspace import write_all


@dataclass
class JournalEntry:
    """One execution as its journal leaves it."""

    run_id: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The main agent's conversation as it will be sent with the next call."""
    calls: int = 0
    """Model calls completed (every role): the run's first ``calls`` TITO records are its own."""
    counters: dict[str, Any] = field(default_factory=dict)
    """The execution's counters (calls by role, tokens, compactions, sub-agents, tool errors)."""
    seconds: float = 0.0
    """Wall-clock time spent so far: a continued execution gets what is left of its limit."""
    outcome: dict[str, Any] | None = None
    """Once finished: the scored outcome (``outcome.Outcome.to_json``)."""

    @property
    def finished(self) -> bool:
        return self.outcome is not None


@dataclass(frozen=True)
class Journal:
    """The journal of one step's executions: one JSON-lines file per execution under ``path``."""

    path: Path

    def file(self, run_id: str) -> Path:
        return self.path / f"{run_id}.jsonl"

    def call(
        self, run_id: str, keep: int, add: list[dict[str, Any]], calls: int, counters: dict, seconds: float
    ) -> None:
        """A completed call: ``add`` follows the first ``keep`` messages journalled so far."""
        line = {"keep": keep, "add": add, "calls": calls, "counters": counters, "seconds": round(seconds, 3)}
        self._append(run_id, line)

    def finish(self, run_id: str, outcome: dict[str, Any]) -> None:
        self._append(run_id, {"outcome": outcome})

    def _append(self, run_id: str, line: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.file(run_id), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            write_all(fd, data)
        finally:
            os.close(fd)

    def load(self, run_id: str) -> JournalEntry | None:
        try:
            raw = self.file(run_id).read_bytes()
        except FileNotFoundError:
            return None
        entry, good = JournalEntry(run_id), 0
        for text in raw.splitlines(keepends=True):
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                break
            if not text.endswith(b"\n"):
                break
            good += len(text)
            if "outcome" in line:
                entry.outcome = line["outcome"]
                break
            entry.messages = entry.messages[: line["keep"]] + line["add"]
            entry.calls, entry.counters, entry.seconds = line["calls"], line["counters"], line["seconds"]
        if good < len(raw) and entry.outcome is None:
            # Torn by a crash: the call it described is made again, and the next line starts clean.
            os.truncate(self.file(run_id), good)
        return entry

    def forget(self, run_id: str) -> None:
        self.file(run_id).unlink(missing_ok=True)

    def run_ids(self) -> list[str]:
        return sorted(p.name.removesuffix(".jsonl") for p in self.path.glob("*.jsonl"))
