"""A recipe key that names a function by import path: ``module:function`` or
``path/to/file.py:function`` (``agent.entry``, ``trainer.policy_loss``): finding the object, and
the policy loss's own check, which the recipe runs when it loads and the trainers when they train."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre_hpc.errors import RecipeError

POLICY_LOSSES = ("ppo", "gspo", "cispo")
"""The built-in objectives of ``trainer.policy_loss`` (``loss.policy_loss``)."""


def split_entry(entry: str) -> tuple[str, str] | None:
    """(where, name) of ``where:name``; None when either part is missing."""
    where, _, name = entry.rpartition(":")
    return (where, name) if where and name else None


def import_entry(where: str, name: str) -> Any:
    """The object ``name`` of the module ``where`` (a dotted name, or a ``.py`` file taken from
    the current directory when relative); raises whatever importing it raises."""
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, Path(where).resolve())
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {where}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def custom_policy_loss(name: str) -> Callable[..., Any]:
    """``trainer.policy_loss`` naming a function: the function, taking the five arguments of
    ``loss.policy_loss.Objective``; ``RecipeError`` in one line when it is no import path, does
    not import, or has another signature."""
    parts = split_entry(name)
    if parts is None:
        valid = f"valid: {', '.join(POLICY_LOSSES)} or module:function"
        raise RecipeError(f"trainer.policy_loss = {name!r}: not a built-in loss; {valid}")
    try:
        fn = import_entry(*parts)
    except Exception as err:  # whatever the user's module raises while importing
        raise RecipeError(f"trainer.policy_loss = {name!r} does not import: {err}") from None
    try:
        inspect.signature(fn).bind(*range(5))
    except (TypeError, ValueError):
        raise RecipeError(
            f"trainer.policy_loss = {name!r} must be a function of (logprobs, anchor, advantages, "
            "segments, rule) returning the per-token loss"
        ) from None
    return fn
