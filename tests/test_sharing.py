"""Cells sharing a device (harness/training/sharing.py) with real processes: a failing cell is named, not waited on."""
from __future__ import annotations

import time

import pytest

from harness.training.sharing import shared_rate, sharing_table, supported_gain


def test_a_cell_that_cannot_start_is_named_and_its_partners_released():
    """One bad cell in K: every process is released from the barrier (no hang until its timeout) and the error
    names what failed."""
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="2 cells side by side: .*nodes"):
        shared_rate({"arch": "mamba", "size": "smoke", "nodes": -3, "setup": "direct"}, 2, "cpu", 2, 0.2)
    assert time.perf_counter() - t < 120


def test_cells_on_streams_of_one_process_each_take_every_round():
    """K cells in one process (on a CPU the streams are the same code, one after another): every cell steps in
    every round, the rows say which way they shared, and each way's supported K is read apart."""
    rows = []
    best = sharing_table({"short": {"arch": "mamba", "size": "smoke", "nodes": 4, "setup": "direct"}}, [1, 2], "cpu",
                         2, 0.3, rows.append, ways=("streams",))
    assert [(r["way"], r["K"]) for r in rows] == [("streams", 1), ("streams", 2)]
    assert all(r["samples_per_s"] > 0 and len(set(r["steps_each"])) == 1 and r["steps_each"][0] >= 1 for r in rows)
    assert list(best) == ["short (streams)"] or best == {}  # a CPU's K=2 may not fit its cores
    assert supported_gain(best, "processes") is None
    assert all(r["build_s"] > 0 for r in rows)  # what building K copies costs, beside their rate


def test_copies_of_a_cell_generate_its_data_once():
    """A copy handed another's data steps on those very batches (no second generation: on an H100 the quick
    suite's sharing step finished only K = 1 of the n=64 cell within its 100 s) and reports the same generation
    cost."""
    import torch

    from harness.training.config import TrainConfig
    from harness.training.grid import cell_steps

    cfg = TrainConfig(arch="mamba", size="smoke", nodes=4, setup="direct", report_to="none").resolved()
    first = cell_steps(cfg, torch.device("cpu"), 2, draws=2)
    copy = cell_steps(cfg, torch.device("cpu"), 2, data=(first.drawn, first.gen_s_per_sample))
    assert copy.drawn is first.drawn and len(first.drawn) >= 1 and copy.gen_s_per_sample == first.gen_s_per_sample
    copy.step(first.drawn[0])
    first.step(first.drawn[0])
