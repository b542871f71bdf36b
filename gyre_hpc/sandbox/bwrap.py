"""A policy as a ``bwrap`` command line (bubblewrap: namespaces, no daemon, no image).

New mount, pid, net, ipc and uts namespaces: the sandbox starts from an empty root with the
system read-only, sees only its own processes, and has a loopback network and nothing else.
It dies with the process that started it, and everything it started dies with it (its pid 1
goes): no command outlives its tool call. Its command runs under a seccomp filter that refuses
new user namespaces (``sandbox.seccomp``).

Run by root, bwrap mounts as root (so that it can bind paths only root may traverse) and the
command then drops to the policy's uid with ``setpriv``: no capabilities, no way back
(``no_new_privs``), a real non-root uid to the kernel. Run by anyone else, bwrap makes a user
namespace as well and the command keeps that user's uid.
"""

from __future__ import annotations

from pathlib import Path

from gyre_hpc.sandbox.spec import INSIDE, Policy, System

RELAY = Path(__file__).with_name("relay.py")
SECCOMP_FD = 9
"""The fd bwrap reads the seccomp filter from (opened by ``limits.JOIN``)."""
NAMESPACES = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]


def argv(
    policy: Policy,
    command: list[str],
    system: System,
    python: str,
    privileged: bool,
    seccomp_fd: int | None = SECCOMP_FD,
) -> list[str]:
    """``bwrap … -- command``; with a proxy reach, the command runs under the relay (``python``);
    with ``seccomp_fd``, under the filter read from it (``sandbox.seccomp``)."""
    a = ["bwrap", *NAMESPACES, "--die-with-parent", "--new-session"]
    if seccomp_fd is not None:
        a += ["--seccomp", str(seccomp_fd)]
    if not privileged:
        a.insert(1, "--unshare-user")
    mounts: list[tuple[Path, bool]] = []  # (destination, shows host content?) in mount order
    made: set[Path] = set()

    def on_host(p: Path) -> bool:
        """Whether ``p`` lies in host content (a bind) rather than in one of the sandbox's tmpfs."""
        covering = [(len(d.parts), i, host) for i, (d, host) in enumerate(mounts) if p.is_relative_to(d)]
        return max(covering)[2] if covering else False

    def parents(dest: Path) -> list[str]:
        # bwrap makes missing parents 0700 root: the dropped uid could not reach its own workspace
        out = []
        for p in reversed(dest.parents[:-1]):
            if p not in made and not on_host(p):
                made.add(p)
                out += ["--perms", "0755", "--dir", str(p)]
        return out

    def mount(dest: Path, host: bool) -> None:
        mounts.append((dest, host))
        made.add(dest)

    # /tmp first: a bind under it (a checkout in /tmp holding the Python) must go on top of it
    a += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
    mount(Path("/tmp"), False)
    for d in system.dirs:
        a += [*parents(Path(d)), "--ro-bind", f"{system.root.rstrip('/')}{d}" if system.root else d, d]
        mount(Path(d), True)
    for link, target in system.links:
        a += ["--symlink", target, link]
        mount(Path(link), True)
    for p in policy.readonly:
        a += [*parents(p), "--ro-bind", str(p), str(p)]
        mount(p, True)
    for h in policy.hidden:  # after the binds that would show them, before the workspace
        a += ["--tmpfs", str(h)]
        mount(h, False)
    for f in policy.hidden_files:
        a += ["--ro-bind", "/dev/null", str(f)]
    for m in policy.mounts:
        a += [*parents(m.inside), "--bind" if m.writable else "--ro-bind", str(m.host), str(m.inside)]
        mount(m.inside, True)
    ws, inside = str(policy.workspace), str(policy.inside)
    a += [*parents(policy.inside), "--bind", ws, inside, "--chdir", inside]
    if policy.proxy is not None:
        sock, relay = str(INSIDE / "proxy.sock"), str(INSIDE / "relay.py")
        a += [*parents(INSIDE / "relay.py")]
        a += ["--ro-bind", str(RELAY), relay, "--bind", str(policy.proxy.socket), sock]
        command = [python, "-I", relay, sock, str(policy.proxy.port), "--", *command]
    if privileged:
        uid = str(policy.uid)
        drop = ["--reuid", uid, "--regid", uid, "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
        command = ["setpriv", *drop, "--no-new-privs", "--", *command]
    return [*a, "--", *command]
