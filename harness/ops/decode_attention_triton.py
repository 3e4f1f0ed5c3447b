"""The Triton kernels of ``harness.ops.decode_attention``: partial softmaxes over splits of the filled positions,
then their merge. Imported only where Triton is installed (a GPU, or its CPU interpreter in the tests)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.ops.triton_shared import store_rounded


@triton.jit
def _partials(q_ptr, k_ptr, v_ptr, mask_ptr, last_ptr, o_ptr, m_ptr, l_ptr,
              sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_n,
              heads, group, splits, scale,
              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """One (row, head, split): the softmax-weighted sum of the split's values, unnormalised, with its maximum
    score and its sum of exponentials, over positions [split * CHUNK, min(next split, last + 1))."""
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    hk = h // group
    end = tl.minimum((split + 1) * CHUNK, tl.load(last_ptr) + 1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + d, mask=dmask, other=0.0).to(tl.float32) * scale
    m = tl.full((), float("-inf"), tl.float32)
    s_exp = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(split * CHUNK, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < end
        both = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + b * sk_b + hk * sk_h + n[:, None] * sk_n + d[None, :], mask=both, other=0.0)
        score = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        score += tl.load(mask_ptr + b * sm_b + n * sm_n, mask=nmask, other=0.0).to(tl.float32)
        score = tl.where(nmask, score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new)
        v = tl.load(v_ptr + b * sv_b + hk * sv_h + n[:, None] * sv_n + d[None, :], mask=both, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        s_exp = s_exp * alpha + tl.sum(p, axis=0)
        m = m_new
    at = bh * splits + split
    tl.store(o_ptr + at * BLOCK_D + d, acc)
    tl.store(m_ptr + at, m)
    tl.store(l_ptr + at, s_exp)


@triton.jit
def _merge(o_ptr, m_ptr, l_ptr, out_ptr, so_b, so_h, heads, splits,
           D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One (row, head): the splits' partial sums weighted by exp(their maximum - the overall one)."""
    bh = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    smask = s < splits
    m = tl.load(m_ptr + bh * splits + s, mask=smask, other=float("-inf"))
    top = tl.max(m, axis=0)  # finite: the split holding ``last`` always has a score
    w = tl.where(smask & (m > float("-inf")), tl.exp(m - top), 0.0)
    total = tl.sum(w * tl.load(l_ptr + bh * splits + s, mask=smask, other=0.0), axis=0)
    d = tl.arange(0, BLOCK_D)
    part = tl.load(o_ptr + (bh * splits + s[:, None]) * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(w[:, None] * part, axis=0) / total
    b, h = bh // heads, bh % heads
    store_rounded(out_ptr + b * so_b + h * so_h + d, out, d < D)


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, last: torch.Tensor,
                       scale: float, block_n: int, chunk: int) -> torch.Tensor:
    """q [b, h, 1, d]; k, v [b, h_kv, capacity, d] (any strides but the last); mask [b, 1, 1, capacity] additive;
    ``last`` the last filled position's index (one element, on the device). Returns [b, h, 1, d] in q's dtype."""
    b, heads, _, dim = q.shape
    capacity = k.shape[2]
    splits = triton.cdiv(capacity, chunk)  # fixed by the capacity: one launch shape a graph
    block_d = triton.next_power_of_2(dim)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = mask.reshape(b, capacity)
    partial = torch.empty((b * heads * splits, block_d), dtype=torch.float32, device=q.device)
    top = torch.empty(b * heads * splits, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(top)
    out = torch.empty_like(q)
    _partials[(b * heads, splits)](
        q, k, v, mask, last.reshape(-1), partial, top, sums,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0), mask.stride(1), heads, heads // k.shape[1], splits, scale,
        D=dim, BLOCK_D=block_d, BLOCK_N=block_n, CHUNK=chunk)
    _merge[(b * heads,)](partial, top, sums, out, out.stride(0), out.stride(1), heads, splits,
                         D=dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return out
