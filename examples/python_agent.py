"""A Python agent for ``agent.kind = "python"``: gyre-hpc awaits ``agent(ctx)`` once per execution.

    [agent]
    kind = "python"
    entry = "examples/python_agent.py:agent"      # or an importable module:function

``ctx.client`` is an ``openai.AsyncOpenAI`` already bound to this execution (its key says which
run and role a call belongs to); every call through it is recorded token-exactly and trained.
Use ``ctx.clients["main-summary"]`` for a call that compacts the context, and the ``sub-agent``
clients for sub-agents. The function returns a short summary; raising marks the execution
crashed; the time limit (``ctx.timeout_s``) cancels it and it is partially scored.

The model's commands run through ``ctx.shell``, never a subprocess of our own: the agent runs in
the runtime's process, and ``ctx.shell`` runs a command as the built-in ``run_shell`` tool does —
in the execution's sandbox, within its limits, its output streamed and cut.
"""

from __future__ import annotations

import json

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
MAX_TURNS = 4


async def agent(ctx) -> str:  # noqa: ANN001 - a gyre_hpc.agents.external.AgentContext
    messages = [
        {"role": "system", "content": "You are a coding agent. Use run_shell; stop when done."},
        {"role": "user", "content": ctx.task.spec},
    ]
    for _ in range(MAX_TURNS):
        resp = await ctx.client.chat.completions.create(
            model=ctx.model, messages=messages, tools=TOOLS, max_tokens=64
        )
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            messages.append({"role": "user", "content": "Use run_shell, or say DONE."})
            continue
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": await run_tool(ctx, call)})
    return "turns spent"


async def run_tool(ctx, call) -> str:  # noqa: ANN001 - an AgentContext and the model's tool call
    """The model's ``run_shell`` call, run where the runtime runs the model's commands."""
    try:
        command = json.loads(call.function.arguments)["command"]
    except (ValueError, KeyError, TypeError) as err:
        return f"error: {err}"
    if not isinstance(command, str):
        return "error: command must be a string"
    result = await ctx.shell(command, timeout_s=10)
    return f"exit code {result.exit_code}\n{result.output[-2000:]}"
