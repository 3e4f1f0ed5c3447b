"""A CPU's float32 linear layers through oneDNN (``harness/backends/onednn_linear.py``): a model's logits and
greedy tokens through the real backend equal the stock transformers model's within float32 rounding, with the
oneDNN op really called and the MLPs' GELUs in their layers' epilogue (a GELU that does not take a layer's output
alone is never folded); calls below the chosen row count, and calls with gradients, stay on PyTorch's own
kernel to the bit; the choice is measured once and remembered, is part of a CPU run's settings, and names a bad
``ICR_CPU_LINEAR`` value; packed weights give the plain weights' bits, follow a weight changed in place, and are
kept only where they fit the free memory."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from harness.backends import fused_activations, onednn_linear
from harness.backends.hf import TransformersBackend
from harness.backends.loading import load_backend

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.fixture
def forced(monkeypatch):
    """``ICR_CPU_LINEAR`` set for one test, the process's remembered choice forgotten before and after."""
    def force(value):
        monkeypatch.setenv("ICR_CPU_LINEAR", value)
        onednn_linear.choice.cache_clear()
    yield force
    onednn_linear.choice.cache_clear()


def _onednn_calls(fn) -> tuple[object, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")


def test_a_backend_on_onednn_equals_the_stock_model_in_logits_and_greedy_tokens(tiny_phi_dir, forced):
    forced("onednn")
    backend = TransformersBackend(tiny_phi_dir, device="cpu", dtype="float32")
    stock = AutoModelForCausalLM.from_pretrained(tiny_phi_dir, dtype=torch.float32).eval()
    swapped = sum(isinstance(m, onednn_linear.OneDNNLinear) for m in backend.model.modules())
    assert swapped == sum(type(m) is nn.Linear for m in stock.modules()) > 0
    folded = [layer.mlp for layer in backend.model.model.layers]  # each MLP's GELU in its fc1's epilogue
    assert all(type(m.fc1) is onednn_linear.OneDNNLinearGELU and type(m.activation_fn) is nn.Identity for m in folded)
    info = backend.describe()
    assert info.linear == onednn_linear.IDENTITY and any("oneDNN from 1 rows a call" in f for f in info.fused)
    assert any("oneDNN's epilogue" in f for f in info.fused)
    ids = torch.randint(5, 900, (3, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours, calls = _onednn_calls(lambda: backend.model(ids).logits)
        theirs = stock(ids).logits
        exact = stock.double()(ids).logits
        stock.float()
    assert calls >= swapped  # every layer ran oneDNN's op
    assert theirs.std() > 0.1 and len({int(t) for t in theirs[:, -1].argmax(-1)}) > 1  # the rows differ
    assert not torch.equal(ours, theirs)  # another kernel really ran ...
    errors = [float((x.double() - exact).abs().max()) for x in (ours, theirs)]
    assert errors[0] < 3 * errors[1] + 1e-6  # ... as close to the float64 model as the stock float32 one is
    prompts = [ids[i:i + 1, :20 + 9 * i] for i in range(3)]
    with torch.inference_mode():
        greedy = [stock.generate(p, max_new_tokens=12, do_sample=False)[0, p.shape[1]:].tolist() for p in prompts]
        mine = [backend.model.generate(p, max_new_tokens=12, do_sample=False)[0, p.shape[1]:].tolist()
                for p in prompts]
    assert len({tuple(g) for g in greedy}) == 3 and mine == greedy


def test_calls_below_the_chosen_rows_and_calls_with_gradients_run_pytorchs_own_kernel():
    torch.manual_seed(0)
    layer = nn.Linear(64, 96)
    plain = nn.Linear(64, 96)
    plain.load_state_dict(layer.state_dict())
    layer.__class__, layer.min_rows = onednn_linear.OneDNNLinear, 4
    few, many = torch.randn(2, 1, 64), torch.randn(3, 5, 64)
    with torch.inference_mode():
        out, calls = _onednn_calls(lambda: layer(few))
        assert calls == 0 and torch.equal(out, plain(few))
        out, calls = _onednn_calls(lambda: layer(many))
        assert calls == 1 and torch.allclose(out, plain(many), rtol=1e-5, atol=1e-6)
    grad_out, calls = _onednn_calls(lambda: layer(many.requires_grad_()))
    assert calls == 0 and grad_out.requires_grad and torch.equal(grad_out, plain(many))
    assert layer.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.parametrize("ratios, min_rows", [
    ({1: 0.9, 4: 1.6, 16: 1.7, 64: 1.9, 256: 2.2}, 4),
    ({1: 1.3, 4: 1.6, 16: 1.7, 64: 1.9, 256: 2.2}, 1),
    ({1: 1.3, 4: 1.0, 16: 1.7, 64: 1.9, 256: 2.2}, 16),  # a loss at 4 rows: from the next win on
    ({1: 1.3, 4: 1.5, 16: 1.7, 64: 1.9, 256: 1.0}, None),  # slower at the largest count: BLAS everywhere
    ({1: 1.0, 4: 1.0, 16: 1.0, 64: 1.0, 256: 1.02}, None),  # as fast (an Intel CPU's MKL): BLAS
])
def test_onednn_runs_from_the_row_count_where_it_won_at_every_larger_count(ratios, min_rows):
    chosen = onednn_linear.decide(ratios)
    assert chosen["min_rows"] == min_rows and ("not faster" in chosen["why"]) == (min_rows is None)


def test_the_choice_is_measured_once_a_machine_and_read_back_by_the_next_process(tmp_path):
    env = {**os.environ, "ICR_CACHE": str(tmp_path), "ICR_CPU_LINEAR": "auto"}
    code = ("import json; from harness.backends import onednn_linear as o; c = o.choice(); "
            "print(json.dumps([c.min_rows, c.why, o.identity(o.torch.device('cpu'), o.torch.float32)]))")

    def run():
        return json.loads(subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                                         text=True, check=True).stdout)

    first = run()
    file = tmp_path / "cpu-linear.json"
    remembered = json.loads(file.read_text())
    (key, entry), = remembered.items()
    assert key == onednn_linear.machine_key() and [entry["min_rows"], entry["why"]] == first[:2]
    assert first[2] == ({"linear": onednn_linear.IDENTITY} if first[0] else {})
    # the next process reads the file, not the machine: a choice written there (here, the other one) stands
    entry.update({"min_rows": 2, "why": "edited"} if first[0] is None else {"min_rows": None, "why": "edited"})
    file.write_text(json.dumps(remembered))
    second = run()
    assert second[:2] == [entry["min_rows"], "edited"] and json.loads(file.read_text()) == remembered
    file.write_text("[not a choice")  # unreadable: measured again (with a warning) and rewritten
    third = run()
    assert third[1].startswith(("measured", "oneDNN")) and key in json.loads(file.read_text())


def test_the_kernel_is_part_of_a_cpu_runs_settings_and_a_bad_setting_is_named(tiny_phi_dir, forced, monkeypatch):
    monkeypatch.setenv("ICR_CPU_FLASH", "off")  # the attention kernel's own entry: tests/test_cpu_flash.py
    monkeypatch.setenv("ICR_KEPT_POSITIONS", "off")  # and the kept positions': tests/test_kept_positions.py
    forced("onednn")
    assert TransformersBackend.run_identity(tiny_phi_dir, "cpu", "float32", {}) == {"linear": onednn_linear.IDENTITY}
    assert TransformersBackend.run_identity(tiny_phi_dir, "cpu", "bfloat16", {}) == {}
    forced("blas")
    assert TransformersBackend.run_identity(tiny_phi_dir, "cpu", "float32", {}) == {}
    backend = load_backend(tiny_phi_dir, device="cpu", dtype="float32")
    assert backend.describe().linear is None and not any(
        type(m) is onednn_linear.OneDNNLinear for m in backend.model.modules())
    forced("fast")
    with pytest.raises(ValueError, match="ICR_CPU_LINEAR='fast': use auto, onednn or blas"):
        TransformersBackend.run_identity(tiny_phi_dir, "cpu", "float32", {})


class _ReadTwice(nn.Module):
    """An MLP whose fc1 output is read by its GELU and again after it: folding the GELU would change it."""

    def __init__(self, twice: bool):
        super().__init__()
        self.fc1, self.fc2, self.act, self.twice = nn.Linear(32, 64), nn.Linear(64, 32), nn.GELU("tanh"), twice

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(self.act(h)) + (h[..., :32] if self.twice else 0)


@pytest.mark.parametrize("twice", [False, True])
def test_a_gelu_folds_into_its_layers_epilogue_only_where_it_alone_takes_the_layers_output(twice, forced):
    forced("onednn")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), _ReadTwice(twice), nn.GELU("tanh"))  # the last GELU: fed an MLP's sum
    onednn_linear.use_onednn(model, torch.device("cpu"), torch.float32)
    x = torch.randn(3, 24, 16)
    with torch.inference_mode():
        before = model(x)
        folded = fused_activations.gelu_into_linear(model, lambda: model(x))
        after, calls = _onednn_calls(lambda: model(x))
    assert before.std() > 0.01
    mlp = model[1]
    assert (folded is not None) == (not twice)
    assert type(mlp.fc1) is (onednn_linear.OneDNNLinear if twice else onednn_linear.OneDNNLinearGELU)
    assert type(mlp.act) is (nn.GELU if twice else nn.Identity) and type(model[2]) is nn.GELU
    assert calls == 3 and torch.allclose(after, before, rtol=1e-5, atol=1e-6)  # every layer on oneDNN
    with torch.no_grad():  # with gradients: PyTorch's linear (then its GELU, where folded), to the bit
        h = torch.randn(3, 24, 32)
        plain = nn.functional.linear(h, mlp.fc1.weight, mlp.fc1.bias)
        plain = plain if twice else nn.functional.gelu(plain, approximate="tanh")
    grad = mlp.fc1(h.requires_grad_())
    assert grad.requires_grad and torch.equal(grad, plain)


def _packing_here() -> None:
    """Skip where this machine's oneDNN parts packed from plain weights (then nothing packs: ``packing``)."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    with torch.inference_mode():
        equal, said = onednn_linear.packing(weight, bias, g)
    if not equal and "part" in said:
        pytest.skip(f"oneDNN here{said}")


def _load(path, monkeypatch, kernel):
    monkeypatch.setattr(onednn_linear, "choice", lambda: kernel)
    return TransformersBackend(path, device="cpu", dtype="float32")


def test_packed_weights_give_the_plain_weights_bits_through_a_backend(tiny_phi_dir, monkeypatch):
    _packing_here()
    plain = _load(tiny_phi_dir, monkeypatch, onednn_linear.LinearKernel(4, "forced", packed=False))
    packed = _load(tiny_phi_dir, monkeypatch, onednn_linear.LinearKernel(4, "forced", packed=True))
    assert any("weights packed" in f for f in packed.describe().fused)
    assert not any("packed" in f for f in plain.describe().fused)
    layers = [m for m in packed.model.modules() if isinstance(m, onednn_linear.OneDNNLinear)]
    ids = torch.randint(5, 900, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        theirs, ours = plain.model(ids).logits, packed.model(ids).logits
        assert all(m._packed is not None for m in layers)  # every layer took a packed weight ...
        assert theirs.std() > 0.1 and len({int(t) for t in theirs[:, -1].argmax(-1)}) > 1  # (the rows differ)
        assert torch.equal(ours, theirs)  # ... and gave the plain weight's bits
        prompts = [ids[i:i + 1, :12 + 9 * i] for i in range(3)]
        greedy = [plain.model.generate(p, max_new_tokens=10, do_sample=False)[0].tolist() for p in prompts]
        mine = [packed.model.generate(p, max_new_tokens=10, do_sample=False)[0].tolist() for p in prompts]
    assert len({tuple(g) for g in greedy}) == 3 and mine == greedy


def test_a_packed_layer_takes_its_plain_weight_for_one_row_and_repacks_a_changed_weight():
    _packing_here()
    torch.manual_seed(0)
    layer = nn.Linear(64, 96)
    layer.__class__, layer.min_rows, layer.packs = onednn_linear.OneDNNLinear, 1, True
    one, rows = torch.randn(1, 64), torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.equal(layer(one), onednn_linear._oneDNN(one, layer.weight, layer.bias))
        assert layer._packed is None  # one row: the plain weight (a packed one rounds apart there)
        before = layer(rows)
        assert layer._packed is not None and torch.equal(before, onednn_linear._oneDNN(rows, layer.weight, layer.bias))
    twin = copy.deepcopy(layer)  # a copy packs its own (the packed weight is opaque to copying)
    with torch.inference_mode():
        assert twin._packed is None and torch.equal(twin(rows), before) and twin._packed is not None
    with torch.no_grad():
        layer.weight.mul_(2)  # an optimizer's step, a state dict loaded: the packed copy is stale
    with torch.inference_mode():
        after = layer(rows)
    assert not torch.equal(after, before)
    assert torch.equal(after, onednn_linear._oneDNN(rows, layer.weight, layer.bias))
    layer.load_state_dict({"weight": torch.randn(96, 64), "bias": layer.bias.detach()}, assign=True)  # a new one
    with torch.inference_mode():
        assert torch.equal(layer(rows), onednn_linear._oneDNN(rows, layer.weight, layer.bias))
        layer.weight.data = torch.randn(96, 64)  # its storage swapped, as ``module.to`` does
        assert torch.equal(layer(rows), onednn_linear._oneDNN(rows, layer.weight, layer.bias))


def test_a_model_packs_only_where_its_copies_fit_the_free_memory(tiny_phi_dir, monkeypatch):
    monkeypatch.setattr(onednn_linear, "PACK_SHARE", 1e-9)
    backend = _load(tiny_phi_dir, monkeypatch, onednn_linear.LinearKernel(4, "forced", packed=True))
    assert any("weights not packed" in f and "free memory" in f for f in backend.describe().fused)
    assert not any(m.packs for m in backend.model.modules() if isinstance(m, onednn_linear.OneDNNLinear))


def test_a_choice_remembered_before_packing_was_measured_is_measured_again():
    assert not onednn_linear._usable({"min_rows": 4, "why": "measured over BLAS"})
    assert onednn_linear._usable({"min_rows": 4, "why": "measured over BLAS", "packed": True})
    entry = onednn_linear.measure()
    assert isinstance(entry["packed"], bool) and (entry["min_rows"] is None or "packed weights" in entry["why"])


def test_a_packed_weight_that_parts_from_the_plain_one_on_its_first_call_is_not_taken(monkeypatch, caplog):
    torch.manual_seed(0)
    layer = nn.Linear(64, 96)
    layer.__class__, layer.min_rows, layer.packs = onednn_linear.OneDNNLinear, 1, True
    real = onednn_linear.pack
    monkeypatch.setattr(onednn_linear, "pack", lambda w: real(w * 1.001))  # a reorder that changed the numbers
    rows = torch.randn(5, 64)
    with torch.inference_mode():
        out = layer(rows)
    assert torch.equal(out, onednn_linear._oneDNN(rows, layer.weight, layer.bias))
    assert not layer.packs and layer._packed is None and "parted from its plain one" in caplog.text
