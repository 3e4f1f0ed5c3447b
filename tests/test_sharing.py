"""Cells sharing a device (harness/training/sharing.py) with real processes: a failing cell is named, not waited on."""
from __future__ import annotations

import time

import pytest

from harness.training.sharing import shared_rate


def test_a_cell_that_cannot_start_is_named_and_its_partners_released():
    """One bad cell in K: every process is released from the barrier (no hang until its timeout) and the error
    names what failed."""
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="2 cells side by side: .*nodes"):
        shared_rate({"arch": "mamba", "size": "smoke", "nodes": -3, "setup": "direct"}, 2, "cpu", 2, 0.2)
    assert time.perf_counter() - t < 120
