"""Packed rows (``harness.models.packing``, ``--packing``): the same samples laid end to end train as padded rows
do. The scans and the causal convolution restart at each sample's first token (against each sample alone),
attention stays inside each sample, and per-sample losses and every parameter's gradient equal the padded
batch's on each architecture and scan, through the trainer's CLI too, step by step."""
from __future__ import annotations

import json

import pytest
import torch

from harness.models.masks import block_attention_mask
from harness.models.packing import pack, sample_lengths
from harness.ops.causal_conv import CausalConv
from harness.ops.selective_scan import Decays, SelectiveScan, sequential_scan
from harness.training.config import TrainConfig
from harness.training.data import PAD, TrainingBatches, TrainTask, packing_setting
from harness.training.step import logits_of, masked_loss, new_model

STARTS = {0: [0, 5, 6, 20], 1: [0, 7, 36], 2: [0]}  # several restarts, two in a row, one at the last step


def _starts(b: int, length: int) -> torch.Tensor:
    starts = torch.zeros(b, length)
    for row, at in STARTS.items():
        starts[row, at] = 1
    return starts


def _scan_inputs(b=3, d=6, n=4, length=37, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    u, z = torch.randn(b, d, length, generator=g), torch.randn(b, d, length, generator=g)
    dt = torch.rand(b, d, length, generator=g) * 0.5
    A, D = -torch.rand(d, n, generator=g) * 2, torch.randn(d, generator=g)
    B, C = torch.randn(b, n, length, generator=g), torch.randn(b, n, length, generator=g)
    return [t.to(dtype).requires_grad_() for t in (u, dt, A, B, C, D, z)]


@pytest.mark.parametrize("stored", [False, True])
def test_the_pytorch_scan_restarts_where_the_step_by_step_scan_does(stored, monkeypatch):
    """Output and every gradient against the sequential scan with the same restarts, both ways of computing the
    decays (per step on a CPU, stored elsewhere); and the restart is real: a sample equals itself alone."""
    monkeypatch.setitem(Decays.STORED, "cpu", stored)
    inputs = _scan_inputs()
    starts = _starts(3, 37)
    ref = sequential_scan(*inputs, starts=starts)
    ref_grads = torch.autograd.grad((ref * ref).sum() + ref.sum(), inputs)
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    got = SelectiveScan.apply(*leaves, starts)
    grads = torch.autograd.grad((got * got).sum() + got.sum(), leaves)
    for a, b in zip([ref, *ref_grads], [got, *grads]):
        assert ((a.float() - b).abs().max() / a.abs().max()).item() < 1e-5
    assert (SelectiveScan.apply(*leaves) - got).abs().max() > 0.1  # without restarts: different numbers
    u, dt, A, B, C, D, z = inputs
    alone = sequential_scan(u[:1, :, 6:20], dt[:1, :, 6:20], A, B[:1, :, 6:20], C[:1, :, 6:20], D, z[:1, :, 6:20])
    assert torch.allclose(alone.float(), got[:1, :, 6:20], atol=1e-5)


def test_the_convolution_restarts_at_each_sample():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 37, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    starts = _starts(3, 37)
    y = CausalConv.apply(x, w, bias, starts)
    for row, at in STARTS.items():
        for a, b in zip(at, [*at[1:], 37]):
            assert torch.allclose(y[row, a:b], CausalConv.apply(x[row:row + 1, a:b], w, bias)[0])
    assert not torch.allclose(y, CausalConv.apply(x, w, bias))
    assert torch.autograd.gradcheck(lambda *t: CausalConv.apply(*t, starts), (x, w, bias))


def test_the_hybrids_attention_mask_confines_each_query_to_its_sample():
    starts = _starts(3, 37)
    mask = block_attention_mask(torch.ones(3, 37, dtype=torch.long), 37, starts)[:, 0]
    sample = starts.cumsum(1)
    same = sample[:, :, None] == sample[:, None, :]
    causal = torch.ones(37, 37, dtype=torch.bool).tril()
    assert torch.equal(mask, same & causal)


class _AttentionCalls(torch.overrides.TorchFunctionMode):
    """Records each SDPA call's query length and whether it took a mask (the real kernel runs)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.calls.append((args[0].shape[0], args[0].shape[2], kwargs.get("attn_mask") is not None,
                               bool(kwargs.get("is_causal"))))
        return func(*args, **kwargs)


@pytest.mark.parametrize("arch", ["transformer", "hybrid"])
def test_packed_attention_runs_causally_on_each_sample_alone(arch):
    """Packed rows' attention is one causal, maskless call a sample (its own length), not a dense block mask
    over whole rows; without the spans (``packed_rows(starts)`` alone) the mask path gives the same logits."""
    from harness.models.packing import packed_rows

    task, ids, mask = _batch(8, 6)
    p = pack(ids, mask, task.vocab.index(PAD))
    cfg = TrainConfig(arch=arch, size="smoke", nodes=8, setup="retrieval", report_to="none").resolved()
    torch.manual_seed(0)
    model = new_model(cfg, task)
    layers = 1 if arch == "hybrid" else model.config.num_hidden_layers
    with torch.no_grad(), _AttentionCalls() as spans_mode:
        by_sample = logits_of(model, p.ids, p)
    lengths = sorted(n for _, _, n in p.where)
    assert len(set(lengths)) > 2 and len(spans_mode.calls) == layers * len(p.where)
    assert sorted(t for _, t, _, _ in spans_mode.calls) == sorted(lengths * layers)
    assert all(b == 1 and not masked and causal for b, _, masked, causal in spans_mode.calls)
    with torch.no_grad(), _AttentionCalls() as mask_mode, packed_rows(p.starts):
        by_mask = model(input_ids=p.ids, position_ids=p.positions, use_cache=False).logits
    assert len(mask_mode.calls) == layers and all(masked for *_, masked, _ in mask_mode.calls)
    real = torch.zeros_like(p.mask, dtype=torch.bool)  # every sample's tokens (a row's padded tail differs: no
    for row, at, n in p.where:  # loss reads it)
        real[row, at:at + n] = True
    assert torch.allclose(by_sample[real], by_mask[real], atol=1e-5)


def test_the_row_contexts_leave_a_compiled_forward_as_transformers_runs_it():
    """The packed and causal-row contexts are context variables, which dynamo cannot trace: a compiled forward
    (the decode graphs' ``--cuda-graphs compiled``) of the IsTree Transformer traces whole and gives the eager
    logits, inside those contexts too."""
    from harness.models.masks import causal_rows
    from harness.models.packing import packed_rows

    cfg = TrainConfig(arch="transformer", size="smoke", nodes=4, setup="direct", report_to="none").resolved()
    torch.manual_seed(0)
    model = new_model(cfg, TrainTask(cfg)).eval()
    ids = torch.randint(0, 20, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0  # a left-padded row: the mask matters
    forward = lambda i, m: model(input_ids=i, attention_mask=m).logits  # noqa: E731
    eager = forward(ids, mask)
    compiled = torch.compile(forward, fullgraph=True, backend="eager", dynamic=False)
    with torch.no_grad(), causal_rows(), packed_rows(torch.zeros(2, 9), [(0, 0, 9)]):
        inside = compiled(ids, mask)
    assert not torch.equal(eager[0], eager[1]) and torch.allclose(inside, eager, atol=1e-6)


def _batch(nodes: int, rows: int, setup: str = "retrieval"):
    cfg = TrainConfig(arch="mamba", size="smoke", nodes=nodes, setup=setup, report_to="none").resolved()
    task = TrainTask(cfg)
    return task, *TrainingBatches(task, rows, cfg.seed, 0).pool(0)[0]


def test_pack_lays_samples_end_to_end_in_fewer_rows():
    task, ids, mask = _batch(8, 12)
    pad = task.vocab.index(PAD)
    lengths = sample_lengths(ids, pad)
    assert len(set(lengths)) > 2  # lengths that vary: something to pack
    p = pack(ids, mask, pad)
    assert p.ids.shape[1] == ids.shape[1] and p.ids.shape[0] < ids.shape[0]
    for i, (row, at, n) in enumerate(p.where):
        assert n == lengths[i] and torch.equal(p.ids[row, at:at + n], ids[i, :n])
        assert torch.equal(p.mask[row, at:at + n], mask[i, :n]) and torch.equal(p.positions[row, at:at + n],
                                                                                torch.arange(n))
        assert p.starts[row, at] == 1 and p.starts[row, at + 1:at + n].sum() == 0
    assert p.mask.sum() == mask.sum() and p.starts.sum() == len(lengths)
    one_row = pack(ids, mask, pad, one_row=True)  # on a CPU: one row, no padding at all
    assert one_row.ids.shape == (1, sum(lengths)) and one_row.mask.sum() == mask.sum()
    assert torch.equal(one_row.ids[0], torch.cat([ids[i, :n] for i, n in enumerate(lengths)]))
    spread = torch.zeros_like(mask)
    spread[:, 0] = 1
    with pytest.raises(ValueError, match="first token is a loss target"):
        pack(ids, spread, pad)


@pytest.mark.parametrize("arch,scan,one_row", [("transformer", "auto", False), ("mamba", "torch", False),
                                            ("mamba", "sequential", False), ("hybrid", "torch", False),
                                            ("transformer", "auto", True), ("mamba", "torch", True),
                                            ("mamba", "sequential", True), ("hybrid", "torch", True)])
def test_packed_rows_give_the_padded_batchs_per_sample_losses_and_gradients(arch, scan, one_row):
    task, ids, mask = _batch(8, 6)
    p = pack(ids, mask, task.vocab.index(PAD), one_row)
    assert (p.ids.shape[0] == 1) == one_row
    cfg = TrainConfig(arch=arch, size="smoke", nodes=8, setup="retrieval", scan=scan, report_to="none").resolved()
    torch.manual_seed(0)
    model = new_model(cfg, task)
    results = []
    for packed in (None, p):
        model.zero_grad()
        i, m = (ids, mask) if packed is None else (p.ids, p.mask)
        logits = logits_of(model, i, packed)
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), i[:, 1:], reduction="none")
        ce = ce * m[:, 1:]
        if packed is None:
            per_sample = ce.sum(1)
        else:  # a sample's targets: its tokens after the first (the target of position t is token t + 1)
            per_sample = torch.stack([ce[row, at:at + n - 1].sum() for row, at, n in p.where])
        masked_loss(logits, i, m).backward()
        grads = torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])
        results.append((per_sample.detach(), grads))
    (l0, g0), (l1, g1) = results
    assert len({round(x, 4) for x in l0.tolist()}) > 3  # samples whose losses differ
    assert torch.allclose(l0, l1, rtol=1e-5, atol=1e-5), (l0, l1)
    assert ((g0 - g1).abs().max() / g0.abs().max()).item() < 1e-5


def test_auto_packs_cells_whose_batches_vary_in_length_and_not_the_others():
    retrieval = TrainConfig(arch="mamba", size="smoke", nodes=8, setup="retrieval", report_to="none").resolved()
    direct = TrainConfig(arch="mamba", size="smoke", nodes=4, setup="direct", report_to="none").resolved()
    on, share = packing_setting(retrieval, TrainTask(retrieval), 8)
    assert on == "on" and share <= 0.9
    assert packing_setting(direct, TrainTask(direct), 8)[0] == "off"
    transformer = TrainConfig(**{**vars(retrieval), "arch": "transformer"})  # each sample's own attention
    assert packing_setting(transformer, TrainTask(transformer), 8)[0] == "on"
    assert packing_setting(transformer, TrainTask(transformer), 8, device_type="cuda") == ("off", None)
    assert packing_setting(TrainConfig(**{**vars(retrieval), "packing": "off"}), TrainTask(retrieval), 8) == (
        "off", None)


@pytest.mark.parametrize("arch", ["transformer", "hybrid"])
def test_the_trainers_model_keeps_its_own_attention_after_set_up(arch, tmp_path, monkeypatch):
    """A run measures the model's decoding state through the eval engine before it trains, and the engine
    prepares a model for inference in place (on a CPU a Transformer's attention chunks long blocks under
    transformers' masks): the model the run trained must still attend per sample on packed rows (a spy around
    the real function)."""
    from harness.models import masks
    from harness.training.trainer import Trainer

    cfg = TrainConfig(arch=arch, size="smoke", nodes=8, setup="retrieval", samples=16, batch_size=8, eval_samples=8,
                      live_eval=False, report_to="none", packing="on", output=str(tmp_path)).resolved()
    trainer = Trainer(cfg, progress=False)
    trainer.run(overwrite=False)
    model = trainer.acc.unwrap_model(trainer.model)
    task, ids, mask = _batch(8, 6)
    p = pack(ids, mask, task.vocab.index(PAD), one_row=True)
    calls, real = [], masks.per_sample_attention
    monkeypatch.setattr(masks, "per_sample_attention", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    logits_of(model, p.ids, p)
    assert calls and all(spans == p.where for spans in calls)


@pytest.mark.parametrize("arch", ["transformer", "mamba", "hybrid"])
def test_a_packed_run_trains_as_the_padded_run_step_by_step(arch, tmp_path):
    """Through the trainer (fresh output folders, same seed): every logged loss equal, result.json saying which
    ran, and the run's identity keeping them apart."""
    from harness.training.trainer import train_one

    runs = {}
    for packing in ("off", "on"):
        cfg = TrainConfig(arch=arch, size="smoke", nodes=8, setup="retrieval", samples=64, batch_size=8,
                          eval_every=32, eval_samples=8, live_eval=False, report_to="none", packing=packing,
                          output=str(tmp_path / packing)).resolved()
        runs[packing] = train_one(cfg, progress=False)
    curve = {k: [c["loss"] for c in r["curve"]] for k, r in runs.items()}
    assert len(set(curve["off"])) > 1 and curve["on"] == pytest.approx(curve["off"], rel=1e-5)
    assert runs["on"]["packed_rows"]["ran"] == "on" and runs["off"]["packed_rows"]["ran"] == "off"
    packed = json.loads((tmp_path / "on" / "result.json").read_text())["packed_rows"]
    assert packed["packed_share"] < 1 and packed["layout"] == "one row a batch"  # on a CPU


def test_auto_resumes_a_run_as_it_began_and_reuses_a_finished_one(tmp_path):
    """A run started padded (before auto existed, or under --packing off) resumes padded under auto, and a
    finished run of off is reused under auto (how steps run is not what they compute)."""
    from harness.training.state import SETTINGS_FILE
    from harness.training.trainer import train_one

    base = dict(arch="mamba", size="smoke", nodes=8, setup="retrieval", samples=32, batch_size=8, eval_every=16,
                eval_samples=8, live_eval=False, report_to="none", output=str(tmp_path / "run"))
    done = train_one(TrainConfig(**base, packing="off").resolved(), progress=False)
    assert done["packed_rows"]["ran"] == "off"
    assert train_one(TrainConfig(**base).resolved(), progress=False) == done  # auto: reused, not refused
    settings = json.loads((tmp_path / "run" / SETTINGS_FILE).read_text())
    (tmp_path / "run" / "result.json").unlink()  # as if killed before it finished: resumed under auto
    resumed = train_one(TrainConfig(**base).resolved(), progress=False)
    assert resumed["packed_rows"]["ran"] == "off"
    assert json.loads((tmp_path / "run" / SETTINGS_FILE).read_text()) == settings


def test_packed_rows_cut_into_segments_attend_as_one_sample_a_call():
    """The varlen layout (``harness.ops.varlen_attention``): the rows' tokens in flattened order cut into each
    sample and each stretch outside the samples; attention over those segments (here one SDPA call a segment, the
    contract flash's varlen kernel keeps on a GPU) equals ``per_sample_attention``'s, output and gradients, with
    zeros outside the samples."""
    import torch.nn.functional as F

    from harness.models.masks import per_sample_attention
    from harness.ops import varlen_attention as va

    # row 0: two samples and a tail; row 1: one sample; row 2: a head stretch, two samples, no tail
    spans = [(0, 0, 10), (0, 10, 12), (1, 0, 29), (2, 3, 5), (2, 8, 21)]
    cuts, inside = va.packed_segments(spans, 3, 29)
    assert cuts == [0, 10, 22, 29, 58, 61, 66, 87] and int(inside.sum()) == 10 + 12 + 29 + 5 + 21
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 4, 29, 8, generator=g, dtype=torch.float64) for _ in range(3))
    w = torch.randn(3, 29, 4, 8, generator=g, dtype=torch.float64)
    out = []
    for attend in ("segments", "per sample"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if attend == "segments":
            y = va.segmented_attention(va.sdpa_segments(None), *leaves, spans)
        else:
            y = per_sample_attention(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)
                                     .transpose(1, 2), *leaves, spans)[0]
        out.append([y, *torch.autograd.grad((y * w).sum(), leaves)])
    assert out[1][0].std() > 0.1 and (out[1][0][0, 22:] == 0).all()  # varied; the tail zero
    # the segments reach the device once a packed batch (each layer reads the same spans object), not once a layer
    bounds = va._last[4]
    va.segmented_attention(va.sdpa_segments(None), q, k, v, spans)
    assert va._last[4] is bounds and bounds.tolist() == cuts
    va.segmented_attention(va.sdpa_segments(None), q, k, v, list(spans))
    assert va._last[4] is not bounds
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(*out))
    # flash's varlen kernel, in this torch's signature, made causal; used only on CUDA, after its check
    assert va.flash_varlen(None) is not None and va.flash_varlen(0.25).keywords["scale"] == 0.25
    assert va.verified_on("cpu", torch.bfloat16, 4, 8, None) is False
