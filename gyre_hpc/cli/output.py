"""How the CLI prints: consoles that keep every column when piped, and result tables as a table,
JSON or CSV.

Rich sizes a console off a terminal at 80 columns (or ``COLUMNS``) and cuts what does not fit
(``1.0…`` where a ratio was); off a terminal a console here is never narrower than its widest
line. A result table goes to stdout as drawn, or with ``--json`` (one object per table: its
title and its rows by column) or ``--csv`` (a ``# title`` line, a header, the rows); the lines
around it then go to stderr, so stdout holds the result only.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.table import Table

from gyre_hpc.bench.report import Report
from gyre_hpc.bench.report import Table as ReportTable

OFF_TERMINAL_WIDTH = 1000
"""Wide enough for any table here; rich pads nothing, so lines stay as long as their content."""

Format = Literal["table", "json", "csv"]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON (one object per table).")]
CsvOption = Annotated[
    bool, typer.Option("--csv", help="Print the result as CSV (a '# title' line per table).")
]


def console(stderr: bool = False, **kw: object) -> Console:
    """A console on stdout (or stderr) that prints tables whole when it is not a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    width = None
    if not stream.isatty():  # a COLUMNS of 80 inherited from some terminal library must not cut it
        columns = os.environ.get("COLUMNS", "")
        width = max(int(columns) if columns.isdigit() else 0, OFF_TERMINAL_WIDTH)
    return Console(stderr=stderr, width=width, **kw)  # type: ignore[arg-type]


def chosen(as_json: bool, as_csv: bool) -> Format:
    if as_json and as_csv:
        raise typer.BadParameter("give --json or --csv, not both")
    return "json" if as_json else "csv" if as_csv else "table"


class Results:
    """Where a command's results and its other lines go, for the format asked."""

    def __init__(self, fmt: Format = "table") -> None:
        self.fmt = fmt
        self.out = console()
        self.notes = self.out if fmt == "table" else console(stderr=True)

    def table(self, table: Table) -> None:
        if self.fmt == "table":
            self.out.print(table)
        elif self.fmt == "json":
            print(json.dumps({"table": title_of(table), "rows": rows_of(table)}), flush=True)
        else:
            print(as_csv(table), end="", flush=True)

    def note(self, text: str) -> None:
        self.notes.print(text)

    def report(self, report: Report) -> None:
        """A benchmark's tables and lines, in order."""
        for part in report:
            if isinstance(part, ReportTable):
                self.table(drawn(part))
            else:
                self.note(part)


def drawn(table: ReportTable) -> Table:
    """A report's table as rich draws it: numbers right-aligned, as every column here."""
    out = Table(title=table.title)
    for column in table.columns:
        out.add_column(column, justify="right")
    for row in table.rows:
        out.add_row(*row)
    return out


def title_of(table: Table) -> str:
    return str(table.title or "")


def rows_of(table: Table) -> list[dict[str, str]]:
    """The table's cells as text, one dict per row keyed by column header."""
    headers = [str(c.header) for c in table.columns]
    cells = [[str(cell) for cell in c.cells] for c in table.columns]
    return [dict(zip(headers, row, strict=True)) for row in zip(*cells, strict=True)]


def as_csv(table: Table) -> str:
    buf = io.StringIO()
    buf.write(f"# {title_of(table)}\n")
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([str(c.header) for c in table.columns])
    for row in rows_of(table):
        writer.writerow(row.values())
    return buf.getvalue()
