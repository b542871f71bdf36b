"""What ``run`` and ``submit`` do before a world starts: a recipe (or a run directory to continue)
loaded, and once it passed the launch check (``launch.check``), its run directory made (or its
resume recorded).

```
 RECIPE [--set …] ─────────▶ load ──▶ check_launch ──▶ runs/<name>-<time>/recipe.toml
 --resume RUN_DIR [--set …] ─▶ its recipe.toml + resumes.jsonl + --set ──▶ check_launch
                                                     ──▶ resumes.jsonl += the --set and launcher
```

It knows nothing of how the world is started (``launch.local``, ``launch.submit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gyre_hpc.errors import GyreError
from gyre_hpc.recipe import Recipe, load_recipe
from gyre_hpc.rundir import RunDir


def load_run(recipe: Path | None, resume: Path | None, sets: Sequence[str]) -> tuple[RunDir | None, Recipe]:
    """A new run's recipe (no run directory yet), or the run directory to continue and its
    recipe in force with ``sets`` added."""
    if (recipe is None) == (resume is None):
        raise GyreError("give a RECIPE, or --resume RUN_DIR (not both)")
    if resume is None:
        return None, load_recipe(recipe, sets)
    run_dir = RunDir(resume.resolve())
    if (missing := run_dir.missing()) is not None:
        raise GyreError(f"--resume {missing}")
    return run_dir, recipe_in_force(run_dir, sets)


def recipe_in_force(run_dir: RunDir, sets: Sequence[str] = ()) -> Recipe:
    """The recipe a run directory runs under now: as created, every resume's overrides, then
    ``sets``."""
    return load_recipe(run_dir.recipe_path, [*run_dir.overrides(), *sets])


def open_run(r: Recipe, run_dir: RunDir | None, sets: Sequence[str], launcher: str) -> RunDir:
    """A new run's directory with its resolved recipe, or the continued one with this resume
    recorded (its recipe.toml stays as the run was created)."""
    if run_dir is None:
        run_dir = RunDir.create(r.run.runs_dir, r.run.name)
        run_dir.write_recipe(r)
    else:
        run_dir.add_resume(list(sets), launcher)
    return run_dir
