"""The examples run the model's commands the way the runtime does: in the execution's sandbox.

The model is scripted (a chat-completions server on loopback that answers with the commands a
hostile policy would send, and records what the agent sends back): the examples' real tool paths
then run them under the real harnesses and real bwrap, and what came back to the model must show
that nothing outside the workspace was reached.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from conftest import REPO

from gyre_hpc.agents.dispatch import make_harness
from gyre_hpc.agents.external import Endpoint
from gyre_hpc.recipe.schema import AgentConfig
from gyre_hpc.sandbox.confine import for_run
from gyre_hpc.tasks.task import Task

pytestmark = pytest.mark.bwrap
EXAMPLES = REPO / "examples"


def attack(secret: Path) -> str:
    """What a policy would try from its shell: the run's secret, root's files, the runtime, the host."""
    return f"cat {secret}; cat /etc/shadow; id -u; kill -0 {os.getpid()} && echo runtime-reached; echo END"


@asynccontextmanager
async def scripted_model(replies: list[dict[str, Any]]) -> AsyncIterator[tuple[str, list[dict]]]:
    """An OpenAI chat-completions server answering each call with the next scripted message; the
    request bodies it received."""
    received: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        received.append(await request.json())
        message = replies[min(len(received) - 1, len(replies) - 1)]
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return web.json_response({
            "id": f"chatcmpl-{len(received)}", "object": "chat.completion", "created": int(time.time()),
            "model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", received
    finally:
        await runner.cleanup()


def run_dir(tmp_path: Path) -> tuple[Path, Path, Path]:
    run = tmp_path / "runs" / "r-1"
    secret = run / "proxy.secret"
    secret.parent.mkdir(parents=True)
    secret.write_text("secret contents\n")
    ws = run / "workspaces" / "ex-1"
    ws.mkdir(parents=True)
    tmp_path.chmod(0o755)
    return run, secret, ws


def assert_confined(output: str) -> None:
    assert "END" in output, output  # the command ran
    assert "secret contents" not in output and "root:" not in output and "runtime-reached" not in output
    assert "\n0\n" not in output  # not root


def test_the_python_example_runs_the_model_s_commands_with_ctx_shell_in_the_sandbox(tmp_path: Path) -> None:
    run, secret, ws = run_dir(tmp_path)
    arguments = json.dumps({"command": attack(secret)})
    call = {"id": "call_1", "type": "function", "function": {"name": "run_shell", "arguments": arguments}}
    script = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "content": "DONE"},
    ]
    config = AgentConfig(kind="python", entry=f"{EXAMPLES / 'python_agent.py'}:agent", sandbox="bwrap")
    box = for_run(config, run, "smoke", pytest.fail)

    async def go() -> tuple[Any, list[dict]]:
        async with scripted_model(script) as (url, received):
            harness = make_harness(config, Endpoint(url, lambda r, role: "k", "m"), {}, 0, tmp_path, box)
            box.prepare(ws)
            ex = await harness.run(Task(id="t", spec="Look around."), ws, "ex-1")
            return ex, received

    ex, received = asyncio.run(go())
    assert ex.status == "finished", ex.error
    tool_results = [m["content"] for m in received[1]["messages"] if m["role"] == "tool"]
    assert len(tool_results) == 1
    assert_confined(tool_results[0])
    assert "No such file or directory" in tool_results[0] and "Permission denied" in tool_results[0]


def test_the_command_example_runs_whole_in_the_sandbox_with_its_commands(tmp_path: Path) -> None:
    run, secret, ws = run_dir(tmp_path)
    script = [{"role": "assistant", "content": attack(secret)}, {"role": "assistant", "content": "DONE"}]
    program = EXAMPLES / "command_agent.py"
    config = AgentConfig(
        kind="command", command=[sys.executable, str(program), "{instruction}"], sandbox="bwrap"
    )
    box = for_run(config, run, "smoke", pytest.fail)

    async def go() -> tuple[Any, list[dict]]:
        async with scripted_model(script) as (url, received):
            endpoint = Endpoint(url.removesuffix("/"), lambda r, role: "k", "m")
            harness = make_harness(config, endpoint, {}, 0, tmp_path / "logs", box)
            box.prepare(ws)
            ex = await harness.run(Task(id="t", spec="Look around."), ws, "ex-1")
            return ex, received

    ex, received = asyncio.run(go())
    assert ex.status == "finished", (tmp_path / "logs" / "ex-1.log").read_text()
    sent = [m["content"] for m in received[1]["messages"] if m["role"] == "user"]
    assert_confined(sent[-1])
    assert "No such file or directory" in sent[-1] and "Permission denied" in sent[-1]
