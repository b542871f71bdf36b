"""``gyre-hpc proxy serve`` and ``gyre-hpc proxy key``: the TITO proxy on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gyre_hpc.errors import GyreError
from gyre_hpc.rundir import RunDir

app = typer.Typer(help="Run the TITO proxy in front of engines.", no_args_is_help=True)


@app.command()
def serve(
    engine: Annotated[list[str], typer.Option("--engine", help="Engine base URL (repeatable).")],
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Where the TITO log and the key secret live.")],
    model: Annotated[
        Path | None,
        typer.Option(
            help="Model directory (tokenizer, chat template); default: asked from the first engine."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    capacity: Annotated[
        int, typer.Option(help="Calls in flight per engine; more wait in the proxy.", min=1)
    ] = 8,
    worker: Annotated[int, typer.Option(help="As proxy worker N of --workers: its runs only.", min=0)] = 0,
    workers: Annotated[
        int,
        typer.Option(help="Proxy processes sharing the runs by run id (each its own TITO segment).", min=1),
    ] = 1,
) -> None:
    """Serve the OpenAI-compatible API for harnesses, backed by SGLang-native engines.

    Example: `gyre-hpc proxy serve --engine http://127.0.0.1:30000 --run-dir runs/try`, then
    point a harness at `http://127.0.0.1:8000/v1` with a key from `gyre-hpc proxy key`.
    """
    from gyre_hpc.proxy.server import Proxy, model_of
    from gyre_hpc.proxy.server import serve as serve_proxy
    from gyre_hpc.recipe.schema import ProxyConfig

    if worker >= workers:
        raise GyreError(f"--worker {worker} with --workers {workers}: valid workers are 0 … {workers - 1}")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = ProxyConfig(host=host, port=port)
    proxy = Proxy(
        run_dir, model or model_of(engine[0]), engine, config, capacity, worker=worker, workers=workers
    )
    segment = RunDir(run_dir).tito_segment(worker)
    typer.echo(f"proxy on http://{host}:{port}/v1 → {', '.join(engine)}; TITO log {segment}")
    serve_proxy(proxy, host, port)


@app.command()
def key(
    run_dir: Annotated[Path, typer.Argument(help="The proxy's run directory.", show_default=False)],
    run: Annotated[str, typer.Option("--run", help="Run (execution) id the key writes to.")],
    role: Annotated[
        str, typer.Option("--role", help="main, main-summary, sub-agent, sub-agent-summary, …")
    ] = "main",
) -> None:
    """Mint an API key that fixes its run and role.

    Example: `gyre-hpc proxy key runs/try --run task7-g0 --role main`
    """
    from gyre_hpc.proxy.keys import KeyRing

    if not run_dir.is_dir():
        raise GyreError(f"{run_dir} is not a directory; use the proxy's --run-dir")
    try:
        typer.echo(KeyRing.load(RunDir(run_dir).proxy_secret).mint(run, role))
    except ValueError as err:
        raise GyreError(str(err)) from None
