"""Load a recipe: a TOML file plus ``--set section.key=value`` overrides -> a validated ``Recipe``.

Every mistake becomes one ``RecipeError`` line that names where it came from (the file or the
``--set``), the TOML path, and what would be valid: the keys of the section with their defaults,
the allowed values, or the bounds. Nothing here knows what the components do with their values.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import tomli_w

from gyre_hpc.errors import RecipeError
from gyre_hpc.recipe.schema import SECTIONS, Recipe

Origins = dict[tuple[str, str], str]
C = TypeVar("C")


def load_recipe(path: str | Path | None, overrides: Sequence[str] = ()) -> Recipe:
    """Read ``path`` (None: all defaults), apply ``overrides`` in order, validate."""
    source = str(path) if path is not None else "defaults"
    data = _read_toml(Path(path)) if path is not None else {}
    origins: Origins = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise RecipeError(f"{source}: top-level key '{section}' is not a [section]; {_valid_sections()}")
        origins.update({(section, key): source for key in table})
    for text in overrides:
        section, key, raw = parse_override(text)
        data.setdefault(section, {})[key] = _Raw(raw)
        origins[(section, key)] = f"--set {text}"
    return build_recipe(data, origins, source)


def parse_override(text: str) -> tuple[str, str, str]:
    """``'cells.count=3'`` -> ``('cells', 'count', '3')``."""
    path, sep, raw = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not section or not key or "." in key:
        raise RecipeError(f"--set {text!r}: expected section.key=value, e.g. --set cells.count=3")
    return section, key, raw.strip()


def with_sets(config: C, overrides: Sequence[str], what: str) -> C:
    """One config dataclass with ``key=value`` overrides (``bench sim --set``): each value read as
    a recipe key's is (TOML, or a bare string) and checked against its field's type and range."""
    cls = type(config)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    changes = {}
    for text in overrides:
        key, sep, raw = (part.strip() for part in text.partition("="))
        if not sep or key not in fields:
            valid = describe_section(cls)
            raise RecipeError(f"--set {text}: unknown {what} key{_suggest(key, fields)}; valid keys: {valid}")
        changes[key] = _check(_parse_raw(raw, hints[key]), hints[key], fields[key].metadata, f"--set {key}")
    try:
        return dataclasses.replace(config, **changes)
    except ValueError as err:  # the dataclass's own checks
        raise RecipeError(f"--set: {err}") from None


def build_recipe(data: dict[str, Any], origins: Origins, source: str) -> Recipe:
    sections: dict[str, Any] = {}
    for section, table in data.items():
        cls = SECTIONS.get(section)
        if cls is None:
            where = next((o for (s, _), o in origins.items() if s == section), source)
            raise RecipeError(
                f"{where}: unknown section [{section}]{_suggest(section, SECTIONS)}; {_valid_sections()}"
            )
        sections[section] = _build_section(section, cls, table, origins)
    try:
        return Recipe(**sections)
    except RecipeError as err:
        raise RecipeError(f"{source}: {err}") from None


def _build_section(section: str, cls: type, table: dict[str, Any], origins: Origins) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in table.items():
        where = origins.get((section, key), "recipe")
        if key not in fields:
            raise RecipeError(
                f"{where}: unknown key {section}.{key}{_suggest(key, fields)}; "
                f"valid keys of [{section}]: {describe_section(cls)}"
            )
        if isinstance(value, _Raw):
            value = _parse_raw(value, hints[key])
        values[key] = _check(value, hints[key], fields[key].metadata, f"{where}: {section}.{key}")
    return cls(**values)


class _Raw(str):
    """An override's text, typed only once the field's type is known."""


def _parse_raw(raw: str, hint: Any) -> Any:
    if hint is str or (
        typing.get_origin(hint) is Literal and all(isinstance(a, str) for a in typing.get_args(hint))
    ):
        return raw[1:-1] if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'" else str(raw)
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return str(raw)  # reported below as a type error, with the expected type


def _check(value: Any, hint: Any, meta: typing.Mapping[str, Any], where: str) -> Any:
    value = _check_type(value, hint, where)
    low, high = meta.get("min"), meta.get("max")
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"{where} = {_show(value)} is not a finite number: must be in [{low}, {high}]")
    if low is not None and value < low:
        raise RecipeError(f"{where} = {_show(value)} is out of range: must be >= {low}")
    if high is not None and value > high:
        raise RecipeError(f"{where} = {_show(value)} is out of range: must be <= {high}")
    return value


def _check_type(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise RecipeError(
                f"{where} = {_show(value)} is not valid; valid values: {', '.join(map(_show, allowed))}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{where} must be a list, got {_show(value)}")
        (item,) = typing.get_args(hint)
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise RecipeError(f"{where} must be {_TYPE_NAMES[hint]}, got {_show(value)}")
    return value


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _show(value: Any) -> str:
    return tomli_w.dumps({"v": value})[4:].strip()


def _suggest(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _valid_sections() -> str:
    return "valid sections: " + ", ".join(SECTIONS)


def describe_section(cls: type) -> str:
    """``'count = 2, ranks_per_cell = 1, ...'``: every key of a section with its default."""
    return ", ".join(f"{f.name} = {_show(_default(f))}" for f in dataclasses.fields(cls))


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except IsADirectoryError:
        raise RecipeError(
            f"{path}: a directory, not a recipe file (a TOML file, e.g. recipes/smoke.toml)"
        ) from None
    except PermissionError:
        raise RecipeError(f"{path}: not readable (permission denied)") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a text file") from None
    except tomllib.TOMLDecodeError as err:
        raise RecipeError(f"{path}: not valid TOML: {err}") from None


def to_toml(recipe: Recipe, docs: bool = True) -> str:
    """The resolved recipe as TOML, every key present, documented when ``docs``."""
    lines: list[str] = []
    for section in SECTIONS:
        config = getattr(recipe, section)
        doc = " ".join((type(config).__doc__ or "").split())  # one comment line, however it wraps
        lines.append(f"[{section}]" + (f"  # {doc}" if docs else ""))
        for f in dataclasses.fields(config):
            if docs:
                lines.append(f"# {f.metadata['doc']}{_range(f).replace('  [', '  Range: [')}")
            lines.append(f"{f.name} = {_show(getattr(config, f.name))}")
        lines.append("")
    return "\n".join(lines)


def schema_lines() -> list[str]:
    """``section.key: type = default [min, max]`` for every key: the snapshot test compares these."""
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.append(f"{section}.{f.name}: {_type_name(hints[f.name])} = {_show(_default(f))}{_range(f)}")
    return out


def _range(f: dataclasses.Field) -> str:
    low, high = f.metadata.get("min"), f.metadata.get("max")
    return "" if low is None and high is None else f"  [{low:_}, {high:_}]"


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
