"""Mamba's depthwise causal convolution (``causal_conv.CausalConv``'s contract) as Triton kernels on the
[batch, time, channels] layout the mixer's projections read and write: one kernel each way.

The PyTorch version runs K shifted multiply-adds and K reductions over batch and time, each a pass over the
activations (its backward cost 26 ms of a 162 ms training step on an H100). Here a program owns a tile of
(row, steps, channels), reads the K shifted tiles of its input once from cache and writes its output; the
backward writes the input gradient and, per program, its partial sums of the weight and bias gradients, which
one torch sum over programs reduces in a fixed order (no atomics: reproducible bit for bit).

Written by hand because the one library kernel (``causal-conv1d``) is a CUDA extension that is not installed
where this runs, and wants [batch, channels, time]. Checked against ``CausalConv`` on the device before use
(``verified_on``), tested in Triton's CPU interpreter and compiled for sm_80/sm_90 in the tests."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from harness.ops.checked import agrees
from harness.ops.triton_shared import store_rounded

BLOCK_T = 32  # steps a program owns
BLOCK_C = 64  # channels a program owns


@triton.jit
def _reach(since, row, t, L, K: tl.constexpr, HAS_SINCE: tl.constexpr):
    """How many steps back each step's taps may read: ``since`` (packed rows), else every tap."""
    if HAS_SINCE:
        return tl.load(since + row * L + t, mask=t < L, other=0)
    return tl.full(t.shape, K, tl.int32)


@triton.jit
def _conv_forward(x, w, bias, since, y, L, channels,
                  sx_b, sx_l, sx_c, sy_b, sy_l,
                  HAS_BIAS: tl.constexpr, HAS_SINCE: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                  BC: tl.constexpr):
    """``since`` [b, L] int32 (packed rows): steps since the sample's first token; a tap reaching further back
    reads zero."""
    row, tb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tb * BT + tl.arange(0, BT)
    c = cb * BC + tl.arange(0, BC)
    mc = c < channels
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    reach = _reach(since, row, t, L, K, HAS_SINCE)
    for k in tl.static_range(K):  # tap k reads K - 1 - k steps back
        src = t - (K - 1 - k)
        m = ((src >= 0) & (src < L) & (reach >= K - 1 - k))[:, None] & mc[None, :]
        xv = tl.load(x + row * sx_b + src[:, None] * sx_l + c[None, :] * sx_c, mask=m, other=0.0).to(tl.float32)
        acc += xv * tl.load(w + c * K + k, mask=mc, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)[None, :]
    store_rounded(y + row * sy_b + t[:, None] * sy_l + c[None, :], acc, (t < L)[:, None] & mc[None, :])


@triton.jit
def _conv_backward(x, w, dy, since, dx, dw_part, db_part, L, channels, n_tblocks,
                   sx_b, sx_l, sx_c, sy_b, sy_l, sdx_b, sdx_l,
                   HAS_BIAS: tl.constexpr, HAS_SINCE: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr):
    """dw_part [programs over (row, step block), channels, K] and db_part [programs, channels]: summed after."""
    row, tb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tb * BT + tl.arange(0, BT)
    c = cb * BC + tl.arange(0, BC)
    mc = c < channels
    mine = (t < L)[:, None] & mc[None, :]
    dyv = tl.load(dy + row * sy_b + t[:, None] * sy_l + c[None, :], mask=mine, other=0.0).to(tl.float32)
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    part = (row * n_tblocks + tb) * channels + c
    reach = _reach(since, row, t, L, K, HAS_SINCE)
    for k in tl.static_range(K):
        shift = K - 1 - k
        # dx[t] gets w[k] dy[t + shift]; dw[k] gets dy[t] x[t - shift] (each where the tap stays in its sample)
        later = t + shift
        m = ((later < L) & (_reach(since, row, later, L, K, HAS_SINCE) >= shift))[:, None] & mc[None, :]
        ahead = tl.load(dy + row * sy_b + later[:, None] * sy_l + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc += ahead * tl.load(w + c * K + k, mask=mc, other=0.0).to(tl.float32)[None, :]
        src = t - shift
        m = ((src >= 0) & (t < L) & (reach >= shift))[:, None] & mc[None, :]
        xv = tl.load(x + row * sx_b + src[:, None] * sx_l + c[None, :] * sx_c, mask=m, other=0.0).to(tl.float32)
        tl.store(dw_part + part * K + k, tl.sum(dyv * xv, axis=0), mask=mc)
    store_rounded(dx + row * sdx_b + t[:, None] * sdx_l + c[None, :], acc, mine)
    if HAS_BIAS:
        tl.store(db_part + part, tl.sum(dyv, axis=0), mask=mc)


class TritonCausalConv(torch.autograd.Function):
    """``CausalConv`` in Triton: x [b, L, c] (any strides), weight [c, K], bias [c] or None; the output is
    contiguous, in the dtype ``CausalConv`` gives (x's and the weight's promoted), float32 inside. ``starts``
    [b, L] (packed rows: 1 at each sample's first token) keeps every tap inside its sample, as ``CausalConv``."""

    @staticmethod
    def forward(ctx, x, weight, bias, starts=None):
        rows, length, channels = x.shape
        kernel = weight.shape[-1]
        w = weight.contiguous()
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        if bias is not None:
            out_dtype = torch.promote_types(out_dtype, bias.dtype)
        y = x.new_empty((rows, length, channels), dtype=out_dtype)
        grid = _grid(rows, length, channels)
        since = _since(starts, kernel) if starts is not None else None
        _conv_forward[grid](x, w, bias if bias is not None else w, since if since is not None else w, y, length,
                            channels, *x.stride(), *y.stride()[:2], HAS_BIAS=bias is not None,
                            HAS_SINCE=since is not None, K=kernel, BT=BLOCK_T, BC=BLOCK_C)
        ctx.save_for_backward(x, w, since)
        ctx.has_bias, ctx.bias_dtype = bias is not None, bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, since = ctx.saved_tensors
        rows, length, channels = x.shape
        kernel = w.shape[-1]
        grid = _grid(rows, length, channels)
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        dx = x.new_empty((rows, length, channels))
        dw_part = x.new_empty((rows * grid[1], channels, kernel), dtype=torch.float32)
        db_part = x.new_empty((rows * grid[1], channels), dtype=torch.float32) if ctx.has_bias else dw_part
        _conv_backward[grid](x, w, dy, since if since is not None else w, dx, dw_part, db_part, length, channels,
                             grid[1], *x.stride(), *dy.stride()[:2], *dx.stride()[:2], HAS_BIAS=ctx.has_bias,
                             HAS_SINCE=since is not None, K=kernel, BT=BLOCK_T, BC=BLOCK_C)
        return (dx, dw_part.sum(0).to(w.dtype), db_part.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None,
                None)


def _since(starts: torch.Tensor, kernel: int) -> torch.Tensor:
    """[b, L] int32: steps since each step's sample began (``starts``: 1 at a sample's first token), capped at
    ``kernel``; made on the device with no host sync (a CUDA graph may capture it)."""
    steps = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    began = torch.where(starts > 0, steps, torch.zeros_like(steps)).cummax(1).values
    return (steps - began).clamp_max(kernel).to(torch.int32).contiguous()


def _grid(rows: int, length: int, channels: int) -> tuple[int, int, int]:
    return rows, triton.cdiv(length, BLOCK_T), triton.cdiv(channels, BLOCK_C)


def fits(shape: tuple[int, int, int]) -> bool:
    """Whether the indexes the kernels form for x of ``shape`` (b, L, c) fit 32 bits (x a slice of a tensor at
    most twice as wide, as the mixer's in_proj output is split)."""
    b, length, channels = shape
    return 2 * b * (triton.cdiv(length, BLOCK_T) * BLOCK_T) * (triton.cdiv(channels, BLOCK_C) * BLOCK_C) < 2**31


# How far it may part from ``CausalConv`` (relative to the largest value): both sum in float32, in another order;
# an input gradient in half precision is rounded to it, where one float32 ulp can move it by one of its ulps.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}


@functools.lru_cache(maxsize=None)
def verified_on(device: str, reference, dtype: str = "float32", kernel: int = 4, bias: bool = True,
                resets: bool = False) -> bool:
    """Whether the Triton convolution equals ``reference`` (``CausalConv``) on this device for one class of
    launch (input in ``dtype``, ``kernel`` taps, with or without a bias, with or without packed rows' restarts;
    output and every gradient, at a length and width that are not multiples of a block): checked once per process
    and class before that class runs; a kernel that fails or differs leaves the run on ``CausalConv``, with a
    warning."""
    g = torch.Generator().manual_seed(0)
    rows, length, channels = 2, BLOCK_T + 5, BLOCK_C + 3
    wide = torch.randn(rows, length, 2 * channels, generator=g).to(getattr(torch, dtype))
    weight, b = torch.randn(channels, kernel, generator=g), torch.randn(channels, generator=g)
    dy = torch.randn(rows, length, channels, generator=g)
    starts = None
    if resets:  # at the first step, inside a block, at a block's edge, two in a row (a one-token sample)
        starts = torch.zeros(rows, length, device=device)
        starts[:, [0, 3, BLOCK_T - 1, BLOCK_T, BLOCK_T + 1]] = 1

    def run():
        results = []
        for conv in (TritonCausalConv, reference):
            leaves = [t.to(device).requires_grad_() for t in (wide, weight, b)]
            x = leaves[0][..., :channels]  # a strided slice, as the mixer's in_proj output is split
            y = conv.apply(x, leaves[1], leaves[2] if bias else None, starts)
            used = leaves if bias else leaves[:2]
            results.append([y.detach(), *torch.autograd.grad(y, used, dy.to(device, y.dtype))])
        return results

    return agrees(run, TOLERANCE.get(dtype, 1e-5), "Triton causal convolution", "PyTorch one", device,
                  f"{device} in {dtype}{' with packed rows' if resets else ''}",
                  "the run uses the PyTorch convolution")
