"""Mamba-1's selective scan as Triton kernels that walk time one step at a time (the "steps" layout of
``scan_triton.TILES``), the other design beside ``scan_triton``'s chunked prefix scans.

A parallel prefix scan does several times the arithmetic of the recurrence it computes. Here a program owns (row,
block of channels) with all its states in registers and takes ``h = a h + x`` one step at a time: per step and
state an exponential and a few multiply-adds, and the only dependence from step to step is one multiply-add, so
``UNROLL`` steps at a time are unrolled and their loads issued ahead of the recurrence (unrolling a whole chunk
took the compiler minutes). mamba-ssm's CUDA kernel takes time the same way. Which layout wins depends on the
channels (on an H100: chunks at 128, these at 256; ``scan_triton.TILES``).

    ``_steps_forward``   the gated output, and the state entering every chunk of ``K`` steps (the checkpoints)
    ``_steps_backward``  chunks in reverse: the chunk's states recomputed from its checkpoint into a per-program
                         scratch of K x channels x states (in L2), then the steps in reverse with the state
                         gradient ``g_t = C_t dy_t + a_{t+1} g_{t+1}`` carried in registers, every gradient

Inputs, outputs, partial sums and their order are ``scan_triton``'s (``TritonScan`` launches either design), so
a run stays reproducible bit for bit on one device and build.

Both layouts may also cut time into splits that run side by side (a third grid axis). A program walks its row's
time in order, so without splits a step lasts at least a row's length of dependent steps however many programs
the GPU could hold (batch 64 x 128 channels in blocks of 4: 2,048 one-warp programs, about 16 of an H100 SM's 64
warp slots). The recurrence is linear, so what a split does to the state it receives is a product and a sum, and
step-by-step side passes find both before the main kernels run:

    ``_split_ends_forward``   per split but the last: the state it ends in from a zero state, its decays' product;
                              split ``s`` of a forward kernel starts from ``_entering`` (the splits before it,
                              folded in order)
    ``_split_ends_backward``  per split but the first: the state gradient it hands the step before it (``a_t g_t``
                              at its first step) from a zero gradient after it, its decays' product; split ``s`` of
                              a backward kernel starts from ``_handed_back`` (the splits after it, folded from
                              the last)

One split launches no side pass and computes exactly what it did without splits."""
from __future__ import annotations

import triton
import triton.language as tl

from harness.ops.triton_shared import store_rounded

UNROLL = tl.constexpr(4)  # steps of a chunk's loop unrolled together


@triton.jit
def _load_step(ptr, row, offs, t, mask, s_b, s_k, s_l):
    """Step ``t`` of a [b, k, l] tensor at rows ``offs`` of k, as float32."""
    return tl.load(ptr + row * s_b + offs * s_k + t * s_l, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _decay(dtv, A_t, resets, row, t, L, HAS_RESETS: tl.constexpr):
    """[channels, states] decays of step t: exp(dt A), 0 at a packed sample's first token."""
    a = tl.exp(dtv[:, None] * A_t)
    if HAS_RESETS:  # past the end, the last step's flag (those steps change nothing the kernels keep)
        a = a * (1.0 - tl.load(resets + row * L + tl.minimum(t, L - 1)))
    return a


@triton.jit
def _program(blk, dim, nst, A, D, HAS_D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """A program's channels and states (offsets, masks), its [channels, states] A, its skip D (0 without)."""
    offs_d, offs_n = blk * BD + tl.arange(0, BD), tl.arange(0, BN)
    md, mn = offs_d < dim, offs_n < nst
    mdn = md[:, None] & mn[None, :]
    A_t = tl.load(A + offs_d[:, None] * nst + offs_n[None, :], mask=mdn, other=0.0)
    d_skip = tl.zeros((BD,), dtype=tl.float32)
    if HAS_D:
        d_skip = tl.load(D + offs_d, mask=md, other=0.0)
    return offs_d, offs_n, md, mn, mdn, A_t, d_skip


@triton.jit
def _steps_forward(u, dt, z, Bm, Cm, A, D, resets, y, starts, ends, decays,
                   L, dim, nst, n_chunks, per_split, n_splits,
                   su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l,
                   sB_b, sB_n, sB_l, sC_b, sC_n, sC_l, sy_b, sy_d, sy_l,
                   HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESETS: tl.constexpr,
                   K: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """``scan_triton._scan_forward``'s arguments and outputs (``starts``: the state entering each chunk)."""
    row, blk, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, offs_n, md, mn, mdn, A_t, d_skip = _program(blk, dim, nst, A, D, HAS_D, BD, BN)
    h = _entering(ends, decays, row, s, n_splits, dim, nst, offs_d, offs_n, mdn, BD, BN)
    for c in range(s * per_split, tl.minimum((s + 1) * per_split, n_chunks)):
        tl.store(starts + ((row * n_chunks + c) * dim + offs_d[:, None]) * nst + offs_n[None, :], h, mask=mdn)
        for i in tl.range(0, K, loop_unroll_factor=UNROLL):
            t = c * K + i
            m, mb = md & (offs_d * 0 + t < L), mn & (offs_n * 0 + t < L)  # past the end: dt = 0, a = 1, x = 0
            dtv = _load_step(dt, row, offs_d, t, m, sdt_b, sdt_d, sdt_l)
            uv = _load_step(u, row, offs_d, t, m, su_b, su_d, su_l)
            bv = _load_step(Bm, row, offs_n, t, mb, sB_b, sB_n, sB_l)
            cv = _load_step(Cm, row, offs_n, t, mb, sC_b, sC_n, sC_l)
            h = _decay(dtv, A_t, resets, row, t, L, HAS_RESETS) * h + (dtv * uv)[:, None] * bv[None, :]
            out = tl.sum(h * cv[None, :], axis=1)
            if HAS_D:
                out += d_skip * uv
            if HAS_Z:
                zv = _load_step(z, row, offs_d, t, m, sz_b, sz_d, sz_l)
                out = out * zv * tl.sigmoid(zv)
            store_rounded(y + row * sy_b + offs_d * sy_d + t * sy_l, out, m)


@triton.jit
def _steps_backward(u, dt, z, Bm, Cm, A, D, resets, dout, starts, carries, decays,
                    du, ddt, dz, dB_part, dC_part, dA_part, dD_part, scratch,
                    L, dim, nst, n_chunks, per_split, n_splits, n_blocks,
                    su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l, sB_b, sB_n, sB_l,
                    sC_b, sC_n, sC_l, sy_b, sy_d, sy_l, so_b, so_d, so_l, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                    HAS_RESETS: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """``scan_triton._scan_backward``'s arguments and outputs; ``scratch`` [programs, K, BD, BN] float32 holds a
    chunk's recomputed states."""
    row, blk, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, offs_n, md, mn, mdn, A_t, d_skip = _program(blk, dim, nst, A, D, HAS_D, BD, BN)
    mine = (scratch + ((row * n_blocks + blk) * n_splits + s) * K * BD * BN + tl.arange(0, BD)[:, None] * BN
            + offs_n[None, :])
    # a_{t+1} dL/dh_{t+1}, handed from each step to the one before
    carry = _handed_back(carries, decays, row, s, n_splits, dim, nst, offs_d, offs_n, mdn, BD, BN)
    grad_a = tl.zeros((BD, BN), dtype=tl.float32)
    grad_d = tl.zeros((BD,), dtype=tl.float32)
    first, last = s * per_split, tl.minimum((s + 1) * per_split, n_chunks)
    for j in range(0, last - first):
        c = last - 1 - j
        h = tl.load(starts + ((row * n_chunks + c) * dim + offs_d[:, None]) * nst + offs_n[None, :], mask=mdn,
                    other=0.0)
        for i in tl.range(0, K, loop_unroll_factor=UNROLL):  # the chunk's states again, into the scratch
            t = c * K + i
            m, mb = md & (offs_d * 0 + t < L), mn & (offs_n * 0 + t < L)
            dtv = _load_step(dt, row, offs_d, t, m, sdt_b, sdt_d, sdt_l)
            uv = _load_step(u, row, offs_d, t, m, su_b, su_d, su_l)
            bv = _load_step(Bm, row, offs_n, t, mb, sB_b, sB_n, sB_l)
            h = _decay(dtv, A_t, resets, row, t, L, HAS_RESETS) * h + (dtv * uv)[:, None] * bv[None, :]
            tl.store(mine + i * BD * BN, h)
        for i in tl.range(0, K, loop_unroll_factor=UNROLL):  # the steps in reverse
            t = c * K + (K - 1 - i)
            m, mb = md & (offs_d * 0 + t < L), mn & (offs_n * 0 + t < L)
            dtv = _load_step(dt, row, offs_d, t, m, sdt_b, sdt_d, sdt_l)
            uv = _load_step(u, row, offs_d, t, m, su_b, su_d, su_l)
            bv = _load_step(Bm, row, offs_n, t, mb, sB_b, sB_n, sB_l)
            cv = _load_step(Cm, row, offs_n, t, mb, sC_b, sC_n, sC_l)
            dy = _load_step(dout, row, offs_d, t, m, sy_b, sy_d, sy_l)
            if HAS_Z:  # y = ungated * silu(z)
                zv = _load_step(z, row, offs_d, t, m, sz_b, sz_d, sz_l)
                sig = tl.sigmoid(zv)
                dy_ungated = dy * zv * sig
            else:
                dy_ungated = dy
            h = tl.load(mine + (K - 1 - i) * BD * BN)
            a = _decay(dtv, A_t, resets, row, t, L, HAS_RESETS)
            x = (dtv * uv)[:, None] * bv[None, :]
            g = dy_ungated[:, None] * cv[None, :] + carry  # dL/dh_t (0 past the end: dy = 0 there)
            ga = g * (h - x)  # dL/d(dt A) = g_t a_t h_{t-1}, and a_t h_{t-1} = h_t - x_t
            gb = tl.sum(g * bv[None, :], axis=1)
            d_u = gb * dtv
            d_dt = gb * uv + tl.sum(ga * A_t, axis=1)
            part = ((row * n_blocks + blk) * nst + offs_n) * L + t
            tl.store(dB_part + part, tl.sum(g * (dtv * uv)[:, None], axis=0), mask=mb)
            tl.store(dC_part + part, tl.sum(h * dy_ungated[:, None], axis=0), mask=mb)
            grad_a += ga * dtv[:, None]
            carry = g * a
            if HAS_D:
                d_u += d_skip * dy_ungated
                grad_d += dy_ungated * uv
            if HAS_Z:
                ungated = tl.sum(h * cv[None, :], axis=1)
                if HAS_D:
                    ungated += d_skip * uv
                store_rounded(dz + row * so_b + offs_d * so_d + t * so_l, dy * ungated * sig * (1 + zv * (1 - sig)), m)
            store_rounded(du + row * so_b + offs_d * so_d + t * so_l, d_u, m)
            store_rounded(ddt + row * so_b + offs_d * so_d + t * so_l, d_dt, m)
    tl.store(dA_part + _in_split(row, s, n_splits, dim, nst, offs_d, offs_n), grad_a, mask=mdn)
    if HAS_D:
        tl.store(dD_part + (row * n_splits + s) * dim + offs_d, grad_d, mask=md)


@triton.jit
def _in_split(row, s, n_splits, dim, nst, offs_d, offs_n):
    """The offsets of split ``s``'s [channels, states] tile in a [rows, splits, dim, states] tensor."""
    return ((row * n_splits + s) * dim + offs_d[:, None]) * nst + offs_n[None, :]


@triton.jit
def _split_index(ptr, row, s, n_splits, dim, nst, offs_d, offs_n, mdn):
    """Split ``s``'s [channels, states] tile of a [rows, splits, dim, states] float32 tensor."""
    return tl.load(ptr + _in_split(row, s, n_splits, dim, nst, offs_d, offs_n), mask=mdn, other=0.0)


@triton.jit
def _entering(ends, decays, row, s, n_splits, dim, nst, offs_d, offs_n, mdn, BD: tl.constexpr, BN: tl.constexpr):
    """The state entering split ``s``: every split before it applied in order to the zero state."""
    h = tl.zeros((BD, BN), dtype=tl.float32)
    for j in range(0, s):
        h = (_split_index(decays, row, j, n_splits, dim, nst, offs_d, offs_n, mdn) * h
             + _split_index(ends, row, j, n_splits, dim, nst, offs_d, offs_n, mdn))
    return h


@triton.jit
def _handed_back(carries, decays, row, s, n_splits, dim, nst, offs_d, offs_n, mdn, BD: tl.constexpr,
                 BN: tl.constexpr):
    """``a_{t+1} dL/dh_{t+1}`` that the splits after ``s`` hand its last step: folded from the last split."""
    g = tl.zeros((BD, BN), dtype=tl.float32)
    for j in range(0, n_splits - 1 - s):
        k = n_splits - 1 - j
        g = (_split_index(decays, row, k, n_splits, dim, nst, offs_d, offs_n, mdn) * g
             + _split_index(carries, row, k, n_splits, dim, nst, offs_d, offs_n, mdn))
    return g


@triton.jit
def _split_ends_forward(u, dt, Bm, A, resets, ends, decays, L, dim, nst, n_chunks, per_split, n_splits,
                        su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sB_b, sB_n, sB_l,
                        HAS_RESETS: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """Grid (rows, channel blocks, splits - 1): ``ends`` and ``decays`` [rows, splits, dim, states] of every
    split but the last (the state from zero, the product of the decays; 0 across a packed sample's start)."""
    row, blk, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, offs_n, md, mn, mdn, A_t, _ = _program(blk, dim, nst, A, A, False, BD, BN)
    h = tl.zeros((BD, BN), dtype=tl.float32)
    p = tl.full((BD, BN), 1.0, dtype=tl.float32)
    for c in range(s * per_split, tl.minimum((s + 1) * per_split, n_chunks)):
        for i in tl.range(0, K, loop_unroll_factor=UNROLL):
            t = c * K + i
            m, mb = md & (offs_d * 0 + t < L), mn & (offs_n * 0 + t < L)
            dtv = _load_step(dt, row, offs_d, t, m, sdt_b, sdt_d, sdt_l)
            uv = _load_step(u, row, offs_d, t, m, su_b, su_d, su_l)
            bv = _load_step(Bm, row, offs_n, t, mb, sB_b, sB_n, sB_l)
            a = tl.where(m[:, None], _decay(dtv, A_t, resets, row, t, L, HAS_RESETS), 1.0)  # 1 past the end
            h = a * h + (dtv * uv)[:, None] * bv[None, :]
            p = p * a
    where = _in_split(row, s, n_splits, dim, nst, offs_d, offs_n)
    tl.store(ends + where, h, mask=mdn)
    tl.store(decays + where, p, mask=mdn)


@triton.jit
def _split_ends_backward(dt, z, Cm, A, resets, dout, carries, decays, L, dim, nst, n_chunks, per_split, n_splits,
                         sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l, sC_b, sC_n, sC_l, sy_b, sy_d, sy_l,
                         HAS_Z: tl.constexpr, HAS_RESETS: tl.constexpr, K: tl.constexpr, BD: tl.constexpr,
                         BN: tl.constexpr):
    """Grid (rows, channel blocks, splits - 1), for splits 1 to the last: ``carries`` and ``decays`` [rows,
    splits, dim, states] (``a_t g_t`` at the split's first step from a zero gradient after it, ``g_t = C_t dy_t +
    a_{t+1} g_{t+1}``; the product of the split's decays)."""
    row, blk, s = tl.program_id(0), tl.program_id(1), tl.program_id(2) + 1
    offs_d, offs_n, md, mn, mdn, A_t, _ = _program(blk, dim, nst, A, A, False, BD, BN)
    carry = tl.zeros((BD, BN), dtype=tl.float32)
    p = tl.full((BD, BN), 1.0, dtype=tl.float32)
    first, last = s * per_split, tl.minimum((s + 1) * per_split, n_chunks)
    for j in range(0, last - first):
        c = last - 1 - j
        for i in tl.range(0, K, loop_unroll_factor=UNROLL):
            t = c * K + (K - 1 - i)
            m, mb = md & (offs_d * 0 + t < L), mn & (offs_n * 0 + t < L)
            dtv = _load_step(dt, row, offs_d, t, m, sdt_b, sdt_d, sdt_l)
            cv = _load_step(Cm, row, offs_n, t, mb, sC_b, sC_n, sC_l)
            dy = _load_step(dout, row, offs_d, t, m, sy_b, sy_d, sy_l)
            if HAS_Z:  # y = ungated * silu(z)
                zv = _load_step(z, row, offs_d, t, m, sz_b, sz_d, sz_l)
                dy = dy * zv * tl.sigmoid(zv)
            a = tl.where(m[:, None], _decay(dtv, A_t, resets, row, t, L, HAS_RESETS), 1.0)  # 1 past the end
            carry = a * (dy[:, None] * cv[None, :] + carry)
            p = p * a
    where = _in_split(row, s, n_splits, dim, nst, offs_d, offs_n)
    tl.store(carries + where, carry, mask=mdn)
    tl.store(decays + where, p, mask=mdn)
