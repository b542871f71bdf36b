"""Hidden checks: a call into the workspace's code and the value it must return, compared out of
the tested code's reach, types included.

A check is ``{"module": "pkg.part0", "call": "add(2, 3)", "expect": "5"}``: the test bench imports
``module`` in the scoring sandbox, evaluates ``call`` in its namespace and reports the value as
typed JSON (``testbench.encode``). ``expect`` is a Python literal, read here and never shown to
the sandbox, so a forged report would have to know the answers. ``same`` compares exactly: the
same builtin type at every level (ints and floats compare as numbers, ``True`` is not ``1``), so an
object whose ``__eq__`` is always true, or a subclass of ``int`` that lies, equals nothing.

The task format checks a check's shape (``tasks.task``); this module knows nothing of sandboxes
or tasks: values in, a verdict out.
"""

from __future__ import annotations

import ast
import math
from typing import Any

_UNCOMPARABLE = object()


def decode(enc: Any) -> Any:
    """The value the test bench encoded; ``_UNCOMPARABLE`` for an object of any other type."""
    if not isinstance(enc, list) or len(enc) != 2 or not isinstance(enc[0], str):
        return _UNCOMPARABLE
    kind, v = enc
    try:
        if kind == "none":
            return None
        if kind == "bool" and isinstance(v, bool):
            return v
        if kind == "int" and isinstance(v, str) and len(v) < 5000:
            return int(v)
        if kind == "float" and isinstance(v, str):
            return float(v)
        if kind == "str" and isinstance(v, str):
            return v
        if kind == "bytes" and isinstance(v, str):
            return bytes.fromhex(v)
        if kind in ("list", "tuple", "set", "frozenset") and isinstance(v, list):
            items = [decode(x) for x in v]
            if any(x is _UNCOMPARABLE for x in items):
                return _UNCOMPARABLE
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
        if kind == "dict" and isinstance(v, list):
            out = {}
            for pair in v:
                if not (isinstance(pair, list) and len(pair) == 2):
                    return _UNCOMPARABLE
                key, value = decode(pair[0]), decode(pair[1])
                if key is _UNCOMPARABLE or value is _UNCOMPARABLE:
                    return _UNCOMPARABLE
                out[key] = value
            return out
    except (ValueError, TypeError, RecursionError):
        return _UNCOMPARABLE
    return _UNCOMPARABLE


def same(expected: Any, actual: Any) -> bool:
    """Whether ``actual`` (decoded) is ``expected``, with the same types at every level."""
    if actual is _UNCOMPARABLE:
        return False
    te, ta = type(expected), type(actual)
    numbers = (int, float)
    if te in numbers and ta in numbers:
        if te is float or ta is float:
            return math.isclose(float(expected), float(actual), rel_tol=1e-9, abs_tol=1e-12) or (
                math.isnan(float(expected)) and math.isnan(float(actual))
            )
        return expected == actual
    if te is not ta:
        return False
    if te in (list, tuple):
        return len(expected) == len(actual) and all(same(e, a) for e, a in zip(expected, actual, strict=True))
    if te is dict:
        if len(expected) != len(actual):
            return False
        for k, v in expected.items():
            match = [ka for ka in actual if same(k, ka)]
            if len(match) != 1 or not same(v, actual[match[0]]):
                return False
        return True
    if te in (set, frozenset):
        return len(expected) == len(actual) and all(any(same(e, a) for a in actual) for e in expected)
    return bool(expected == actual)


def expected(check: dict[str, str]) -> Any:
    return ast.literal_eval(check["expect"])
