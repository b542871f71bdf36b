"""Harnesses we do not write: a program (``agent.kind = "command"``) or a Python function
(``agent.kind = "python"``), trained through the proxy exactly like the built-in one.

```
 execution ─▶ workspace/ (task seed) ─▶ the user's agent ──OpenAI / Anthropic API──▶ proxy ─▶ engines
                                          │  one key per run and role (env or AgentContext)
                                          └─ exit / return / timeout ─▶ Execution ─▶ scoring
```

The proxy sees every model call and records its exact ids under the execution's key: the trees,
selection and training need nothing from the agent but its calls. What the agent is told:

=========================  ==================================================================
``OPENAI_BASE_URL``        the proxy's OpenAI endpoint (``…/v1``: chat completions, responses);
                           ``OPENAI_API_KEY``: the execution's key
``ANTHROPIC_BASE_URL``     the proxy's root (``/v1/messages``); ``ANTHROPIC_API_KEY``: the same key
``GYRE_MODEL``             the model name to ask for
``GYRE_KEY_<ROLE>``        one key per role: ``MAIN``, ``MAIN_SUMMARY`` (a call that compacts the
                           main context), ``SUB_AGENT``, ``SUB_AGENT_SUMMARY``. A call made with a
                           role's key is recorded under that role: that is how a black-box
                           harness marks its summaries and sub-agents for the trees
``GYRE_RUN_ID``            the execution; ``GYRE_WORKSPACE``: its directory (also the cwd)
``GYRE_INSTRUCTION``       the task's instruction (also ``{instruction}`` in the command)
=========================  ==================================================================

A program runs in the run's sandbox (``gyre_hpc.sandbox``) with its own process group and the
execution's time limit. Sandboxed, it has no network: the variables above name
``http://127.0.0.1:<port>``, which the sandbox's relay forwards to the proxy and nowhere else, and
its environment holds only ``PATH``, ``LANG``, ``HOME`` (the workspace), ``TMPDIR`` and these
variables. Unconfined (``agent.sandbox = none``), it inherits the runtime's environment and network.
At the limit the
whole group is killed and the execution is ``timed_out`` (partially scored); a non-zero exit is
``crashed``. Its output goes to ``logs/executions/<run>.log`` in the run directory. A restarted
run starts an unfinished black-box execution again (only the built-in harness journals its calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import openai

from gyre_hpc.agents.journal import Journal, JournalEntry
from gyre_hpc.agents.stops import REASON, Stopped, within
from gyre_hpc.agents.workspace import CommandResult, Workspace
from gyre_hpc.errors import GyreError
from gyre_hpc.execution.outcome import Execution
from gyre_hpc.proxy.run_shard import shard_of
from gyre_hpc.recipe.entry import import_entry, split_entry
from gyre_hpc.recipe.schema import AgentConfig
from gyre_hpc.sandbox import relay, supervise
from gyre_hpc.sandbox.confine import UNCONFINED, Launch, Sandbox
from gyre_hpc.sandbox.limits import Group
from gyre_hpc.sandbox.spec import ProxyReach
from gyre_hpc.tasks.task import Task

ROLES = ("main", "main-summary", "sub-agent", "sub-agent-summary")
INTERPRETERS = ("python", "bash", "sh", "node", "perl", "ruby")
LOG_BYTES = 16 << 20
"""What of a program's output goes to its log (``logs/executions/<run>.log``); the rest is counted."""
Usage = Callable[[str], tuple[int, int]]
"""Calls the proxy recorded for a run, and the tokens they processed (input + output)."""


@dataclass(frozen=True)
class Endpoint:
    """Where an execution's model calls go, and how they are keyed."""

    base_url: str
    """The proxy's root URL (its OpenAI API is under ``/v1``)."""
    key_for: Callable[[str, str], str]
    model: str
    usage: Usage = lambda run_id: (0, 0)
    workers: tuple[str, ...] = ()
    """With several proxy workers (``proxy.workers``): each one's root URL, by worker index; a run
    is told its own worker's (``run_shard``) instead of ``base_url``."""

    def url_for(self, run_id: str) -> str:
        """The proxy root this run's calls go to."""
        return self.workers[shard_of(run_id, len(self.workers))] if self.workers else self.base_url


@dataclass(frozen=True)
class AgentContext:
    """What a Python agent (``agent.kind = "python"``) gets for one execution."""

    task: Task
    workspace: Path
    run_id: str
    model: str
    client: openai.AsyncOpenAI
    """Bound to the execution's ``main`` key."""
    clients: Mapping[str, openai.AsyncOpenAI]
    """One client per role (``main``, ``main-summary``, ``sub-agent``, ``sub-agent-summary``)."""
    timeout_s: float
    sandbox: Sandbox = UNCONFINED
    group: Group | None = None
    """The execution's limits group (every command it runs counts against the same limits)."""

    async def shell(self, command: str, timeout_s: float = 60.0) -> CommandResult:
        """Run ``command`` in the workspace as the built-in ``run_shell`` tool does: in the run's
        sandbox, within the execution's limits, its output streamed and cut."""
        ws = Workspace(self.workspace, self.sandbox, group=self.group)
        return await supervise.aside(ws.run, command, timeout_s)


PythonAgent = Callable[[AgentContext], Awaitable[str | None]]


def instruction(task: Task) -> str:
    return task.spec


def fields(task: Task, workspace: Path, run_id: str, timeout_s: float) -> dict[str, str]:
    """What a command's argv may name: ``{workspace}``, ``{instruction}``, ``{task_id}``, …"""
    return {
        "workspace": str(workspace),
        "instruction": instruction(task),
        "task_id": task.id,
        "run_id": run_id,
        "timeout_s": f"{timeout_s:g}",
    }


def environment(endpoint: Endpoint, run_id: str, task: Task, workspace: Path) -> dict[str, str]:
    keys = {role: endpoint.key_for(run_id, role) for role in ROLES}
    env = {
        "OPENAI_BASE_URL": endpoint.url_for(run_id) + "/v1",
        "OPENAI_API_KEY": keys["main"],
        "ANTHROPIC_BASE_URL": endpoint.url_for(run_id),
        "ANTHROPIC_API_KEY": keys["main"],
        "GYRE_MODEL": endpoint.model,
        "GYRE_RUN_ID": run_id,
        "GYRE_WORKSPACE": str(workspace),
        "GYRE_INSTRUCTION": instruction(task),
    }
    env |= {f"GYRE_KEY_{role.upper().replace('-', '_')}": key for role, key in keys.items()}
    return env


def _finish(ex: Execution, endpoint: Endpoint, started: float) -> Execution:
    ex.seconds = time.monotonic() - started
    ex.calls, ex.tokens = endpoint.usage(ex.run_id)
    return ex


class CommandHarness:
    """Each execution runs ``agent.command`` (an argv template) in its workspace, in the sandbox."""

    def __init__(
        self, config: AgentConfig, endpoint: Endpoint, logs: Path, sandbox: Sandbox = UNCONFINED
    ) -> None:
        self.config, self.endpoint, self.logs, self.sandbox = config, endpoint, logs, sandbox
        if sandbox.kind == "bwrap":  # the program's own files are shown (read-only), the run never
            programs = _program_paths(config.command)
            if hidden := [(p, h) for p in programs for h in sandbox.hidden if p.absolute().is_relative_to(h)]:
                raise GyreError(
                    f"agent.command names {hidden[0][0]}, inside {hidden[0][1]}, which a sandbox never "
                    "shows (the run directory, the task suite); keep the program elsewhere"
                )
            self.sandbox = sandbox.showing([_home(p) for p in programs if not sandbox.shows(p)])

    async def run(
        self,
        task: Task,
        workspace: Path,
        run_id: str,
        journal: Journal | None = None,
        resume: JournalEntry | None = None,
        stop: asyncio.Event | None = None,
        group: Group | None = None,
    ) -> Execution:
        ex = Execution(run_id=run_id, task_id=task.id, workspace=workspace)
        limit = task.timeout_s or self.config.timeout_s
        box = self.sandbox.for_task(task)  # the workspace where the task says, when it does
        seen = box.workdir or workspace
        argv = [a.format(**fields(task, seen, run_id, limit)) for a in self.config.command]  # checked
        self.logs.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        async with contextlib.AsyncExitStack() as scope:
            if group is None:
                group = scope.enter_context(box.group(run_id))
            cpu_s = int(limit) + 1
            if box.confined:
                url = urlsplit(self.endpoint.url_for(run_id))
                port = url.port or 80
                sock = await scope.enter_async_context(
                    relay.outside(url.hostname or "", port, box.owner_in(group))
                )
                inside = replace(self.endpoint, base_url=f"http://127.0.0.1:{port}", workers=())
                env = _inherited() | {"HOME": str(workspace)} | environment(inside, run_id, task, workspace)
                launch = box.launch(workspace, argv, env, ProxyReach(sock, port), group=group, cpu_s=cpu_s)
            else:
                env = {**os.environ, **environment(self.endpoint, run_id, task, workspace)}
                launch = box.launch(workspace, argv, env, group=group, cpu_s=cpu_s)
            ex = await self._run(ex, launch, limit, stop, group)
        return _finish(ex, self.endpoint, started)

    async def _run(
        self, ex: Execution, launch: Launch, limit: float, stop: asyncio.Event | None, group: Group
    ) -> Execution:
        """The program to its end in a thread (``supervise``: the time limit, the quota, its output
        to the log, cut); a stop from the controller, or the run ending, kills its group."""
        run_id, limits = ex.run_id, group.limits  # the task's own where it names them
        quota = supervise.Quota(ex.workspace, limits.workspace_entries, limits.workspace_bytes)
        halt = threading.Event()
        with (self.logs / f"{run_id}.log").open("ab", buffering=0) as log:  # live, for `tail -f`
            job = asyncio.ensure_future(
                supervise.aside(
                    supervise.run,
                    launch.argv,
                    launch.popen(),
                    group=group,
                    timeout_s=limit,
                    keep_bytes=4096,
                    quota=quota,
                    stop=halt,
                    sink=log,
                    sink_bytes=LOG_BYTES,
                )  # fmt: skip
            )
            try:
                if stop is not None:
                    waiter = asyncio.ensure_future(stop.wait())
                    await asyncio.wait({job, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    if stop.is_set():
                        halt.set()
                done = await asyncio.shield(job)
            except OSError as err:  # it could not even start (its workspace is gone, say)
                ex.status, ex.error = "crashed", f"{launch.argv[0]}: {err.strerror or err}"
                return ex
            except BaseException:  # the run stops: nothing it started may outlive it
                halt.set()
                with contextlib.suppress(BaseException):
                    await job
                raise
        logged = f"(see logs/executions/{run_id}.log)"
        if done.killed == "stopped":
            ex.status, ex.error = "stopped", REASON
        elif done.timed_out:
            ex.status, ex.error = "timed_out", f"killed at its time limit ({limit:g} s)"
        elif done.killed:
            ex.status, ex.error = "crashed", f"killed: {done.killed} {logged}"
        elif done.exit_code == 0:
            ex.status = "finished"
        else:
            ex.status, ex.error = "crashed", f"exit code {done.exit_code} {logged}"
        return ex


def _inherited() -> dict[str, str]:
    """What a sandboxed program inherits of the runtime's environment: nothing that could hold a secret."""
    return {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM")}


def _program_paths(command: list[str]) -> list[Path]:
    """The host files an argv template runs: its program (found on PATH, after an ``env …``
    prefix) and, when that is an interpreter, the script it is given."""
    args = [a for a in command if "{" not in a]
    if args and Path(args[0]).name == "env":
        args = [a for a in args[1:] if "=" not in a and not a.startswith("-")]
    found = shutil.which(args[0]) if args else None
    if found is None:
        return []
    paths = [Path(found)]
    if Path(found).name.startswith(INTERPRETERS) and len(args) > 1 and Path(args[1]).is_file():
        paths.append(Path(args[1]).absolute())
    return paths


def _home(program: Path) -> Path:
    """What to show for a program: its directory, or the virtual environment it belongs to."""
    where = program.absolute().parent
    return where.parent if where.name == "bin" and (where.parent / "pyvenv.cfg").exists() else where


class PythonHarness:
    """Each execution awaits ``agent.entry`` (``module:function``) with an ``AgentContext``."""

    def __init__(self, config: AgentConfig, endpoint: Endpoint, sandbox: Sandbox = UNCONFINED) -> None:
        self.config, self.endpoint, self.sandbox = config, endpoint, sandbox
        self.agent = load_entry(config.entry)

    async def run(
        self,
        task: Task,
        workspace: Path,
        run_id: str,
        journal: Journal | None = None,
        resume: JournalEntry | None = None,
        stop: asyncio.Event | None = None,
        group: Group | None = None,
    ) -> Execution:
        ex = Execution(run_id=run_id, task_id=task.id, workspace=workspace)
        limit = task.timeout_s or self.config.timeout_s
        clients = {
            role: openai.AsyncOpenAI(
                base_url=self.endpoint.url_for(run_id) + "/v1",
                api_key=self.endpoint.key_for(run_id, role),
                max_retries=0,
                timeout=limit,
            )
            for role in ROLES
        }
        ctx = AgentContext(
            task,
            workspace,
            run_id,
            self.endpoint.model,
            clients["main"],
            clients,
            limit,
            self.sandbox.for_task(task),
            group,
        )
        started = time.monotonic()
        try:
            summary = await within(self.agent(ctx), limit, stop)
            ex.status, ex.summary = "finished", summary or ""
        except TimeoutError:
            ex.status, ex.error = "timed_out", f"stopped at its time limit ({limit:g} s)"
        except Stopped:
            ex.status, ex.error = "stopped", REASON
        except Exception as err:  # the agent's own bug: this execution crashed, the run goes on
            ex.status, ex.error = "crashed", f"{type(err).__name__}: {err}"
        finally:
            for client in clients.values():
                await client.close()
        return _finish(ex, self.endpoint, started)


def load_entry(entry: str) -> PythonAgent:
    """``module:function`` or ``path/to/file.py:function`` → the function; one line naming what is
    wrong otherwise. A relative path is taken from the current directory."""
    parts = split_entry(entry)
    if parts is None:
        raise GyreError(f"agent.entry = {entry!r}: expected module:function or path/to/file.py:function")
    try:
        fn = import_entry(*parts)
    except (ImportError, AttributeError, OSError) as err:
        raise GyreError(f"agent.entry = {entry!r}: {err}") from None
    if not inspect.iscoroutinefunction(fn):
        raise GyreError(f"agent.entry = {entry!r}: not an async function")
    return fn
