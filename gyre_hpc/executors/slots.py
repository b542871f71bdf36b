"""Where queued executions go: the executor nodes with the most free slots first.

Pure: no I/O, no clock. The hub calls it whenever slots free up or work arrives, so placement
is by free slots at that moment, and a burst spreads evenly over nodes of equal size.
"""

from __future__ import annotations

from collections.abc import Mapping


def place(free: Mapping[str, int], queued: int) -> list[str]:
    """The node for each of the first ``queued`` executions, as far as free slots go: each to a
    node with the most free slots left (ties by name). Shorter than ``queued`` when slots run out."""
    left = {node: n for node, n in free.items() if n > 0}
    out: list[str] = []
    while left and len(out) < queued:
        node = min(left, key=lambda k: (-left[k], k))
        out.append(node)
        left[node] -= 1
        if not left[node]:
            del left[node]
    return out
