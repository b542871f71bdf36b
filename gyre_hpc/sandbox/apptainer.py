"""A policy as an ``apptainer exec`` command line, for clusters where Apptainer is the container tool.

The image is the system (read-only, as images are); ``--containall`` gives the command its own
pid and IPC namespaces, a private ``/tmp`` and no host paths but the binds named here;
``--net --network none`` leaves it a loopback interface only. The environment is passed as
``APPTAINERENV_*`` variables (``confine``), never on the command line, where API keys would show
in ``ps``.
"""

from __future__ import annotations

from gyre_hpc.errors import GyreError
from gyre_hpc.sandbox.bwrap import RELAY
from gyre_hpc.sandbox.spec import INSIDE, Policy


def argv(policy: Policy, image: str, command: list[str], python: str = "python3") -> list[str]:
    """``apptainer exec … image command``; with a proxy reach, the command runs under the relay
    (with the image's ``python``)."""
    if policy.hidden or policy.hidden_files:
        shown = ", ".join(str(p) for p in (*policy.hidden, *policy.hidden_files))
        raise GyreError(
            f"agent.sandbox_binds would show {shown} inside apptainer, which cannot hide a path under a "
            "bind; bind directories that do not contain the run directory or the task suite"
        )
    ws, inside = str(policy.workspace), str(policy.inside)
    a = ["apptainer", "exec", "--containall", "--cleanenv", "--no-privs", "--net", "--network", "none"]
    a += ["--home", f"{ws}:{inside}" if ws != inside else ws, "--pwd", inside]
    for p in policy.readonly:
        a += ["--bind", f"{p}:{p}:ro"]
    for m in policy.mounts:
        a += ["--bind", f"{m.host}:{m.inside}" + ("" if m.writable else ":ro")]
    if policy.proxy is not None:
        sock, relay = str(INSIDE / "proxy.sock"), str(INSIDE / "relay.py")
        a += ["--bind", f"{RELAY}:{relay}:ro", "--bind", f"{policy.proxy.socket}:{sock}"]
        command = [python, "-I", relay, sock, str(policy.proxy.port), "--", *command]
    return [*a, image, *command]
