"""The import graph of ``gyre_hpc``: no cycles between modules or between packages (arrows point
down), and the pure floors reach nothing of the runtime.

Every import counts — at module level, inside functions and under ``TYPE_CHECKING`` — and
importing ``a.b.c`` counts as importing the ``__init__`` of ``a.b`` too, as Python runs it first
(except from inside ``a.b``, which Python initialised before).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

from conftest import REPO

PURE = ("scheduler", "trajectory", "loss", "sim", "step")
"""Concepts shared by the runtime and the simulator: the policy and the step kinds, trajectories,
losses, the simulator, and what one optimizer step is made of."""

BENEATH = ("recipe", "errors", "diskspace", "execution", "plan", "observability")
"""Concepts the pure floors may reach besides each other: the recipe's config sections, the
errors, a full disk named (the event log writes whole records or fails), an execution as a
value, the plan of the hardware (engine replicas a cell serves), and the run's records (the
event schema, where a cell's time went). What those reach in turn is held to the same rule."""

ROOT = {"__init__", "__main__", "errors", "rundir", "diskspace"}
"""The package root: what every floor uses and a newcomer finds by name; everything else lives
in a folder named after its concept."""

SHARED_STEMS = {
    "base": "a component's interface (trainer, transport)",
    "emulated": "a component whose compute is a calibrated delay (engines, trainer)",
    "fleet": "the Fleet a step kind drives (scheduler) and its MPI and simulated implementations",
    "server": "a component's HTTP server (the engine's SGLang-native API, the proxy's OpenAI API)",
    "harbor": "the Harbor task format: its tasks (tasks) and its reward rule (scoring)",
    "swe": "the SWE-bench format: its tasks (tasks) and its scoring rule (scoring)",
    "slurm": "Slurm: its command group (cli) and its commands (launch)",
    "status": "a run's status: its command (cli) and its frames (tui)",
    "__main__": "a package's entry point",
}
"""Module names that stand in more than one folder, each for the same concept seen by another
component. A new name in two folders is two concepts under one name: rename one."""


def modules() -> dict[str, Path]:
    out = {}
    for path in (REPO / "gyre_hpc").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(mods: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module → the gyre_hpc modules it makes Python run."""

    def owner(name: str) -> str:
        while name not in mods:
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if not name.startswith("gyre_hpc."):
                    continue
                parts = owner(name).split(".")
                chain = {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
                # A module's own packages were initialised before it: no edge back to them.
                graph[mod] |= {t for t in chain if t != mod and not mod.startswith(t + ".")}
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package(module: str) -> str:
    """The floor a module lives on: its top-level package (or top-level module)."""
    return module.split(".")[1] if "." in module else module


def test_no_module_imports_itself_through_others() -> None:
    assert cycles(imports(modules())) == []


def test_packages_form_layers_arrows_point_down() -> None:
    graph: dict[str, set[str]] = {}
    for mod, targets in imports(modules()).items():
        graph.setdefault(package(mod), set()).update(
            package(t) for t in targets if package(t) != package(mod) and t != "gyre_hpc"
        )
    assert cycles(graph) == []


def reach(graph: Mapping[str, Iterable[str]], floor: str) -> set[str]:
    """Every module a floor's modules make Python run, transitively."""
    seen: set[str] = set()
    todo = [m for m in graph if package(m) == floor]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def climbs(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """Floor → the modules it reaches that are neither a pure floor nor beneath them."""
    return {floor: out for floor in PURE if (out := {m for m in reach(graph, floor) if not allowed(m)})}


def allowed(module: str) -> bool:
    """A pure floor's module, or one beneath them (a package's ``__init__`` counts with the
    module beneath it that made Python run it)."""
    if package(module) in PURE:
        return True
    name = module.removeprefix("gyre_hpc.")
    return any(name == b or name.startswith(b + ".") or b.startswith(name + ".") for b in BENEATH)


def test_the_pure_floors_reach_only_each_other_the_recipe_errors_and_value_types() -> None:
    assert climbs(imports(modules())) == {}


def test_the_root_holds_only_what_every_floor_uses() -> None:
    loose = {p.stem for p in (REPO / "gyre_hpc").glob("*.py")}
    assert loose == ROOT


def test_a_module_name_in_two_folders_names_one_concept() -> None:
    folders: dict[str, set[str]] = {}
    for path in (REPO / "gyre_hpc").rglob("*.py"):
        if path.stem != "__init__":
            folders.setdefault(path.stem, set()).add(path.parent.name)
    shared = {stem for stem, where in folders.items() if len(where) > 1}
    assert shared == set(SHARED_STEMS), {s: sorted(folders[s]) for s in shared ^ set(SHARED_STEMS)}


def test_a_class_name_names_one_thing() -> None:
    """Two classes of one name are two meanings a reader must tell apart by import."""
    where: dict[str, list[str]] = {}
    for path in sorted((REPO / "gyre_hpc").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_the_checks_see_a_cycle_and_a_climb() -> None:
    """The checks above can fail: a cycle and an upward arrow are found where they exist."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = imports(modules())
    assert "gyre_hpc.scheduler.policy" in graph["gyre_hpc.runtime.controller"]  # runtime → scheduler
    policy = "gyre_hpc.scheduler.policy"
    climbed = {**graph, policy: {*graph[policy], "gyre_hpc.runtime.controller"}}
    assert cycles(climbed)  # runtime → scheduler → runtime
    # The step kinds reading the run directory themselves again: the scheduler reaches files.
    steps = "gyre_hpc.scheduler.steps"
    assert "gyre_hpc.rundir" in climbs({**graph, steps: {*graph[steps], "gyre_hpc.rundir"}})["scheduler"]
    # A value type moved back above its users: the simulator would reach the agents again.
    reached = {
        **graph,
        "gyre_hpc.sim.simulate": {*graph["gyre_hpc.sim.simulate"], "gyre_hpc.agents.dispatch"},
    }
    assert "gyre_hpc.agents.dispatch" in climbs(reached)["sim"]


def test_the_command_line_loads_torch_and_the_harness_only_for_a_command_that_uses_them() -> None:
    """Every ``gyre-hpc`` call imports the command line whole; what only some commands use is
    imported in them (2.6 s a call before, 0.6 s after)."""
    import subprocess
    import sys

    heavy = ("torch", "openai", "aiohttp", "matplotlib", "megatron", "transformers")
    probe = f"import sys, gyre_hpc.cli.app; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
