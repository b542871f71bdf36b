"""``gyre-hpc model init-tiny`` and ``gyre-hpc engine serve``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from gyre_hpc.builtin_models.resolve import needs_build, resolve_model
from gyre_hpc.errors import GyreError

model_app = typer.Typer(help="Build and inspect models.", no_args_is_help=True)


def resolve_shown(name: str, console: Console) -> Path:
    """``builtin_models.resolve_model``, with a progress bar while a built-in is built (the
    warm-started tiny model takes minutes on a laptop, once)."""
    if not needs_build(name):
        return resolve_model(name)
    with Progress(
        TextColumn(f"building {name} (once; cached)"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("build", total=None)
        return resolve_model(name, lambda done, total: bar.update(task, completed=done, total=total))


engine_app = typer.Typer(help="Run an inference engine.", no_args_is_help=True)


@model_app.command("init-tiny")
def init_tiny(
    model_dir: Annotated[Path, typer.Argument(help="Directory to write the model to.", show_default=False)],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    warmstart: Annotated[
        str | None, typer.Option(help="Warm-start on a suite's demonstrations (smoke).")
    ] = None,
) -> None:
    """Write a tiny Qwen3-architecture model (random weights, local tokenizer, chat template).

    A standard Hugging Face directory, built offline in seconds, identical for a seed.

    Example: `gyre-hpc model init-tiny models/tiny --seed 0`
    """
    from gyre_hpc.builtin_models.warmstart import warmstart as warm
    from gyre_hpc.models.tiny import init_tiny as build
    from gyre_hpc.tasks.suites import WORDS

    if warmstart is not None and warmstart != "smoke":
        raise GyreError(f"--warmstart {warmstart!r}: only the smoke suite has demonstrations (valid: smoke)")
    path = warm(model_dir, warmstart, seed=seed) if warmstart else build(model_dir, seed, WORDS)
    typer.echo(f"wrote {path} ({sum(f.stat().st_size for f in path.iterdir()) / 1e6:.1f} MB)")


@engine_app.command()
def serve(
    model_dir: Annotated[
        Path, typer.Argument(help="Hugging Face Qwen3 model directory.", show_default=False)
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 30000,
    max_running: Annotated[int, typer.Option(help="Sequences decoded together at most.")] = 32,
) -> None:
    """Serve a model with the embedded engine over the SGLang-native HTTP API.

    Example: `gyre-hpc engine serve models/tiny --port 30000`, then
    `curl -s localhost:30000/generate -d '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}'`
    """
    from gyre_hpc.engines.embedded import Engine
    from gyre_hpc.engines.server import serve as run_server

    if not (model_dir / "config.json").exists():
        raise GyreError(
            f"{model_dir} is not a model directory (no config.json); try `gyre-hpc model init-tiny`"
        )
    engine = Engine(model_dir, max_running=max_running).start()
    typer.echo(f"serving {model_dir} on http://{host}:{port}")
    try:
        run_server(engine, host, port)
    finally:
        engine.stop()
