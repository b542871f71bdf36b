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

Each report line is one JSON object. Standard library only (and pytest in its mode): this file runs
on its own, inside the sandbox, where the package is not importable.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys

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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="testbench")
    ap.add_argument("mode", choices=["checks", "pytest"])
    ap.add_argument("--report", type=int, required=True)
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--checks")
    ap.add_argument("--tests", nargs="*", default=[])
    ap.add_argument("--ini")
    ap.add_argument("--canary", default="")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--rootdir", default="")
    a = ap.parse_args(argv)
    out = _Report(a.report)
    os.set_inheritable(a.report, False)  # what the tested code starts does not get it
    if a.mode == "checks":
        run_checks(out, a.workspace, a.checks, a.timeout)
    else:
        run_pytest(out, a.workspace, a.tests, a.ini, a.canary, a.timeout, a.rootdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
