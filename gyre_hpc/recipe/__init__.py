"""Recipes: declarative TOML mapped onto one small config dataclass per component."""

from gyre_hpc.recipe.load import load_recipe, to_toml
from gyre_hpc.recipe.schema import Recipe

__all__ = ["Recipe", "load_recipe", "to_toml"]
