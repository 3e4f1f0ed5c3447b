"""``harness.cuda_graphs``: the one graph cache behind Phi-Mamba's and transformers' decode graphs and the
trainer's graphed steps, and its one failure policy. A capture that fails or memory that runs out (raised here
where a real capture would raise them: capture and replay need CUDA) turns the graphs off with one warning, and
every user goes on eagerly with the eager path's numbers; a step the graphs do not cover is answered with None
and run by the caller."""
from __future__ import annotations

import logging

import pytest
import torch

from harness.backends.base import GenRequest
from harness.cuda_graphs import ROW_BUCKETS, CaptureFailed, GraphCache, capacity_bucket, row_bucket
from tests.helpers import assert_varied
from tests.helpers import diverse_prompts

FAILURES = {"capture": lambda: CaptureFailed("operation not permitted when stream is capturing"),
            "memory": lambda: torch.cuda.OutOfMemoryError("CUDA out of memory")}


def test_buckets_cover_what_they_should():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64] and row_bucket(65) is None
    assert ROW_BUCKETS[-1] == 64 and capacity_bucket(1) == 256 and capacity_bucket(257) == 320


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_cache_that_fails_gives_up_once_with_a_warning_and_covers_nothing_after(failure, caplog):
    cache = GraphCache("test steps", capture=False)

    def build(pool):
        raise FAILURES[failure]()

    with caplog.at_level(logging.WARNING, logger="harness"):
        assert cache.attempt(lambda: cache.replay("k", build)) is None
    assert cache.disabled and not cache.covers("k") and cache.describe().startswith("eager (")
    assert sum("off for the rest of this run" in r.message for r in caplog.records) == 1


def test_an_error_that_is_no_capture_failure_is_raised_not_hidden():
    cache = GraphCache("test steps", capture=False)

    def build(pool):
        raise RuntimeError("shape mismatch in the step itself")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        cache.attempt(lambda: cache.replay("k", build))
    assert cache.disabled is None


@torch.no_grad()
def test_a_capture_that_fails_after_its_warm_up_leaves_the_buffers_state_as_it_was(hybrid_backend, monkeypatch):
    """A Phi-Mamba graph's warm-up runs the real step on the static buffers, where a resident decoding state lives
    between steps; when the capture that follows fails, the recurrent state and positions there must be what they
    were (the run goes on eagerly from them). Capture is simulated on a CPU: a ``record`` that runs the recipe's
    warm-up, then fails."""
    import harness.cuda_graphs as cg
    from harness.models.decode_graphs import _Graph, _replaced_by_a_step, _StaticBuffers

    model = hybrid_backend.model
    buf = _StaticBuffers(model, 2, 256, "cpu")
    g = torch.Generator().manual_seed(0)
    for t in _replaced_by_a_step(buf.view(2, 256)):
        t.copy_(torch.randint(3, 9, t.shape, generator=g) if not t.is_floating_point()
                else torch.randn(t.shape, generator=g, dtype=t.dtype))
    buf.ids.fill_(7)
    buf.mask.fill_(1)
    buf.visible[:, :4] = True
    buf.write_at.fill_(3)
    before = [t.clone() for t in _replaced_by_a_step(buf.view(2, 256))]
    warmed = []

    def record(step, device, pool=None, warm=True):
        step.run()  # the recipe's warm-up on a side stream: a real step on the buffers
        warmed.append([t.clone() for t in _replaced_by_a_step(step.state)])
        raise cg.CaptureFailed("operation not permitted when stream is capturing")

    monkeypatch.setattr(cg.ReplayedStep, "record", record)
    with pytest.raises(cg.CaptureFailed):
        _Graph(model, buf, 2, 256, capture=True, pool=None)
    assert any(not torch.equal(a, b) for a, b in zip(warmed[0], before))  # the warm-up did move the state
    assert all(torch.equal(a, b) for a, b in zip(_replaced_by_a_step(buf.view(2, 256)), before))


@torch.no_grad()
@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("which", ["hybrid_backend", "phi_backend"])
def test_decode_graphs_that_fail_mid_run_fall_back_to_eager_tokens(which, failure, request, monkeypatch):
    """Graphs serve the first buckets, then building one more fails: the run goes on eagerly, through the state
    the graphs held (the previous owner keeps its own copy), and every token is the eager backend's."""
    backend = request.getfixturevalue(which)
    prompts = diverse_prompts(5, seed=4)
    eager = backend.generate([GenRequest(p, 16) for p in prompts], batch_size=5)
    assert_varied([r.token_ids for r in eager])
    if which == "hybrid_backend":
        from harness.models.decode_graphs import GraphedDecode as Graphs
    else:
        from harness.backends.kv_decode_graphs import GraphedKVDecode as Graphs
    graphs = Graphs(backend.model, capture=False)
    built = []
    real = graphs.new_graph

    def new_graph(rows, capacity, pool, compiled):
        if len(built) == 1:  # the second graph: a batch that shrank to another bucket
            raise FAILURES[failure]()
        built.append((rows, capacity))
        return real(rows, capacity, pool, compiled)

    monkeypatch.setattr(graphs, "new_graph", new_graph)
    backend.graphs = graphs
    try:
        got = backend.generate([GenRequest(p, 4 + 3 * i) for i, p in enumerate(prompts)], batch_size=5)
        again = backend.generate([GenRequest(p, 16) for p in prompts], batch_size=5)
    finally:
        backend.graphs = None
    want = backend.generate([GenRequest(p, 4 + 3 * i) for i, p in enumerate(prompts)], batch_size=5)
    assert len(built) == 1 and graphs.disabled and graphs.buffers is None
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.token_ids for r in again] == [r.token_ids for r in eager]


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_training_steps_whose_capture_fails_train_eagerly_as_plain_steps_do(failure, monkeypatch):
    from harness.training.config import TrainConfig
    from harness.training.data import TrainingBatches, TrainTask
    from harness.training.step import new_model, new_optimizer, optimizer_step
    from harness.training.step_graphs import WARMUP, GraphedSteps

    cell = TrainConfig(arch="transformer", size="smoke", nodes=4, setup="cot", report_to="none").resolved()
    task = TrainTask(cell)
    ids, mask = TrainingBatches(task, 4, cell.seed, 0).pool(0)[0]

    def train(graphed: bool):
        torch.manual_seed(0)
        model = new_model(cell, task)
        opt = new_optimizer(cell, model, torch.device("cpu"), graphs=True)
        step = GraphedSteps(model, opt, "cpu", False, capture=False) if graphed else None
        if step is not None:
            monkeypatch.setattr(step, "_build", lambda *a: (_ for _ in ()).throw(FAILURES[failure]()))
        losses = [float((step(ids, mask) if step else optimizer_step(model, opt, ids, mask,
                                                                     torch.autocast("cpu", enabled=False))).detach())
                  for _ in range(WARMUP + 3)]
        return losses, step

    plain, _ = train(False)
    losses, step = train(True)
    assert len(set(plain)) > 1 and losses == pytest.approx(plain, rel=1e-6)
    assert step.disabled and step.replays == 0 and step.describe().startswith("eager (")


@pytest.mark.parametrize("mode", [True, False, "yes", None])
def test_a_graph_mode_that_is_not_auto_on_compiled_or_off_is_refused_not_read_as_off(mode):
    """The decode table once passed True/False: both read as "off", so its "(graphs)" rows timed eager steps."""
    from harness.backends import backend_class, graphs_compiled, graphs_used
    cls = backend_class("phi-mamba")
    assert graphs_used("on", cls, "cpu") and not graphs_used("off", cls, "cuda") and graphs_used("auto", cls, "cuda")
    assert graphs_used("compiled", cls, "cuda") and graphs_compiled("compiled", cls, "cuda")
    assert not graphs_compiled("on", cls, "cuda") and not graphs_compiled("auto", cls, "cuda")
    with pytest.raises(ValueError, match="give one of auto, on, compiled, off"):
        graphs_used(mode, cls, "cuda")


def test_many_rows_attend_over_tighter_capacities_within_the_same_buffers():
    from harness.cuda_graphs import FINE_ROWS, attended_capacity

    for n in range(1, 9000):
        bucket, fine = capacity_bucket(n), attended_capacity(n, FINE_ROWS)
        assert attended_capacity(n, FINE_ROWS - 1) == bucket and n <= fine <= bucket and fine % 64 == 0
        if n > 1024:
            assert fine <= 1.0625 * n
    assert attended_capacity(2049, 64) == 2176 and capacity_bucket(2049) == 2560
