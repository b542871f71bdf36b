"""Sandboxes: what the code an agent writes may see and touch while it runs.

```
 runtime (controller host, runtime user)              sandbox (one per command / harness program)
   run dir: proxy.secret, tasks/, journal/, …   ✗       /usr /etc … (read-only)   private /tmp
   other workspaces                              ✗       its own workspace (read-write, cwd, HOME)
   controller, engines (pids, ports)             ✗       its own pid namespace, no network
   proxy :P ◀── unix socket ◀── relay 127.0.0.1:P ◀──── a command harness's model calls
```

``policy`` says what one execution's processes see (a frozen record); ``bwrap`` and
``apptainer`` render it as a command line (pure functions, golden-tested); ``confine`` chooses
the backend a recipe asks for, checks it works, and turns a command into the argv, environment
and uid to start; ``relay`` runs inside a sandbox and is the one way out, to the proxy. The
sandbox knows nothing of tools or scoring: the harness decides what to run in it, and the task
format says which of a suite's files are private.
"""
