"""Errors a user can cause: the CLI prints these as one line, never as a traceback."""


class GyreError(Exception):
    """A mistake in a recipe, an argument or the environment that the user can fix.

    The message is one line that names what was wrong and what would be valid.
    """

    exit_code: int = 2


class RecipeError(GyreError):
    """A recipe (or a --set override) that does not fit the schema."""


class LaunchError(GyreError):
    """A run or job that could not be started, or that failed; exit code 1."""

    exit_code = 1
