"""The test bench: the one program a scoring sandbox runs, next to the code it tests.

Run inside the sandbox as ``python -I -B testbench.py MODE --report FD …`` (bound there read-only,
as the relay is): ``-I`` keeps the workspace, ``PYTHON*`` variables and user site off its path, so
nothing of the workspace runs before the bench says ``ready`` on the report pipe. After that only
the policy's code can change what happens, and the supervisor (``scoring.session``) holds it to it.

``checks``  import each check's module from the workspace, evaluate its call, report the value as
            typed JSON (``encode``). The expected values never enter the sandbox: the supervisor
            compares, types included, so a forged report would have to know the answers.
``pytest``  run the hidden tests with the scoring environment's pytest: our ini (``-c``), no plugin
            autoload, no cache, the workspace on ``sys.path`` but never a place conftest files or
            ini files are read from, a per-test time limit, and each test's outcome reported as it
            ends. A canary test that must fail runs last: a runner patched into passing everything
            passes it too.
``verdict`` what a verifier runs instead of ``pytest … && echo 1`` (``$GYRE_PYTEST TESTS…``): the
            ``pytest`` mode in a child over a pipe of its own, the canary checked, then every
            process the child left killed, and only then the fraction of tests passed printed as
            its standard output's one line (pytest's own output goes to stderr; exit 1, 0
            printed, when they did not run to the end). The tested code
            runs in the child: it can end it (0 passed), not print after it, nor reach the pipe of
            this process, which no process of the same user can open (not dumpable).

Each report line is one JSON object. Standard library only (and pytest in its mode): this file runs
on its own, inside the sandbox, where the package is not importable.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

MAX_DEPTH = 32
MAX_ITEMS = 100_000
MAX_STR = 1 << 20


class _Report:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, **data: object) -> None:
        line = (json.dumps(data, separators=(",", ":")) + "\n").encode()
        try:
            while line:
                line = line[os.write(self.fd, line) :]
        except OSError:
            pass


def encode(value: object, depth: int = 0, budget: list[int] | None = None) -> list:
    """``value`` as typed JSON: ``[type, payload]`` for the builtin types (exact types only, never a
    subclass), ``["object", type name]`` for anything else — which equals no expected value."""
    budget = [MAX_ITEMS] if budget is None else budget
    budget[0] -= 1
    t = type(value)
    if budget[0] < 0 or depth > MAX_DEPTH:
        return ["object", "too large to compare"]
    if value is None:
        return ["none", None]
    if t is bool:
        return ["bool", value]
    if t is int:
        return ["int", str(value)]
    if t is float:
        return ["float", repr(value)]
    if t is str:
        return ["str", value] if len(value) <= MAX_STR else ["object", "too large to compare"]
    if t is bytes:
        return ["bytes", value.hex()] if len(value) <= MAX_STR else ["object", "too large to compare"]
    if t in (list, tuple, set, frozenset):
        items = [
            encode(v, depth + 1, budget)
            for v in (sorted(value, key=repr) if t in (set, frozenset) else value)
        ]
        return [t.__name__, items]
    if t is dict:
        return [
            "dict",
            [[encode(k, depth + 1, budget), encode(v, depth + 1, budget)] for k, v in value.items()],
        ]
    return ["object", f"{t.__module__}.{t.__qualname__}"]


class _Late(Exception):
    """A check or test ran over its time limit."""


def _alarm(signum: int, frame: object) -> None:
    raise _Late()


def run_checks(out: _Report, workspace: str, checks_path: str, timeout_s: float) -> None:
    with open(checks_path) as fh:
        checks = json.load(fh)
    out.send(ready=True, checks=len(checks))
    sys.path.insert(0, workspace)  # the tested code, as if it were the current directory
    os.chdir(workspace)
    signal.signal(signal.SIGALRM, _alarm)
    modules: dict[str, object] = {}
    for i, check in enumerate(checks):
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                name = check["module"]
                if name not in modules:
                    try:
                        modules[name] = importlib.import_module(name)
                    except BaseException as err:  # every check of a module that cannot be imported fails
                        modules[name] = err
                if isinstance(modules[name], BaseException):
                    raise modules[name]  # type: ignore[misc]
                namespace = dict(vars(modules[name]))
                value = eval(check["call"], namespace)  # noqa: S307 - the task's call, in the sandbox
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            out.send(check=i, value=encode(value))
        except _Late:
            out.send(check=i, error=f"ran over {timeout_s:g} s")
        except BaseException as err:  # noqa: BLE001 - the tested code's failure is the check's
            out.send(check=i, error=f"{type(err).__name__}: {str(err)[:200]}")
    out.send(done=True)


def run_pytest(
    out: _Report, workspace: str, tests: list[str], ini: str, canary: str, timeout_s: float, rootdir: str = ""
) -> None:
    import pytest  # the scoring environment's, before the workspace is on the path

    class Bench:
        """Our plugin: the canary last, a time limit per test, every outcome reported as it ends."""

        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, items: list) -> None:
            items.sort(key=lambda item: bool(canary) and canary in item.nodeid)

        def pytest_collection_finish(self, session) -> None:  # noqa: ANN001
            out.send(collected=len(session.items))

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):  # noqa: ANN001, ANN201
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                yield
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)

        def pytest_runtest_logreport(self, report) -> None:  # noqa: ANN001
            out.send(test=report.nodeid, when=report.when, outcome=report.outcome)

    signal.signal(signal.SIGALRM, _alarm)
    out.send(ready=True)
    sys.path.insert(0, workspace)
    os.chdir(workspace)
    args = ["-c", ini, "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", "-W", "ignore"]
    if rootdir:  # node ids are then the repository's own (a SWE instance's test lists)
        args.append(f"--rootdir={rootdir}")
    code = pytest.main([*args, *tests], plugins=[Bench()])
    out.send(done=True, exit=int(code))


def count_tests(root: Path) -> int:
    """How many tests pytest would find in ``root``'s files (or ``root``, a file), read from their
    source: a module that cannot be imported still counts its tests; a literal ``parametrize``
    list multiplies them."""
    total = 0
    for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
        if not (path.name.startswith("test_") or path.name.endswith("_test.py")):
            continue
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except (OSError, SyntaxError, ValueError, RecursionError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                total += _cases(node)
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                total += sum(
                    _cases(n)
                    for n in node.body
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test")
                )
    return total


def _cases(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    n = 1
    for d in fn.decorator_list:
        if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "parametrize" and len(d.args) >= 2:
            if isinstance(d.args[1], ast.List | ast.Tuple):
                n *= max(1, len(d.args[1].elts))
    return n


PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


def verdict(workspace: str, tests: list[str], ini: str, canary: str, nonce: str, timeout_s: float) -> int:
    """Run ``tests`` (paths) on ``workspace``'s code by the ``pytest`` mode in a child;
    print the fraction passed last, once nothing the child started is left. Exit 0 when the
    tests ran to the end (the canary failed), whatever passed."""
    tests = [os.path.abspath(t) for t in tests]  # the child runs in the workspace
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no process of our user opens our fds or memory
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # what the child leaves becomes ours to kill
    read, write = os.pipe()
    os.set_inheritable(read, False)
    argv = [sys.executable, "-I", "-B", __file__, "pytest", "--report", str(write), "--workspace",
            workspace, "--tests", *tests, canary, "--ini", ini, "--canary", nonce, "--timeout",
            f"{timeout_s:g}"]  # fmt: skip
    # pytest's own output goes to stderr: standard output holds the fraction alone
    child = subprocess.Popen(argv, pass_fds=(write,), stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno())
    os.close(write)
    lines: list[bytes] = []
    reader = threading.Thread(target=_read_lines, args=(read, lines), daemon=True)
    reader.start()
    child.wait()
    _kill_descendants(os.getpid())  # then no process holds the pipe: the reader reaches its end
    reader.join()
    phases: dict[str, dict[str, str]] = {}
    for raw in list(lines):
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if not isinstance(line, dict):
            continue
        test, when, outcome = line.get("test"), line.get("when"), line.get("outcome")
        if isinstance(test, str) and isinstance(when, str) and isinstance(outcome, str):
            phases.setdefault(test, {}).setdefault(when, outcome)
    mine = [t for t in phases if nonce in t]
    ran = bool(mine) and phases[mine[0]].get("call") == "failed"  # the canary ran and failed
    real = [p for t, p in phases.items() if nonce not in t]
    done = sum(p.get("call") == "passed" and all(o == "passed" for o in p.values()) for p in real)
    total = max(len(real), sum(count_tests(Path(t)) for t in tests), 1)
    sys.stderr.flush()
    print(f"{done / total if ran else 0.0:.6g}", flush=True)
    return 0 if ran else 1


def _read_lines(fd: int, into: list[bytes]) -> None:
    buf = b""
    with os.fdopen(fd, "rb", buffering=0) as fh:
        while chunk := fh.read(65536):
            buf += chunk
            *done, buf = buf.split(b"\n")
            into.extend(done)


def _kill_descendants(me: int) -> None:
    """SIGKILL every process below ``me`` (orphans are ours: the subreaper), until none is left."""
    for _ in range(100):
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", "rb") as fh:
                        parents[int(entry)] = int(fh.read().rsplit(b")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
        below = {me}
        changed = True
        while changed:
            new = {p for p, pp in parents.items() if pp in below and p not in below}
            below |= new
            changed = bool(new)
        below.discard(me)
        if not below:
            break
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:  # reap them (we are their subreaper)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="testbench")
    ap.add_argument("mode", choices=["checks", "pytest", "verdict"])
    ap.add_argument("--report", type=int, default=-1)
    ap.add_argument("--workspace", default="")
    ap.add_argument("--checks")
    ap.add_argument("--tests", nargs="*", default=[])
    ap.add_argument("--ini")
    ap.add_argument("--canary", default="")
    ap.add_argument("--canary-file", default="")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--rootdir", default="")
    a = ap.parse_args(argv)
    if a.mode == "verdict":
        return verdict(a.workspace, a.tests, a.ini, a.canary_file, a.canary, a.timeout)
    out = _Report(a.report)
    os.set_inheritable(a.report, False)  # what the tested code starts does not get it
    if a.mode == "checks":
        run_checks(out, a.workspace, a.checks, a.timeout)
    else:
        run_pytest(out, a.workspace, a.tests, a.ini, a.canary, a.timeout, a.rootdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
