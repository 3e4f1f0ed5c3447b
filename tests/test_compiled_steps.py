"""The inductor-compiled decode step (harness.compiled_steps) inside the harness's graphs, capture off: on a CPU
inductor compiles the same step to C++, so the graphs' static-buffer code runs the compiled step here exactly
as it is captured on a GPU. Greedy output must be the eager backend's (outputs that vary, rows leaving the
batch, more than one row and capacity bucket); a compiled step that fails to compile or parts from the eager
one is dropped for the run, the graphs going on with the eager step."""
from __future__ import annotations

import logging

import pytest
import torch

from harness.backends.base import GenRequest
from harness.compiled_steps import CompiledStep, CompileRefused, parted
from tests.helpers import HEADER, QUESTIONS, assert_varied

# slow: inductor compiles C++ on a CPU, seconds a shape; one worker for the module, so its start-up is paid once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("inductor")]


def _requests():
    """Six prompts past 256 tokens and up; three stop after 6 new tokens, three after 10: the rows' bucket goes
    from 8 to 4, two graphs of one compiled function (dynamic shapes; one row would be compiled apart)."""
    return [GenRequest(f"{HEADER * (1 + 2 * i)}Question: {q}\nAnswer:", 6 if i < 3 else 10)
            for i, q in enumerate(QUESTIONS[:6])]


@torch.no_grad()
@pytest.mark.parametrize("which", ["phi_backend", "hybrid_backend"])
def test_the_compiled_graphed_step_decodes_the_eager_tokens(which, request, caplog):
    backend = request.getfixturevalue(which)
    if which == "hybrid_backend":
        from harness.models.decode_graphs import GraphedDecode as Graphs
    else:
        from harness.backends.kv_decode_graphs import GraphedKVDecode as Graphs
    eager = [r.token_ids for r in backend.generate(_requests(), batch_size=6)]
    assert_varied(eager)
    graphs = Graphs(backend.model, capture=False, compile=True)
    backend.graphs = graphs
    try:
        with caplog.at_level(logging.INFO, logger="harness"):
            got = [r.token_ids for r in backend.generate(_requests(), batch_size=6)]
    finally:
        backend.graphs = None
    assert got == eager
    # every graph built ran the compiled step, each checked against the eager step at its first step
    assert graphs.compiled.disabled is None and graphs.compiled.checked == len(graphs.cache.graphs) >= 2
    assert len({rows for rows, _ in graphs.cache.graphs}) >= 2  # rows left the batch: another bucket
    assert "compiled (inductor" in graphs.describe()


def _noisy(x):
    return x + 1e-3 * torch.rand_like(x)  # inductor draws its own random numbers: compiled != eager


def _branchy(x):
    return x * 2 if x.sum() > 0 else x  # a branch on a tensor's value: no whole graph to compile


@pytest.mark.parametrize("fn, why", [(_noisy, "parted from the eager one"), (_branchy, "compiling failed")])
def test_a_compiled_step_that_parts_or_fails_is_refused_and_the_eager_one_runs(fn, why):
    x = torch.randn(3, 40)
    step = CompiledStep(fn, "test step")
    with pytest.raises(CompileRefused, match=why):
        step.first(lambda: step(x), lambda: fn(x), "3 rows")
    step.give_up("refused")
    torch.manual_seed(0)
    want = fn(x)
    torch.manual_seed(0)
    assert torch.equal(step(x), want)  # off: the function itself runs
    assert "off (refused)" in step.describe()


def test_logits_part_on_a_flipped_token_unless_it_was_a_near_tie():
    eager = torch.tensor([[1.0, 3.0, 2.99995], [0.5, -1.0, 4.0]])
    assert parted(eager.clone(), eager) is None
    near_tie = eager.clone()
    near_tie[0, 2] += 1e-4  # row 0's argmax flips within what the two steps differ by: a near-tie, allowed
    assert near_tie.argmax(-1)[0] != eager.argmax(-1)[0] and parted(near_tie, eager) is None
    flipped = eager.clone()
    flipped[1, 0] += 3.6  # apart by far more than float32 rounding
    assert "apart by" in parted(flipped, eager)


def test_the_decode_table_names_a_compiled_step_that_went_off(phi_backend):
    """A decode-table row measured with the compiled step off says so and why (the timing is the graphs')."""
    from harness.backends.kv_decode_graphs import GraphedKVDecode
    from harness.tools.checks import _graphs_off

    phi_backend.graphs = GraphedKVDecode(phi_backend.model, capture=False, compile=True)
    try:
        assert _graphs_off(phi_backend, "compiled") is None and _graphs_off(phi_backend, "off") is None
        phi_backend.graphs.compiled.give_up("logits apart by 3")
        assert _graphs_off(phi_backend, "compiled") == "graphs, compiled step off: logits apart by 3"
        assert "compiled step off (logits apart by 3)" in phi_backend.describe().decode
    finally:
        phi_backend.graphs = None
