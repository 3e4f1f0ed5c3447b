"""Mamba's depthwise causal convolution over time on [batch, time, channels] tensors, the layout the mixer's
projections read and write, as K shifted multiply-adds with a hand-written backward.

``F.conv1d`` wants [batch, channels, time]: the mixer then pays a transposed copy each way, and on a CPU
oneDNN's depthwise backward plus the activation's backward over mismatched strides cost 15-19 ms a layer at
batch 8 and 1,255 tokens, against 8-10 ms here, where every tensor is read along contiguous channels. No
installable library has it for a CPU (``causal-conv1d`` is a CUDA extension)."""
from __future__ import annotations

import torch


class CausalConv(torch.autograd.Function):
    """y[b, t, c] = bias[c] + sum_k weight[c, k] x[b, t - (K - 1) + k, c], x before the start taken as zero
    (``F.conv1d`` of x padded with K - 1 zeros on the left, kernel [c, 1, K], ``groups=c``). x [b, L, c],
    weight [c, K], bias [c] or None; the output is contiguous. ``starts`` [b, L] (packed rows: 1 at each sample's
    first token) keeps every tap inside its sample: a step before the sample's first token reads as zero, as
    before the start of a row."""

    @staticmethod
    def forward(ctx, x, weight, bias, starts=None):
        kernel, length = weight.shape[-1], x.shape[1]
        y = torch.mul(x, weight[:, kernel - 1])  # the tap at the current step
        across = _across(starts, kernel, length)
        for k, shift in _taps(kernel, length):
            y[:, shift:].addcmul_(x[:, :length - shift], weight[:, k])
            if across:  # taken back where the tap reached into the sample before
                rows, t = across[shift]
                y[rows, t] -= x[rows, t - shift] * weight[:, k]
        if bias is not None:
            y += bias
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.across = bias is not None, across  # the backward corrects the same taps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        kernel, length, across = weight.shape[-1], x.shape[1], ctx.across
        dy = dy.contiguous()
        dx = torch.mul(dy, weight[:, kernel - 1])
        dw = torch.zeros_like(weight)  # a tap that reaches past the start of every row has no gradient
        dw[:, kernel - 1] = (dy * x).sum((0, 1))
        for k, shift in _taps(kernel, length):
            dx[:, :length - shift].addcmul_(dy[:, shift:], weight[:, k])
            dw[:, k] = (dy[:, shift:] * x[:, :length - shift]).sum((0, 1))
            if across:
                rows, t = across[shift]
                dx.index_put_((rows, t - shift), -dy[rows, t] * weight[:, k], accumulate=True)
                dw[:, k] -= (dy[rows, t] * x[rows, t - shift]).sum(0)
        return dx, dw, dy.sum((0, 1)) if ctx.has_bias else None, None


def _across(starts, kernel: int, length: int) -> dict | None:
    """{shift: (rows, steps)} where step t's tap ``shift`` back reads the sample before t's: a few steps after
    each restart, so they are corrected one by one instead of masking every step."""
    if starts is None:
        return None
    sample = starts.cumsum(1)
    out = {}
    for _, shift in _taps(kernel, length):
        rows, t = torch.nonzero(sample[:, shift:] != sample[:, :length - shift], as_tuple=True)
        out[shift] = (rows, t + shift)
    return out


def _taps(kernel: int, length: int):
    """(tap, how many steps back it reads) for the earlier taps that reach inside a sequence of ``length``."""
    return [(k, kernel - 1 - k) for k in range(kernel - 1) if kernel - 1 - k < length]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                kernel: str = "torch", starts: torch.Tensor | None = None) -> torch.Tensor:
    """``CausalConv`` (``kernel="torch"``) or its Triton kernels (``"triton"``, ``conv_triton``; ``choose_scan``
    decides) with weight given as ``nn.Conv1d``'s [c, 1, K] or as [c, K]; ``starts`` [b, L]: packed rows (1 at
    each sample's first token), every tap kept inside its sample."""
    if kernel == "triton":
        from harness.ops.conv_triton import TritonCausalConv  # lazy: imports triton, which a CPU install may lack
        fn = TritonCausalConv
    elif kernel == "torch":
        fn = CausalConv
    else:
        raise ValueError(f"kernel={kernel!r}: use torch or triton")
    return fn.apply(x, weight.reshape(weight.shape[0], -1), bias, starts)
