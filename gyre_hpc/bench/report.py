"""What a benchmark reports: tables and lines in the order they are shown, as plain text.

The command line draws a ``Table`` as a rich table, JSON or CSV (``cli.output``); a benchmark
knows nothing of how its report is printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Table:
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)


Report = list[Table | str]
"""Tables and lines, in order."""
