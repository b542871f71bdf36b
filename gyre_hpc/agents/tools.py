"""The tools an agent can call, as OpenAI function specs, and their execution in a workspace.

Malformed calls — unknown tool, arguments that are not a JSON object, missing or mistyped
arguments — come back to the model as a tool error naming what was wrong and what is valid;
they never stop the harness.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gyre_hpc.agents.workspace import ToolError, Workspace

OPTIONAL = {"list_files": {"path"}}


def _spec(name: str, description: str, **params: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": v} for k, v in params.items()},
                "required": [p for p in params if p not in OPTIONAL.get(name, set())],
            },
        },
    }


SPECS = {
    "read_file": _spec("read_file", "Read a file of the workspace.", path="relative path"),
    "write_file": _spec(
        "write_file", "Create or replace a file.", path="relative path", content="file content"
    ),
    "list_files": _spec("list_files", "List the workspace's files.", path="relative directory, '.' for all"),
    "run_shell": _spec("run_shell", "Run a shell command in the workspace.", command="bash command"),
    "run_tests": _spec("run_tests", "Run the task's visible tests."),
    "delegate": _spec(
        "delegate", "Give a sub-task to a sub-agent; returns its summary.", task="the sub-task"
    ),
    "finish": _spec("finish", "Declare the task done.", summary="what was done"),
}
MAIN_TOOLS = list(SPECS)
SUB_AGENT_TOOLS = [t for t in SPECS if t != "delegate"]


@dataclass(frozen=True)
class Call:
    name: str
    args: dict[str, str]


def parse_call(name: str, arguments: str | None, allowed: list[str]) -> Call:
    if name not in allowed:
        raise ToolError(f"unknown tool {name!r}; valid tools: {', '.join(allowed)}")
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as err:
        raise ToolError(f"arguments of {name} are not valid JSON ({err.msg}); send a JSON object") from None
    if not isinstance(args, dict):
        raise ToolError(f"arguments of {name} must be a JSON object")
    params = SPECS[name]["function"]["parameters"]["properties"]
    missing = [p for p in params if p not in args and p not in OPTIONAL.get(name, set())]
    wrong = [k for k, v in args.items() if k in params and not isinstance(v, str)]
    if missing or wrong or set(args) - set(params):
        expected = ", ".join(f"{p}: string" for p in params) or "no arguments"
        raise ToolError(f"{name} takes {{{expected}}}; got {json.dumps(args)[:200]}")
    return Call(name, {k: str(v) for k, v in args.items()})


def execute(call: Call, ws: Workspace, command_timeout_s: float, test_command: str | None) -> str:
    """Run a file or shell tool (delegate and finish are the harness's)."""
    a = call.args
    if call.name == "read_file":
        return ws.read(a["path"])
    if call.name == "write_file":
        return ws.write(a["path"], a["content"])
    if call.name == "list_files":
        return ws.listing(a.get("path") or ".")
    if call.name in ("run_shell", "run_tests"):
        command = a.get("command") if call.name == "run_shell" else test_command
        if not command:
            raise ToolError("this task has no visible tests")
        r = ws.run(command, command_timeout_s)
        if r.timed_out:
            status = f"timed out after {command_timeout_s:g} s (killed)"
        elif r.killed:
            status = f"killed: {r.killed}"
        else:
            status = f"exit code {r.exit_code}"
        return f"{status}\n{r.output}"
    raise ToolError(f"{call.name} is not executed here")
