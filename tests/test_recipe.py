"""Recipes: every shipped file loads, the schema is snapshotted, mistakes are one clear line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import REPO, SGLANG_PYTHON, assert_golden, gyre

from gyre_hpc.errors import RecipeError
from gyre_hpc.recipe import Recipe, load_recipe, to_toml
from gyre_hpc.recipe.load import schema_lines

RECIPES = sorted((REPO / "recipes").glob("*.toml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads(path: Path) -> None:
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    assert load_recipe_text(to_toml(recipe), path.parent) == recipe  # show -> load is lossless


def load_recipe_text(text: str, tmp: Path) -> Recipe:
    p = tmp / ".roundtrip.toml"
    try:
        p.write_text(text)
        return load_recipe(p)
    finally:
        p.unlink(missing_ok=True)


def test_shipped_recipes_cover_smoke_and_a_cluster() -> None:
    smoke = load_recipe(REPO / "recipes" / "smoke.toml")
    assert (smoke.cells.count, smoke.cells.ranks_per_cell) == (2, 1)
    clusters = [load_recipe(p) for p in RECIPES if load_recipe(p).engine.backend == "sglang"]
    assert any(
        r.cells.count == 8 and r.slurm.gpus_per_node == 8 and r.trainer.backend == "megatron"
        for r in clusters
    )


def test_schema_snapshot() -> None:
    """Adding or removing a recipe key must update tests/golden/recipe_schema.txt on purpose."""
    assert_golden("recipe_schema.txt", "\n".join(schema_lines()) + "\n")


def test_every_section_is_in_the_schema() -> None:
    sections = {line.split(".")[0] for line in schema_lines()}
    assert sections == {
        "run",
        "cells",
        "scheduler",
        "engine",
        "trainer",
        "transport",
        "proxy",
        "agent",
        "tasks",
        "trajectory",
        "scoring",
        "executors",
        "slurm",
        "observability",
        "bench",
    }


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "cells.cont=3",
            "--set cells.cont=3: unknown key cells.cont (did you mean count?); valid keys of "
            "[cells]: count = 2, ranks_per_cell = 1, capacity = 8,",
        ),
        ("cells.count=two", '--set cells.count=two: cells.count must be an integer, got "two"'),
        ("cells.count=0", "--set cells.count=0: cells.count = 0 is out of range: must be >= 1"),
        ("engine.top_p=1.5", "engine.top_p = 1.5 is out of range: must be <= 1.0"),
        (
            "scheduler.mode=elastc",
            'scheduler.mode = "elastc" is not valid; valid values: "elastic", "async", "colocate"',
        ),
        ("bench.modes=['x']", 'bench.modes[0] = "x" is not valid'),
        ("run.steps=true", "run.steps must be an integer, got true"),
        ("cell.count=1", "unknown section [cell] (did you mean cells?); valid sections: run, cells,"),
        ("cellscount", "expected section.key=value"),
        ("agent.sandbox=docker", 'valid values: "auto", "bwrap", "apptainer", "none"'),
        ("agent.sandbox=apptainer", 'agent.sandbox = "apptainer" needs agent.sandbox_image'),
    ],
)
def test_override_errors_name_the_path_and_what_is_valid(override: str, message: str) -> None:
    with pytest.raises(RecipeError) as err:
        load_recipe(REPO / "recipes" / "smoke.toml", [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def numeric_keys() -> list[tuple[str, str, dict]]:
    import dataclasses
    import typing

    from gyre_hpc.recipe.schema import SECTIONS

    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float):
                out.append((f"{section}.{f.name}", hints[f.name].__name__, dict(f.metadata)))
    return out


@pytest.mark.parametrize(("key", "kind", "meta"), numeric_keys(), ids=[k for k, _, _ in numeric_keys()])
def test_every_number_has_a_documented_range_and_nothing_past_it_loads(
    key: str, kind: str, meta: dict
) -> None:
    """No integer or float knob is unbounded: a value past its maximum, an infinity or a NaN is one
    line naming the key and its range (``10**23`` cells once rendered a script; ``1e999`` seconds
    once ended in an OverflowError)."""
    assert meta["min"] is not None and meta["max"] is not None, key
    assert meta["max"] < 10**23 and f"[{meta['min']:_}, {meta['max']:_}]" in "\n".join(schema_lines())
    values = ["100000000000000000000000"] + (["1e999", "-inf", "nan"] if kind == "float" else [])
    for value in values:
        with pytest.raises(RecipeError) as err:
            load_recipe(None, [f"{key}={value}"])
        text = str(err.value)
        assert text.startswith(f"--set {key}={value}: {key} = ") and "\n" not in text, text
        assert "out of range" in text or "not a finite number" in text, text


def test_a_recipe_number_past_its_range_is_one_line_and_exit_2() -> None:
    for key in ("run.steps=100000000000000000000000", "agent.sandbox_uid=100000000000000000000",
                "agent.command_timeout_s=1e999", "cells.count=100000000000000000000000"):  # fmt: skip
        proc = gyre("recipe", "check", str(REPO / "recipes" / "smoke.toml"), "--set", key)
        assert proc.returncode == 2, (key, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --set ") and "Traceback" not in proc.stderr


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[cells]\ncount = 2\ncapacityy = 3\n")
    with pytest.raises(
        RecipeError, match=rf"^{bad}: unknown key cells.capacityy \(did you mean capacity\?\)"
    ):
        load_recipe(bad)
    bad.write_text("[cells\n")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(bad)
    bad.write_text("steps = 3\n")
    with pytest.raises(RecipeError, match="top-level key 'steps' is not a \\[section\\]"):
        load_recipe(bad)


def test_overrides_apply_in_order_and_type_by_field() -> None:
    r = load_recipe(
        None,
        [
            "run.name=123",
            "cells.count=3",
            "cells.count=4",
            "engine.temperature=1",
            "slurm.setup=['module load x']",
            'run.model="/m/q"',
        ],
    )
    assert (r.run.name, r.cells.count, r.engine.temperature) == ("123", 4, 1.0)
    assert r.slurm.setup == ["module load x"] and r.run.model == "/m/q"


def test_cross_section_rules() -> None:
    with pytest.raises(
        RecipeError, match="cells.ranks_per_cell = 3 must be a multiple of slurm.nodes_per_cell = 2"
    ):
        load_recipe(None, ["cells.ranks_per_cell=3", "slurm.nodes_per_cell=2"])
    with pytest.raises(RecipeError, match="leaves no cell sampling"):
        load_recipe(None, ["scheduler.mode=async", "scheduler.async_train_cells=2", "cells.count=2"])
    with pytest.raises(RecipeError, match=r"bench.async_splits = \[0, 4\]: .* valid splits are 1 … 3"):
        load_recipe(None, ["cells.count=4", "bench.async_splits=[1, 0, 4]"])
    with pytest.raises(RecipeError, match=r"scheduler.max_staleness = 1 needs scheduler.mode = \"elastic\""):
        load_recipe(None, ["scheduler.mode=colocate", "scheduler.max_staleness=1"])
    with pytest.raises(RecipeError, match="every step writes a checkpoint"):
        load_recipe(None, ["scheduler.max_staleness=1", "trainer.checkpoint_every=1"])


def test_cli_errors_are_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = gyre("recipe", "check", "recipes/smoke.toml", "--set", "scheduler.mode=fast")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert 'scheduler.mode = "fast" is not valid; valid values: "elastic", "async", "colocate"' in proc.stderr
    for args in (
        ["run", "missing.toml"],
        ["submit", "missing.toml", "--dry-run"],
        ["recipe", "show", "missing.toml"],
    ):
        proc = gyre(*args)
        assert (proc.returncode, proc.stderr.strip()) == (2, "error: missing.toml: no such recipe file"), args
    for args in (["run", str(tmp_path)], ["recipe", "check", str(tmp_path)], ["submit", str(tmp_path)]):
        proc = gyre(*args)
        assert (proc.returncode, proc.stderr.strip().splitlines()) == (
            2,
            [f"error: {tmp_path}: a directory, not a recipe file (a TOML file, e.g. recipes/smoke.toml)"],
        ), args
    proc = gyre("eval", "recipes/smoke.toml", "--suite", str(tmp_path), "--n", "1")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {tmp_path}: no task.toml in it or in its subdirectories (not a Harbor task or dataset)"
    ]  # a directory suite is read as Harbor tasks


def test_cli_check_and_show() -> None:
    proc = gyre("recipe", "check", "recipes/smoke.toml")
    assert proc.returncode == 0 and "recipes/smoke.toml: ok — colocate, 2 cells × 1 ranks" in proc.stdout
    proc = gyre("recipe", "show", "recipes/smoke.toml", "--set", "cells.count=5", "--no-docs")
    assert proc.returncode == 0
    assert "[cells]\ncount = 5\nranks_per_cell = 1" in proc.stdout
    assert "[bench]" in proc.stdout  # every section, defaults filled in


def test_check_run_and_submit_agree_about_what_is_runnable(tmp_path: Path) -> None:
    """A recipe that loads but that run/submit would refuse is not "ok" for check either: here,
    the flagship's SGLang cells in an environment without SGLang (.venv-sglang has it)."""
    flagship = "recipes/qwen3-8b-8cells.toml"
    check = gyre("recipe", "check", flagship)
    run = gyre("run", flagship, "--set", f"run.runs_dir={tmp_path}")
    submit = gyre("submit", flagship, "--set", f"run.runs_dir={tmp_path}")
    reason = "engine.backend = 'sglang' needs SGLang beside gyre-hpc in this environment"
    assert check.returncode == run.returncode == submit.returncode == 2
    assert check.stderr.startswith(f"error: {flagship}: valid, but not runnable: {reason}")
    assert reason in run.stderr and reason in submit.stderr and "ok" not in check.stdout
    assert not any(tmp_path.iterdir())
    runnable = gyre("recipe", "check", flagship, "--set", "engine.backend=embedded")
    assert runnable.returncode == 0 and ": ok — elastic" in runnable.stdout


@pytest.mark.sglang
def test_the_flagship_recipe_is_runnable_where_sglang_is_installed(tmp_path: Path) -> None:
    flagship = "recipes/qwen3-8b-8cells.toml"
    check = subprocess.run(
        [str(SGLANG_PYTHON), "-m", "gyre_hpc", "recipe", "check", flagship],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert check.returncode == 0 and "engine sglang, trainer megatron" in check.stdout, check.stderr
