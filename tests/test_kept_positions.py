"""A prefill's last layer computed for its kept position only (``harness/backends/kept_positions.py``), on real
tiny models: the last layer's MLP takes one row and its attention one query, the kept logits equal the whole
layer's, generations are the same token for token, a stack with state after its last attention is left as it is,
and a last layer whose other positions are read elsewhere is refused by the probe."""
import pytest
import torch
from torch import nn

from harness.backends import kept_positions
from harness.backends.base import GenRequest
from harness.backends.loading import load_backend
from harness.ops import cpu_flash
from harness.tiny import make_tiny_model
from tests.helpers import assert_varied, diverse_prompts

KEPT = kept_positions.IDENTITY


def _backend(model_dir, monkeypatch, on: bool):
    monkeypatch.setenv(kept_positions.ENV, "on" if on else "off")
    return load_backend(str(model_dir), "cpu", "float32")


def _left_padded(backend, prompts):
    ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
    width = max(map(len, ids))
    input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return input_ids, mask


@pytest.mark.parametrize("arch", ["phi", "llama", "gpt2"])
def test_a_prefill_computes_its_last_layer_for_the_kept_position_only(arch, tmp_path, monkeypatch):
    model_dir = make_tiny_model(tmp_path / arch, arch, hidden=64, layers=3)
    ours, whole = _backend(model_dir, monkeypatch, True), _backend(model_dir, monkeypatch, False)
    assert any(KEPT in f for f in ours.describe().fused)
    assert not any(KEPT in f for f in whole.describe().fused)
    input_ids, mask = _left_padded(ours, diverse_prompts(4, seed=1))
    assert input_ids.shape[1] > 100  # long enough for the flash kernel's blocks
    last = ours.model.transformer.h[-1] if arch == "gpt2" else ours.model.model.layers[-1]
    rows = []
    last.mlp.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[1]))
    decoded = cpu_flash.CALLS["decode"]
    with torch.inference_mode():
        kept, state = ours.prefill(input_ids, mask)
        assert rows == [1]  # the last layer's MLP took the kept row alone
        assert cpu_flash.CALLS["decode"] == decoded + 1  # and its attention the kept query alone
        full, _ = whole.prefill(input_ids, mask)
        block = input_ids[:, :3]
        ours.step(state, block, torch.cat([mask, torch.ones_like(block)], 1))
    assert rows == [1, 3]  # a block whose every logit is read: every row
    assert_varied([int(x) for x in full.argmax(-1)], "greedy tokens")
    assert torch.equal(kept.argmax(-1), full.argmax(-1))
    torch.testing.assert_close(kept, full, rtol=0, atol=1e-5 * float(full.abs().max()))


def test_generations_are_the_same_token_for_token(tiny_phi_dir, monkeypatch):
    prompts = diverse_prompts(8, seed=3)
    texts = {}
    for on in (True, False):
        backend = _backend(tiny_phi_dir, monkeypatch, on)
        requests = [GenRequest(p, 12, ()) for p in prompts]
        texts[on] = [r.text for r in backend.generate_all(requests).results(len(requests))]
    assert_varied(texts[False])
    assert texts[True] == texts[False]


def test_a_stack_with_state_after_its_attention_is_left_as_it_is(tmp_path, monkeypatch):
    backend = _backend(make_tiny_model(tmp_path / "jamba", "jamba"), monkeypatch, True)
    assert not any(KEPT in f for f in backend.describe().fused)


class _Wrapped(nn.Module):
    """A model's MLP with ``around`` between it and its input."""

    def __init__(self, inner, around):
        super().__init__()
        self.inner, self.around = inner, around

    def forward(self, x):
        return self.around(self.inner, x)


def _mixing(mlp, x):
    """A running sum over positions: the kept row depends on the others."""
    return mlp(x) + x.cumsum(1)


def _whole_only(mlp, x):
    """Fails on the kept rows alone (as an MLP that returns its router's logits beside its rows, a mixture of
    experts', fails to be padded back)."""
    if x.shape[1] == 1:
        raise RuntimeError("this MLP needs the whole block")
    return mlp(x)


@pytest.mark.parametrize("around,said", [(_mixing, "on a probe its kept logits moved by"),
                                         (_whole_only, "a probe failed (RuntimeError: this MLP needs the whole block)")])
def test_a_last_layer_whose_kept_rows_need_the_others_is_refused_by_the_probe(around, said, tmp_path, monkeypatch,
                                                                              caplog):
    """The probe's logits move, or the probe fails: the hooks go, and the backend computes every position as
    before."""
    backend = _backend(make_tiny_model(tmp_path / "llama", "llama", hidden=64, layers=2), monkeypatch, False)
    layer = backend.model.model.layers[-1]
    layer.mlp = _Wrapped(layer.mlp, around)
    monkeypatch.setenv(kept_positions.ENV, "on")
    with caplog.at_level("INFO", logger="harness"):
        assert kept_positions.install(backend.model, backend.family, backend._probe_prefill) is None
    assert "the last layer computes every position: " + said in caplog.text
    assert not layer.mlp._forward_pre_hooks and not hasattr(layer.self_attn, "_icr_last_attention")
    backend._probe_prefill()  # and prefills run as before


def test_it_is_part_of_a_cpu_runs_settings_and_its_switch_is_checked(monkeypatch):
    from harness.backends.hf import TransformersBackend

    assert TransformersBackend.run_identity("m", "cpu", "float32", {})["kept_positions"] == KEPT
    monkeypatch.setenv(kept_positions.ENV, "off")
    assert "kept_positions" not in TransformersBackend.run_identity("m", "cpu", "float32", {})
    monkeypatch.setenv(kept_positions.ENV, "perhaps")
    with pytest.raises(ValueError, match="ICR_KEPT_POSITIONS='perhaps': use on or off"):
        TransformersBackend.run_identity("m", "cpu", "float32", {})
