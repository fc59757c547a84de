"""Batch buffers: pinned memory as torch rounds it."""

from __future__ import annotations

import pytest


pytestmark = pytest.mark.timeout(60)


def test_pinned_footprint_is_torchs_power_of_two_rounding():
    from stoker.engine.buffers import pinned_footprint

    assert [pinned_footprint(n) for n in (0, 1, 3, 4096, 4097)] == [0, 1, 4, 4096, 8192]
    assert pinned_footprint(40 << 20) == 64 << 20 and pinned_footprint(64 << 20) == 64 << 20

