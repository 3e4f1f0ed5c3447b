"""The mixer's causal convolution on [batch, time, channels] against ``F.conv1d`` (padded on the left), the
layout transformers' Mamba mixer uses, in value and every gradient."""
import pytest
import torch
import torch.nn.functional as F

from harness.ops.causal_conv import causal_conv


def _conv1d(x, weight, bias):
    kernel = weight.shape[-1]
    return F.conv1d(F.pad(x.transpose(1, 2), (kernel - 1, 0)), weight, bias, groups=x.shape[-1]).transpose(1, 2)


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 77])
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_conv1d_in_value_and_every_gradient(length, with_bias):
    g = torch.Generator().manual_seed(length)
    wide = torch.randn(2, length, 12, generator=g, dtype=torch.float64, requires_grad=True)
    x = wide[..., :6]  # a strided slice, as the mixer's in_proj output is split
    weight = torch.randn(6, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    dy = torch.randn(2, length, 6, generator=g, dtype=torch.float64)
    params = [t for t in (wide, weight, bias) if t is not None]
    outs = []
    for fn in (causal_conv, _conv1d):
        y = fn(x, weight, bias)
        outs.append((y.detach(), torch.autograd.grad(y, params, dy)))
    (y1, g1), (y2, g2) = outs
    assert y1.std() > 0 and y1.is_contiguous()
    torch.testing.assert_close(y1, y2)
    assert all(g.abs().max() > 0 for g in g2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_gradcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(causal_conv, (x, weight, bias))
