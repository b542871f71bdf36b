"""What one load moved into an engine: the figures of a ``weights_loaded`` event.

A value shared by the engines that push (``engines.sglang``, ``engines.hosted``) and the cell
protocol that reports it; it knows nothing of how the bytes travelled.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Pushed:
    """What one load moved into an engine: bytes sent, bytes of the same version whole in the
    served dtype, and the elements that changed since the version the engine held (None where
    the path does not look: every mode but delta, or a sum with any part of those)."""

    sent: int = 0
    whole: int = 0
    changed: int | None = None
    elements: int = 0

    def __add__(self, other: Pushed) -> Pushed:
        """Together; ``Pushed()`` (a part that loads nothing) adds nothing."""
        if not other.elements:
            return self
        if not self.elements:
            return other
        changed = None if self.changed is None or other.changed is None else self.changed + other.changed
        elements = self.elements + other.elements
        return Pushed(
            sent=self.sent + other.sent, whole=self.whole + other.whole, changed=changed, elements=elements
        )

    @property
    def changed_fraction(self) -> float | None:
        if self.changed is None or not self.elements:
            return None
        return self.changed / self.elements
