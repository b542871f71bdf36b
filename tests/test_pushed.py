"""What loads moved, added up across a cell's replicas and a fleet's cells."""

from __future__ import annotations

from gyre_hpc.engines.pushed import Pushed


def test_loads_add_up_and_a_part_that_loads_nothing_adds_nothing() -> None:
    delta = Pushed(sent=10, whole=100, changed=5, elements=50)
    assert Pushed() + delta + Pushed() == delta  # a part across nodes, the fleet's start
    both = delta + Pushed(sent=30, whole=100, changed=10, elements=50)
    assert both == Pushed(sent=40, whole=200, changed=15, elements=100) and both.changed_fraction == 0.15
    whole = Pushed(sent=100, whole=100, elements=50)  # a path that does not look at changes
    assert (delta + whole).changed is None and (delta + whole).changed_fraction is None
    assert Pushed().changed_fraction is None
