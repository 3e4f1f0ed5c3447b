"""The trainer's parallel Mamba scan against the step-by-step recurrence and against transformers' own Mamba:
outputs, the loss and every gradient in float32 at lengths that are and are not multiples of any chunk, bf16
autocast within its tolerance, and cached decoding left on the library's path."""
import pytest
import torch
from transformers import MambaForCausalLM

from harness.ops import selective_scan as ss
from harness.models.istree import ScanMixer, build_model, freeze_sinusoidal_embedding, mamba_ssm_init_
from harness.training.step import masked_loss
from tests.helpers import bf16_errors_against_float64


def _inputs(b, d, n, length, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    A = -torch.exp(torch.rand(d, n, generator=g) * 3)  # decays from mild to strong, as trained models reach
    args = [torch.randn(b, d, length, generator=g), torch.randn(b, d, length, generator=g) * 2, A,
            torch.randn(b, n, length, generator=g), torch.randn(b, n, length, generator=g)]
    extra = [torch.randn(d, generator=g), torch.randn(b, d, length, generator=g), torch.randn(d, generator=g)]
    return [t.to(dtype).requires_grad_() for t in args + extra]


def _run(scan, inputs, weight):
    u, dt, A, B, C, D, z, bias = inputs
    y = scan(u, dt, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True)
    loss = (y.float() * weight).sum()
    return [y, loss, *torch.autograd.grad(loss, inputs)]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("length", [1, 2, 3, 5, 17, 48, 127, 455, 1001, 2600])
def test_parallel_scan_equals_the_sequential_recurrence(length):
    inputs = _inputs(2, 6, 4, length, seed=length)
    weight = torch.randn(2, 6, length, generator=torch.Generator().manual_seed(1))
    fast, slow = _run(ss.selective_scan, inputs, weight), _run(ss.sequential_scan, inputs, weight)
    assert slow[0].std() > 0.1 and all(g.abs().max() > 0 for g in slow[2:] if length > 1)  # compared values vary
    worst = {name: _rel(a, b) for name, a, b in zip(["y", "loss", "du", "ddt", "dA", "dB", "dC", "dD", "dz", "dbias"],
                                                    fast, slow)}
    if length == 1:
        worst.pop("dA")  # dL/dA is exactly 0 at one step (the state before it is zero): no relative error
        assert fast[4].abs().max() == 0 and slow[4].abs().max() == 0
    assert max(worst.values()) < 1e-5, worst


@pytest.mark.parametrize("skip,gate", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("layout", ["contiguous", "time-major"])
def test_without_skip_or_gate_and_in_either_memory_layout(skip, gate, layout):
    """The skip ``D`` and the gate ``z`` are applied inside the scan: each left out alone still matches, and so
    do inputs stored [batch, time, channels] (the mixer passes transposed views), whose outputs keep that layout."""
    u, dt, A, B, C, D, z, bias = _inputs(3, 5, 4, 70, seed=11)
    if layout == "time-major":
        u, dt, B, C, z = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                          for t in (u, dt, B, C, z))
    inputs = [u, dt, A, B, C, D if skip else None, z if gate else None, bias]
    weight = torch.randn(3, 5, 70, generator=torch.Generator().manual_seed(4))

    def run(scan):
        y = scan(*inputs[:5], D=inputs[5], z=inputs[6], delta_bias=bias, delta_softplus=True)
        used = [t for t in inputs if t is not None]
        return [y, *torch.autograd.grad((y * weight).sum(), used)]

    fast, slow = run(ss.selective_scan), run(ss.sequential_scan)
    assert slow[0].std() > 0.1
    assert max(_rel(a, b) for a, b in zip(fast, slow)) < 1e-5
    if layout == "time-major":
        assert fast[0].transpose(1, 2).is_contiguous() and fast[1].transpose(1, 2).is_contiguous()


def test_row_groups_and_chunks_do_not_change_the_result(monkeypatch):
    """Rows scanned in groups (bounded memory) give what one group gives; chunk starts carry state exactly."""
    inputs = _inputs(5, 4, 3, 61, seed=3)
    weight = torch.randn(5, 4, 61, generator=torch.Generator().manual_seed(2))
    whole = _run(ss.selective_scan, inputs, weight)
    monkeypatch.setitem(ss.GROUP_ELEMENTS, "cpu", 4 * 3 * 64 * 2)  # two rows a group: 3 groups
    grouped = _run(ss.selective_scan, inputs, weight)
    assert all(_rel(a, b) < 1e-6 for a, b in zip(grouped, whole))


def test_decays_stored_for_all_steps_match_decays_computed_per_step(monkeypatch):
    """A GPU computes a group's decays once for all steps, a CPU per step as read: both ways agree."""
    inputs = _inputs(3, 5, 4, 200, seed=9)
    weight = torch.randn(3, 5, 200, generator=torch.Generator().manual_seed(6))
    per_step = _run(ss.selective_scan, inputs, weight)
    monkeypatch.setitem(ss.Decays.STORED, "cpu", True)
    assert ss.Decays(torch.rand(2, 1, 1, 3), -torch.rand(4, 3)).all is not None  # the stored path runs
    stored = _run(ss.selective_scan, inputs, weight)
    assert per_step[0].std() > 0.1 and all(g.abs().max() > 0 for g in per_step[2:])
    assert max(_rel(a, b) for a, b in zip(stored, per_step)) < 1e-6


def test_bf16_autocast_is_within_the_usual_tolerance():
    inputs = _inputs(2, 8, 4, 300, seed=5)
    weight = torch.randn(2, 8, 300, generator=torch.Generator().manual_seed(3))
    ref = _run(ss.sequential_scan, inputs, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = _run(ss.selective_scan, [t.detach().bfloat16().requires_grad_() for t in inputs], weight)
    assert low[0].dtype == torch.bfloat16
    assert _rel(low[1], ref[1]) < 2e-2 and _rel(low[0].float(), ref[0].float()) < 2e-2


def _pair(arch, seed=0):
    """A trainer model (its mixers are ScanMixers) and the same weights in transformers' own Mamba classes."""
    torch.manual_seed(seed)
    ours = build_model(arch, "smoke", 30)
    assert all(isinstance(b.mixer, ScanMixer) for b in ours.backbone.layers)
    if arch == "mamba":
        plain = MambaForCausalLM(ours.config)
    else:
        plain = type(ours)(ours.config)
    plain.load_state_dict(ours.state_dict())
    freeze_sinusoidal_embedding(plain)  # trained as the trainer trains: the embedding frozen
    assert not any(isinstance(b.mixer, ScanMixer) for b in plain.backbone.layers)
    return ours, plain


@pytest.mark.parametrize("arch", ["mamba", "hybrid"])
def test_trainer_models_equal_transformers_mamba_in_loss_and_every_gradient(arch):
    ours, plain = _pair(arch)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30, (3, 77), generator=g)
    mask = (torch.rand(3, 77, generator=g) > 0.3).float()
    results = []
    for model in (ours, plain):
        model.zero_grad()
        loss = masked_loss(model(input_ids=ids).logits, ids, mask)
        loss.backward()
        results.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}))
    (l1, g1), (l2, g2) = results
    assert g1.keys() == g2.keys() and len(g1) > 10
    assert _rel(l1, l2) < 1e-5
    worst = max(_rel(g1[k], g2[k]) for k in g1)
    assert worst < 1e-4, worst  # gradients through 3 layers (and attention) of float32 rounding


def test_padding_mask_and_cached_decoding_match_transformers():
    ours, plain = _pair("mamba", seed=1)
    ids = torch.randint(0, 30, (2, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0  # a left-padded row
    with torch.no_grad():
        a, b = ours(input_ids=ids, attention_mask=mask).logits, plain(input_ids=ids, attention_mask=mask).logits
    assert a.std() > 0 and _rel(a, b) < 1e-5
    one = ids[:1, :8]
    outs = [m.generate(one, max_new_tokens=12, do_sample=False, pad_token_id=4, output_scores=True,
                       return_dict_in_generate=True) for m in (ours, plain)]
    steps = [torch.cat(o.scores) for o in outs]  # the logits of every cached step
    assert (steps[0][1:] - steps[0][:-1]).abs().max() > 1e-3  # the steps differ
    assert torch.equal(outs[0].sequences, outs[1].sequences) and _rel(steps[0], steps[1]) < 1e-5


def test_a_trained_mamba_saves_as_a_plain_transformers_model(tmp_path):
    ours, _ = _pair("mamba")
    ours.save_pretrained(tmp_path)
    loaded = MambaForCausalLM.from_pretrained(tmp_path)
    assert not any(isinstance(b.mixer, ScanMixer) for b in loaded.backbone.layers)
    ids = torch.randint(0, 30, (1, 15), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert _rel(ours(input_ids=ids).logits, loaded(input_ids=ids).logits) < 1e-5


def test_building_a_model_draws_the_same_random_numbers_as_before():
    """Owning the mixer consumes no random numbers: a seed builds the weights it built before the change."""
    torch.manual_seed(0)
    ours = build_model("mamba", "smoke", 30)
    after = torch.rand(1)
    torch.manual_seed(0)
    plain = MambaForCausalLM(ours.config)
    mamba_ssm_init_(plain.backbone)
    freeze_sinusoidal_embedding(plain)
    assert torch.equal(torch.rand(1), after)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), plain.state_dict().values()))


@pytest.fixture(scope="module")
def selective_scan_ref():
    """mamba-ssm's own reference scan (plain PyTorch) from its sdist, imported with stand-ins for its CUDA
    extension; skipped, saying so, where the package index cannot be reached."""
    import os

    from harness.cache import cache_dir
    from harness.ops import kernels

    try:
        src = kernels.fetch_mamba_ssm_sources(cache_dir())
    except OSError as e:
        pytest.skip(f"mamba-ssm sources: {e}")
    old = os.environ.get("ICR_MAMBA_SSM_SRC")
    os.environ["ICR_MAMBA_SSM_SRC"] = str(src)
    try:
        with kernels.carried_sources():
            from mamba_ssm.ops.selective_scan_interface import selective_scan_ref as ref
    finally:
        os.environ.pop("ICR_MAMBA_SSM_SRC") if old is None else os.environ.__setitem__("ICR_MAMBA_SSM_SRC", old)
    return ref


def test_bf16_step_sizes_in_float32_keep_gradients_near_mamba_ssms_reference(selective_scan_ref):
    """bf16 activations, float32 parameters (as the trainer's autocast gives them) and Mamba's step-size biases:
    the output and every gradient within 1.3x of mamba-ssm's reference scan's error, against float64 (the Triton
    scan's run of the same check: tests/test_scan_triton.py)."""
    worse = bf16_errors_against_float64(ss.selective_scan, selective_scan_ref)
    assert not worse, worse


def test_the_trainers_result_names_the_scan_that_ran(tmp_path):
    import json

    from harness.training.config import TrainConfig
    from harness.training.trainer import train_one

    base = dict(size="smoke", nodes=4, setup="direct", samples=64, batch_size=16, eval_every=64, eval_samples=8,
                eval_batch_size=8, report_to="none", live_eval=False)
    res = train_one(TrainConfig(arch="mamba", **base, output=str(tmp_path / "m")).resolved(), progress=False)
    saved = json.loads((tmp_path / "m" / "result.json").read_text())["scans"]
    assert saved == res["scans"] and saved and {r["scan"] for r in saved} == {"torch"}  # a CPU: the PyTorch scan
    assert {r["dtype"] for r in saved} == {"float32"} and all(r["device"] == "cpu" for r in saved)
    assert res["scan"] == "auto" and res["steps_seconds"] <= res["train_seconds"]  # both rounded alike
    plain = train_one(TrainConfig(arch="transformer", **base, output=str(tmp_path / "t")).resolved(), progress=False)
    assert plain["scans"] == []  # one process, two runs: the Transformer ran no scan
    # the scan is the run's setting: the reference recurrence trains the same model to the same losses, and a
    # finished run's directory refuses another scan by name
    ref = train_one(TrainConfig(arch="mamba", **base, scan="sequential", output=str(tmp_path / "s")).resolved(),
                    progress=False)
    assert {r["scan"] for r in ref["scans"]} == {"sequential"} and ref["scan"] == "sequential"
    ours, theirs = [r["loss"] for r in res["curve"]], [r["loss"] for r in ref["curve"]]
    assert len(set(ours)) > 1 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)
    from harness.engine.config import ConfigError
    with pytest.raises(ConfigError, match="scan: 'sequential' there, 'auto' now"):
        train_one(TrainConfig(arch="mamba", **base, output=str(tmp_path / "s")).resolved(), progress=False)


def test_each_model_keeps_the_scans_its_mixers_chose():
    """The choice lives on the mixer that ran it (no process-wide record): two models run in turn in one process
    each read back their own scan; reading with ``forget`` starts a new record."""
    from harness.models.istree import build_model, scans_ran

    models = {scan: build_model("mamba", "smoke", 32, scan=scan) for scan in ("torch", "sequential")}
    ids = torch.randint(0, 32, (2, 9))
    for _ in range(2):
        for model in models.values():
            model(input_ids=ids)
    assert [[r["scan"] for r in scans_ran(m)] for m in models.values()] == [["torch"], ["sequential"]]
    assert scans_ran(models["torch"], forget=True) and scans_ran(models["torch"]) == []
