"""The pure parts of delta pushes (``engines.weight_delta``): which elements changed, when a delta
is worth sending, and the checksum both sides take. The loader itself runs inside real SGLang
(``tests/test_sglang.py``)."""

from __future__ import annotations

import torch

from gyre_hpc.engines import weight_delta as wd


def test_changes_are_bits_not_values() -> None:
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0], dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0  # equal as a float, another weight's bits
    new[3] = 2.015625  # the next bfloat16 after 2.0
    positions = wd.positions_of(wd.changed(new, old))
    assert positions.tolist() == [0, 3]  # NaN to the same NaN: unchanged
    assert positions.dtype == torch.int32


def test_a_delta_goes_only_where_it_is_smaller_than_the_bucket() -> None:
    # bfloat16: 6 bytes a changed element (position and value) against 2 an element whole.
    assert wd.worth_sending(333, 1000, 2) and not wd.worth_sending(334, 1000, 2)
    assert wd.worth_sending(499, 1000, 4) and not wd.worth_sending(500, 1000, 4)


def test_the_checksum_covers_every_byte_in_order() -> None:
    a, b = torch.randn(1000).to(torch.bfloat16), torch.randn(77, 3)
    whole = wd.checksum([a, b])
    assert wd.checksum([a, b.clone()]) == whole
    assert wd.checksum([b, a]) != whole  # order counts
    for at in (0, 500, 999):
        c = a.clone()
        c.view(torch.int16)[at] ^= 1  # one bit of one element
        assert wd.checksum([c, b]) != whole
    fused = torch.cat([a, a]).view(2, 1000)
    assert wd.checksum([fused.narrow(0, 1, 1)]) == wd.checksum([a])  # a slice of a fused tensor
