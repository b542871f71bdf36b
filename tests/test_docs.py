"""What the docs say that can drift mechanically, checked against the tree: README.md,
docs/ARCHITECTURE.md and BENCHMARKS.md.

- every path they name (in backticks or as a link) exists, and every module file they name by its
  bare name (``replay.py``) is one of the tree's;
- every ``gyre-hpc`` command they show is a command, with flags it takes, recipe files that exist
  and ``--set`` keys a recipe has;
- every recipe key they name (``section.key``) is a key of its section;
- every test id (``tests/test_x.py::test_y``) names a test there is;
- a run directory's path spells its executions' run ids as ``execution.run_id`` makes them;
- every plot they link exists and was drawn by its drawing code as it is now (a PNG names the code
  that drew it, normalised: docstrings and layout aside).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from functools import cache

import typer
from conftest import REPO
from PIL import Image

from gyre_hpc.cli.app import app
from gyre_hpc.errors import RecipeError
from gyre_hpc.execution.run_id import dispatched_step
from gyre_hpc.observability.plot import SOURCE, source_of
from gyre_hpc.recipe import load_recipe
from gyre_hpc.recipe.schema import SECTIONS

DOCS = ("README.md", "docs/ARCHITECTURE.md", "BENCHMARKS.md")
ROOTS = ("gyre_hpc", "tools", "tests", "recipes", "examples", "docs", "sbatch")
"""A path in the docs that starts with one of these is the repository's."""
NOT_OURS = {"sitecustomize.py", "pytest.py", "conftest.py", "setup.py", "test.py", "calc.py", "solution.py"}
"""Module names the docs use for the files a policy writes (the attacks scoring must survive)."""
HARBOR = {"tests/test.sh"}
"""Paths of a Harbor task's own layout, which the docs describe."""
PLACEHOLDER = re.compile(r"[<>…*]|NNN|\{|\[|RUN_DIR|RECIPE")
DRAWN_BY = {
    "docs/benchmarks/learning": "gyre_hpc/observability/plot.py",
    "docs/benchmarks/": "gyre_hpc/sim/plots.py",
}
"""A plot's folder (or its name's start) → the module whose code draws it."""


@cache
def text(doc: str) -> str:
    return (REPO / doc).read_text()


def spans(source: str) -> list[str]:
    """Inline code and the lines of fenced code blocks."""
    out = []
    for i, block in enumerate(source.split("```")):
        if i % 2:  # inside a fence: each line, without its language tag
            out += block.splitlines()[1:]
        else:
            out += re.findall(r"`([^`\n]+)`", block)
    return out


def links(source: str) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", source) if "://" not in t and not t.startswith("#")]


def every(fn) -> list[str]:  # noqa: ANN001
    """``fn``'s findings in every doc's text, each prefixed with its doc."""
    return [f"{doc}: {found}" for doc in DOCS for found in fn(text(doc))]


# ---- paths ---------------------------------------------------------------------------------------


def repo_paths(source: str) -> list[str]:
    """Paths of the repository: under one of its top folders, or a package's module or folder
    (``launch/sbatch.py``, ``sim/``) named from inside ``gyre_hpc``."""
    found = []
    for token in [*spans(source), *links(source)]:
        for word in token.split():
            word = word.strip("\"'()[],.:;").split("::")[0].split(".py:")[0]
            word += ".py" if word and not word.endswith(".py") and token.count(word + ".py") else ""
            if "/" not in word or word.startswith(("/", "~", ".", "http")) or PLACEHOLDER.search(word):
                continue
            top = word.split("/")[0]
            if (
                top in ROOTS
                and word not in HARBOR
                or ((REPO / "gyre_hpc" / top).is_dir() and word.endswith((".py", "/")))
            ):
                found.append(word)
    return found


def exists(path: str) -> bool:
    return (REPO / path).exists() or (REPO / "gyre_hpc" / path).exists()


def missing_paths(source: str) -> list[str]:
    return sorted({p for p in repo_paths(source) if not exists(p)})


@cache
def module_names() -> set[str]:
    return {p.name for root in ROOTS for p in (REPO / root).rglob("*.py")} | {"__init__.py"}


def missing_modules(source: str) -> list[str]:
    named = {m for token in spans(source) for m in re.findall(r"(?<![\w/.])(\w+\.py)\b", token)}
    return sorted(named - module_names() - NOT_OURS)


def test_every_path_and_module_the_docs_name_exists() -> None:
    assert every(missing_paths) == []
    assert every(missing_modules) == []


# ---- commands ------------------------------------------------------------------------------------


def commands(source: str) -> list[list[str]]:
    """Each ``gyre-hpc …`` shown, as argv after the program (up to a comment, pipe, ``&&`` or the
    end of a parenthesis), but those shown failing (``error_examples``)."""
    out = []
    failing = {f"$ gyre-hpc {' '.join(argv)}" for argv, _ in error_examples(source)}
    for span in spans(source):
        if span.strip() in failing:
            continue
        for m in re.finditer(r"(?:^|[\s/])gyre-hpc\s+([^#|&`),;]*)", span):
            try:
                argv = shlex.split(m.group(1))
            except ValueError:
                argv = m.group(1).split()
            if argv:
                out.append(argv)
    return out


def error_examples(source: str) -> list[tuple[list[str], str]]:
    """Commands shown with the error they print: ``$ gyre-hpc …`` then ``error: …`` in a fence."""
    lines = [line for span in spans(source) for line in [span]]
    return [
        (shlex.split(line.removeprefix("$ gyre-hpc ")), after.removeprefix("error: "))
        for line, after in zip(lines, lines[1:], strict=False)
        if line.startswith("$ gyre-hpc ") and after.startswith("error: ")
    ]


def wrong_errors(source: str) -> list[str]:
    """A recipe error shown is the one loading that recipe with those overrides gives (up to an
    ellipsis)."""
    wrong = []
    for argv, said in error_examples(source):
        recipe = next(a for a in argv if a.endswith(".toml"))
        sets = [v for k, v in zip(argv, argv[1:], strict=False) if k in ("--set", "-s")]
        try:
            load_recipe(REPO / recipe, sets)
            wrong.append(f"gyre-hpc {' '.join(argv)}: no error")
        except RecipeError as err:
            if not str(err).startswith(said.split("…")[0].rstrip(", ")):
                wrong.append(f"gyre-hpc {' '.join(argv)}: says {str(err)[:80]!r}")
    return wrong


def wrong_commands(source: str) -> list[str]:
    root = typer.main.get_command(app)
    wrong = []
    for argv in commands(source):
        cmd, rest = root, list(argv)
        while hasattr(cmd, "commands") and rest and rest[0] in cmd.commands:
            cmd = cmd.commands[rest.pop(0)]
        if hasattr(cmd, "commands"):  # a group: what follows must name one of its commands
            if rest and not PLACEHOLDER.search(rest[0]) and "|" not in rest[0] and not rest[0].isupper():
                wrong.append(f"gyre-hpc {' '.join(argv)}: no command {rest[0]!r}")
            continue
        flags = {o for p in cmd.params for o in [*p.opts, *p.secondary_opts]}
        for i, word in enumerate(rest):
            flag = word.split("=")[0]
            if word.startswith("--") and word != "--" and flag not in flags:
                wrong.append(f"gyre-hpc {' '.join(argv)}: {cmd.name} takes no {flag}")
            if word.endswith(".toml") and "/" in word and not PLACEHOLDER.search(word) and not exists(word):
                wrong.append(f"gyre-hpc {' '.join(argv)}: no recipe {word}")
            if i and rest[i - 1] in ("--set", "-s") and (bad := wrong_key(word.split("=")[0])):
                wrong.append(f"gyre-hpc {' '.join(argv)}: {bad}")
    return wrong


def test_every_command_the_docs_show_takes_the_flags_and_keys_they_give_it() -> None:
    shown = sum((commands(text(doc)) for doc in DOCS), [])
    assert len(shown) > 30  # the check reads them all: README's commands block alone has a dozen
    assert every(wrong_commands) == []
    assert every(error_examples) and every(wrong_errors) == []


# ---- recipe keys ---------------------------------------------------------------------------------


FILE_TYPES = {"png", "out", "secret", "json", "jsonl", "bin", "toml", "log", "txt", "py", "sh", "md", "exit"}


def wrong_key(dotted: str) -> str | None:
    """Why ``section.key`` is not a recipe key (None when it is, or when it names a module or a
    file: ``scheduler.steps``, ``cells.png``)."""
    section, _, key = dotted.partition(".")
    if section not in SECTIONS or not key or "." in key or key in FILE_TYPES:
        return None
    if (REPO / "gyre_hpc" / section / f"{key}.py").exists() or (REPO / "gyre_hpc" / section / key).is_dir():
        return None  # a module (``scheduler.steps``), not a key
    if key in {f.name for f in dataclasses.fields(SECTIONS[section])}:
        return None
    return f"{dotted}: [{section}] has no key {key!r}"


def wrong_keys(source: str) -> list[str]:
    """Keys named anywhere but in a command shown failing (it names a wrong one on purpose)."""
    failing = {f"$ gyre-hpc {' '.join(argv)}" for argv, _ in error_examples(source)}
    source = "\n".join(
        line for line in source.splitlines() if line.strip() not in failing and not line.startswith("error: ")
    )
    named = {
        m for span in spans(source) for m in re.findall(r"(?<![\w./-])([a-z_]+\.[a-z_]+)\b(?![./(\w])", span)
    }
    return sorted(bad for k in named if (bad := wrong_key(k)))


def test_every_recipe_key_the_docs_name_is_one() -> None:
    assert every(wrong_keys) == []
    listed = text("README.md").split("one table per component — ", 1)[1].split(" —", 1)[0]
    assert re.findall(r"`(\w+)`", listed) == list(SECTIONS)  # the README's sections, in recipe order


# ---- test ids and run ids ------------------------------------------------------------------------


def wrong_test_ids(source: str) -> list[str]:
    wrong = []
    for path, name in re.findall(r"(tests/test_\w+\.py)::(\w+)", source):
        source = (REPO / path).read_text() if (REPO / path).exists() else ""
        if not re.search(rf"^(async )?def {name}\(", source, re.M):
            wrong.append(f"{path}::{name}")
    return wrong


def wrong_run_ids(source: str) -> list[str]:
    """A workspace's path spells the run id of an execution of that step."""
    return [
        f"workspaces/step-{step}/{run}"
        for span in spans(source)
        for step, run in re.findall(r"workspaces/step-(\d{4})/([\w.-]+)", span)
        if not re.fullmatch(r"s\d{4}-[\w.-]+-g\d+", run) or dispatched_step(run) != int(step)
    ]


def test_every_test_id_and_run_id_the_docs_name_is_one() -> None:
    assert every(wrong_test_ids) == []
    assert every(wrong_run_ids) == []


# ---- plots ---------------------------------------------------------------------------------------


def stale_plots(source: str) -> list[str]:
    """Linked plots that are missing, or were drawn by other code than their module's now (each
    PNG names the code that drew it: ``observability.plot.source_of``)."""
    wrong = []
    for plot in [p for p in links(source) if p.endswith(".png")]:
        if not (REPO / plot).exists():
            wrong.append(f"{plot}: missing")
            continue
        drawer = next((code for where, code in DRAWN_BY.items() if plot.startswith(where)), None)
        if drawer is None:
            wrong.append(f"{plot}: no code is known to draw it (tests/test_docs.py DRAWN_BY)")
            continue
        drawn_by = Image.open(REPO / plot).text.get(SOURCE, "unnamed code")
        if drawn_by != (now := source_of(REPO / drawer)):
            wrong.append(f"{plot}: drawn by {drawn_by}, older than {now}: draw it again")
    return wrong


def test_every_linked_plot_exists_and_was_drawn_by_its_drawing_code_as_it_is() -> None:
    assert every(stale_plots) == []


def test_the_checks_find_what_drifted() -> None:
    """Each rule fails on a statement of the kind the docs held before they were checked."""
    assert not exists("gyre_hpc/replay.py") and exists("gyre_hpc/bench/replay.py")
    assert wrong_key("engine.tp_size") is None and wrong_key("scheduler.steps") is None
    assert wrong_key("scheduler.switching") == "scheduler.switching: [scheduler] has no key 'switching'"
    drifted = (
        "`gyre-hpc run --resum x` `gyre-hpc bench sims` `workspaces/step-0001/smoke-0-0-g0`"
        " `tests/test_sim.py::test_gone` `layout.py` `gyre_hpc/replay.py` `--set cells.cuont=2`"
        " [plot](docs/benchmarks/paper-2.4t/gone.png)"
    )
    assert wrong_commands(drifted) == [
        "gyre-hpc run --resum x: run takes no --resum",
        "gyre-hpc bench sims: no command 'sims'",
    ]
    assert wrong_keys(drifted) == ["cells.cuont: [cells] has no key 'cuont'"]
    assert wrong_run_ids(drifted) == ["workspaces/step-0001/smoke-0-0-g0"]
    assert wrong_test_ids(drifted) == ["tests/test_sim.py::test_gone"]
    assert missing_modules(drifted) == ["layout.py"]
    assert missing_paths(drifted) == ["docs/benchmarks/paper-2.4t/gone.png", "gyre_hpc/replay.py"]
    assert stale_plots(drifted) == ["docs/benchmarks/paper-2.4t/gone.png: missing"]
