"""The built-in harness: one execution of a task, as a multi-turn tool-calling loop.

```
 question: [spec] ─▶ model ─▶ its reply, scored (a task with ``answers``: no tools)
 main: [system, spec] ─▶ model ─▶ tool calls ─▶ results ─▶ model ─▶ … ─▶ finish
          │                         └─ delegate(task) ─▶ sub-agent: [system, task] ─▶ … ─▶ sub-agent-summary
          └─ context past the limit ─▶ main-summary ─▶ history := [system, spec, summary]
```

It talks to the model only through an OpenAI-compatible endpoint (the proxy), with one API
key per run and role (``main``, ``main-summary``, ``sub-agent``, ``sub-agent-summary``), exactly as a
black-box harness would. Malformed model output becomes a tool error or a nudge, never a crash;
the execution's wall-clock limit turns it into ``timed_out``.

With a journal (``agents.journal``) each completed main-agent call is journalled, and an
execution handed its journal entry continues from there: same messages, same counters, the rest
of its time limit, and the same per-call seeds. A sub-agent in flight at a restart is begun again
from the main agent's call that delegated it.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from gyre_hpc.agents.journal import Journal, JournalEntry
from gyre_hpc.agents.stops import REASON, Stopped, within
from gyre_hpc.agents.tools import MAIN_TOOLS, SPECS, SUB_AGENT_TOOLS, execute, parse_call
from gyre_hpc.agents.workspace import ToolError, Workspace
from gyre_hpc.execution.outcome import Execution
from gyre_hpc.recipe.schema import AgentConfig
from gyre_hpc.sandbox import supervise
from gyre_hpc.sandbox.confine import UNCONFINED, Sandbox
from gyre_hpc.sandbox.limits import Group
from gyre_hpc.tasks.task import Task

MAIN_SYSTEM = "You are a software agent working in a workspace. Use the tools; call finish when done."
SUB_SYSTEM = "You are a sub-agent. Do the sub-task with the tools, then call finish with a short summary."
SUMMARIZE = "Summarize the progress so far: what exists, what works, what is left. Be brief."
NUDGE = "Reply with a tool call. Call finish when the task is done."


class _OutOfCalls(Exception):
    pass


class Harness:
    def __init__(
        self,
        base_url: str,
        key_for: Callable[[str, str], str],
        config: AgentConfig,
        sampling: dict[str, Any] | None = None,
        model: str = "policy",
        seed: int | None = None,
        sandbox: Sandbox = UNCONFINED,
        url_for: Callable[[str], str] | None = None,
    ) -> None:
        """``base_url``: the proxy's OpenAI API; ``url_for``: a run's own, where the proxy is several
        workers (``run_shard``)."""
        self.base_url, self.key_for, self.config = base_url, key_for, config
        self.url_for = url_for or (lambda run_id: base_url)
        self.sandbox = sandbox  # where run_shell and run_tests run
        self.sampling = sampling or {}
        self.model = model
        self.seed = seed  # with a seed, every call samples reproducibly (seeded by run and call number)
        # One HTTP connection pool for all runs in flight: a client of its own costs each run
        # ~0.1 s of event-loop time to build, which delays every call of a burst that starts at once.
        self._http: Any = None
        self._runs = 0

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
        """One execution; its commands run in ``group`` (the execution's limits), else each in its own."""
        ex = Execution(run_id=run_id, task_id=task.id, workspace=workspace)
        spent = 0.0
        if resume is not None:
            spent = resume.seconds
            ex.calls = resume.calls
            for name, value in resume.counters.items():
                setattr(ex, name, value)
        if self._http is None:
            self._http = openai.DefaultAsyncHttpxClient()
        self._runs += 1
        clients = {
            role: openai.AsyncOpenAI(
                base_url=self.url_for(run_id),
                api_key=self.key_for(run_id, role),
                max_retries=0,
                timeout=self.config.timeout_s,
                http_client=self._http,
            )
            for role in ("main", "main-summary", "sub-agent", "sub-agent-summary")
        }
        started = time.monotonic() - spent
        limit = task.timeout_s or self.config.timeout_s
        log = _Log(journal, ex, started) if journal is not None else None
        try:
            await within(
                self._main(
                    task,
                    Workspace(workspace, self.sandbox.for_task(task), group=group),
                    ex,
                    clients,
                    log,
                    resume.messages if resume else None,
                ),
                max(limit - spent, 0.001),
                stop,
            )
        except TimeoutError:
            ex.status = "timed_out"
        except Stopped:
            ex.status, ex.error = "stopped", REASON
        except _OutOfCalls:
            ex.status = "finished"
            ex.summary = ex.summary or "stopped: model-call budget spent"
        except (openai.APIError, OSError) as err:
            ex.status, ex.error = "crashed", f"{type(err).__name__}: {err}"
        finally:
            ex.seconds = time.monotonic() - started
            self._runs -= 1
            if self._runs == 0:  # the pool belongs to this event loop: close it when idle
                http, self._http = self._http, None
                await http.aclose()
        return ex

    async def _chat(
        self, clients: dict, role: str, messages: list[dict], ex: Execution, tools: list[str] | None
    ) -> Any:
        if ex.calls >= self.config.max_calls:
            raise _OutOfCalls
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages, **self.sampling}
        if self.seed is not None:
            kwargs["seed"] = zlib.crc32(f"{self.seed}:{ex.run_id}:{ex.calls}".encode()) & 0x7FFFFFFF
        if tools:
            kwargs["tools"] = [SPECS[t] for t in tools]
        resp = await self._create(clients[role], kwargs)
        ex.calls += 1
        ex.calls_by_role[role] = ex.calls_by_role.get(role, 0) + 1
        if resp.usage:
            ex.tokens += resp.usage.prompt_tokens + resp.usage.completion_tokens
        return resp

    async def _create(self, client: Any, kwargs: dict[str, Any]) -> Any:
        """One call, made again while the proxy cannot be reached (up to ``agent.unreachable_s``):
        a dead proxy process is the runtime's fault, not the policy's, and crashing the execution
        would score it. A call that reached the proxy and failed there is not made again."""
        waited, wait = 0.0, 0.1
        while True:
            try:
                return await client.chat.completions.create(**kwargs)
            except openai.APITimeoutError:
                raise
            except openai.APIConnectionError:
                if waited >= self.config.unreachable_s:
                    raise
                await asyncio.sleep(wait)
                waited, wait = waited + wait, min(wait * 2, 2.0)

    async def _main(
        self,
        task: Task,
        ws: Workspace,
        ex: Execution,
        clients: dict,
        log: _Log | None,
        messages: list[dict] | None,
    ) -> None:
        if task.answers:  # a question: one reply, no tools, no system prompt but the model's own
            resp = await self._chat(clients, "main", [{"role": "user", "content": task.spec}], ex, None)
            ex.status, ex.summary = "finished", resp.choices[0].message.content or ""
            return
        if not messages:
            messages = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": task.spec}]
        elif log is not None:
            log.journalled = len(messages)
        while True:
            resp = await self._chat(clients, "main", messages, ex, MAIN_TOOLS)
            done = await self._act(resp, messages, ws, ex, task, clients, MAIN_TOOLS)
            if done is not None:
                ex.status, ex.summary = "finished", done
                return
            if (
                resp.usage
                and resp.usage.prompt_tokens + resp.usage.completion_tokens > self.config.context_limit_tokens
            ):
                summary = await self._summarize(clients, "main-summary", messages, ex, MAIN_TOOLS)
                ex.compactions += 1
                messages = [
                    messages[0],
                    messages[1],
                    {"role": "user", "content": f"Progress so far:\n{summary}"},
                ]
                if log is not None:
                    log.journalled = 0  # the journal's history is replaced, not extended
            if log is not None:
                log.call(messages)

    async def _act(
        self,
        resp: Any,
        messages: list[dict],
        ws: Workspace,
        ex: Execution,
        task: Task,
        clients: dict,
        allowed: list[str],
    ) -> str | None:
        """Append the reply and its tool results; the finish summary when the agent finished."""
        msg = resp.choices[0].message
        entry: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
        if msg.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
                for tc in msg.tool_calls
            ]
        messages.append(entry)
        if not msg.tool_calls:
            messages.append({"role": "user", "content": NUDGE})
            return None
        finished = None
        for tc in msg.tool_calls:
            ex.tool_calls += 1
            try:
                call = parse_call(tc.function.name, tc.function.arguments, allowed)
                if call.name == "finish":
                    finished = call.args.get("summary", "")
                    result = "ok"
                elif call.name == "delegate":
                    result = await self._delegate(call.args["task"], ws, ex, task, clients)
                else:
                    result = await supervise.aside(
                        execute, call, ws, self.config.command_timeout_s, task.test_command
                    )
            except ToolError as err:
                ex.tool_errors += 1
                result = f"error: {err}"
            except (OSError, ValueError, RecursionError) as err:  # the workspace's doing: the model's to see
                ex.tool_errors += 1
                result = f"error: {tc.function.name} failed: {err}"
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
        return finished

    async def _delegate(self, subtask: str, ws: Workspace, ex: Execution, task: Task, clients: dict) -> str:
        if ex.sub_agents >= self.config.max_subagents:
            raise ToolError(f"no sub-agents left (at most {self.config.max_subagents} per execution)")
        ex.sub_agents += 1
        messages = [{"role": "system", "content": SUB_SYSTEM}, {"role": "user", "content": subtask}]
        for _ in range(max(1, self.config.max_calls // 8)):
            resp = await self._chat(clients, "sub-agent", messages, ex, SUB_AGENT_TOOLS)
            if await self._act(resp, messages, ws, ex, task, clients, SUB_AGENT_TOOLS) is not None:
                break
        return await self._summarize(clients, "sub-agent-summary", messages, ex, SUB_AGENT_TOOLS)

    async def _summarize(
        self, clients: dict, role: str, messages: list[dict], ex: Execution, tools: list[str]
    ) -> str:
        # The same tools as the context's calls: the summary shares their prefix (and token ids).
        resp = await self._chat(clients, role, messages + [{"role": "user", "content": SUMMARIZE}], ex, tools)
        return resp.choices[0].message.content or "(no summary)"


class _Log:
    """One execution's journal writer: what is new since its last line."""

    def __init__(self, journal: Journal, ex: Execution, started: float) -> None:
        self.journal, self.ex, self.started = journal, ex, started
        self.journalled = 0

    def call(self, messages: list[dict]) -> None:
        ex = self.ex
        counters = {
            "calls_by_role": ex.calls_by_role,
            "tokens": ex.tokens,
            "compactions": ex.compactions,
            "sub_agents": ex.sub_agents,
            "tool_errors": ex.tool_errors,
            "tool_calls": ex.tool_calls,
        }
        keep = self.journalled
        self.journal.call(
            ex.run_id, keep, messages[keep:], ex.calls, counters, time.monotonic() - self.started
        )
        self.journalled = len(messages)
