#!/usr/bin/env python3
"""A black-box agent program for ``agent.kind = "command"``: gyre-hpc starts it once per execution.

    [agent]
    kind = "command"
    command = ["python3", "/path/to/examples/command_agent.py", "{instruction}"]

It knows nothing of gyre-hpc: it reads the standard ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``
(which point at the proxy, keyed to this execution) and ``GYRE_MODEL``, works in its current
directory (the execution's workspace), and exits 0 when done. Any program that does the same —
an agent CLI, a multi-agent system — is trained the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys

from openai import OpenAI

MAX_TURNS = 4


def main() -> int:
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    model = os.environ.get("GYRE_MODEL", "policy")
    messages = [
        {
            "role": "system",
            "content": "Reply with one shell command per turn, nothing else. Say DONE when done.",
        },
        {"role": "user", "content": sys.argv[1] if len(sys.argv) > 1 else "Look around."},
    ]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48)
        command = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": command})
        if "DONE" in command:
            break
        try:
            run = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=10)
            result = (run.stdout + run.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            result = "timed out"
        messages.append({"role": "user", "content": f"output:\n{result}"})
    print(f"{len(messages) // 2} turns", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
