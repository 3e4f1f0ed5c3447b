"""Mamba-1's selective scan as fused Triton kernels for a GPU without mamba-ssm's CUDA extension: the chunked
algorithm of ``selective_scan`` (the same multiply-adds, no log-space rescaling), with each chunk's states held
in registers instead of materialised as [batch, channels, states, time] tensors.

On a GPU the PyTorch scan is memory-bound: every vectorised step reads and writes a whole chunk's states, about
30 passes over b·d·n·L floats per layer and training step (1.3 GB at batch 64 and 2,535 tokens). Here a
program owns (row, block of channels, chunk) and walks its chunk's steps with the states in registers; the
passes read the inputs (b·L·(3d + 2n) values) and write the outputs; the backward writes each chunk's states to
scratch once to read them back in reverse (its one pass over b·d·n·L floats). Kernels, one program per (row,
channel block, chunk):

    ``_chunk_scan`` MODE 0: each chunk from zero, its end state and summed step sizes (forward pass 1)
                    MODE 1: each chunk from its exact start, the gated output (forward pass 3)
                    MODE 2: the state gradient backwards through each chunk from zero (backward pass 1)
    ``_carry``      the exact state entering every chunk (forward pass 2, backward pass 2, reversed)
    ``_chunk_backward`` each chunk's states recomputed from its start, then every gradient in reverse

Written by hand because no installable library has Mamba-1's scan in Triton (mamba-ssm's is CUDA C++; its
Triton kernels are Mamba-2's, whose decay is a scalar per head). Tested against the sequential scan in Triton's
CPU interpreter and compiled for sm_80/sm_90 in the tests; on a GPU ``selective_scan`` uses it only after
``verified_on`` has compared it with the PyTorch scan on that device."""
from __future__ import annotations

import functools
import types
import warnings

import torch
import triton
import triton.language as tl

CHUNK = 64  # steps a program walks, its states in registers (chunks run in parallel); read at each call
BLOCK_D = 16  # channels a program owns


@triton.jit
def _load_row(ptr, row, t, offs, mask, s_b, s_k, s_l):
    return tl.load(ptr + row * s_b + offs * s_k + t * s_l, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _tile(A, blk, dim, nst, BD: tl.constexpr, BN: tl.constexpr):
    """A channel block's offsets and masks (channels, states, both) and its tile of A [dim, nst]."""
    offs_d = blk * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    md, mn = offs_d < dim, offs_n < nst
    mdn = md[:, None] & mn[None, :]
    return offs_d, offs_n, md, mn, mdn, tl.load(A + offs_d[:, None] * nst + offs_n[None, :], mask=mdn, other=0.0)


@triton.jit
def _chunk_scan(u, dt, z, Bm, Cm, A, D, dout, state, dtsum, y,
                L, dim, nst, n_chunks,
                su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l,
                sB_b, sB_n, sB_l, sC_b, sC_n, sC_l, sy_b, sy_d, sy_l,
                MODE: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                K: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    row, blk, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, offs_n, md, mn, mdn, a_log = _tile(A, blk, dim, nst, BD, BN)
    at = ((row * n_chunks + c) * dim + offs_d[:, None]) * nst + offs_n[None, :]  # state[row, c] [dim, nst]
    t0 = c * K
    steps = tl.minimum(L - t0, K)
    if MODE == 1:
        h = tl.load(state + at, mask=mdn, other=0.0)
    else:
        h = tl.zeros((BD, BN), dtype=tl.float32)
    if HAS_D:
        d_skip = tl.load(D + offs_d, mask=md, other=0.0)
    total = tl.zeros((BD,), dtype=tl.float32)
    for i in range(0, steps):
        if MODE == 2:
            t = t0 + steps - 1 - i
        else:
            t = t0 + i
        dtv = _load_row(dt, row, t, offs_d, md, sdt_b, sdt_d, sdt_l)
        a = tl.exp(dtv[:, None] * a_log)
        if MODE == 2:  # g_t = a_t (g_{t+1}' + C_t dy_t): what chunk c hands the step before it, from zero
            dy = _load_row(dout, row, t, offs_d, md, sy_b, sy_d, sy_l)
            if HAS_Z:
                zv = _load_row(z, row, t, offs_d, md, sz_b, sz_d, sz_l)
                dy = dy * zv * tl.sigmoid(zv)
            cv = _load_row(Cm, row, t, offs_n, mn, sC_b, sC_n, sC_l)
            h = a * (h + dy[:, None] * cv[None, :])
        else:
            uv = _load_row(u, row, t, offs_d, md, su_b, su_d, su_l)
            bv = _load_row(Bm, row, t, offs_n, mn, sB_b, sB_n, sB_l)
            h = a * h + (dtv * uv)[:, None] * bv[None, :]
            if MODE == 0:
                total += dtv
            if MODE == 1:
                cv = _load_row(Cm, row, t, offs_n, mn, sC_b, sC_n, sC_l)
                out = tl.sum(h * cv[None, :], axis=1)
                if HAS_D:
                    out += d_skip * uv
                if HAS_Z:
                    zv = _load_row(z, row, t, offs_d, md, sz_b, sz_d, sz_l)
                    out = out * zv * tl.sigmoid(zv)
                tl.store(y + row * sy_b + offs_d * sy_d + t * sy_l, out, mask=md)
    if MODE != 1:
        tl.store(state + at, h, mask=mdn)
    if MODE == 0:
        tl.store(dtsum + (row * n_chunks + c) * dim + offs_d, total, mask=md)


@triton.jit
def _carry(ends, dtsum, A, starts, dim, nst, n_chunks,
           REVERSE: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """starts[c] = the state entering chunk c: P_{c-1} starts[c-1] + ends[c-1], P = exp(A · summed dt); in
    REVERSE the gradient entering chunk c from the one after it, the same recurrence run from the last chunk."""
    row, blk = tl.program_id(0), tl.program_id(1)
    offs_d, offs_n, md, mn, mdn, a_log = _tile(A, blk, dim, nst, BD, BN)
    h = tl.zeros((BD, BN), dtype=tl.float32)
    for i in range(0, n_chunks):
        if REVERSE:
            c = n_chunks - 1 - i
        else:
            c = i
        at = ((row * n_chunks + c) * dim + offs_d[:, None]) * nst + offs_n[None, :]
        tl.store(starts + at, h, mask=mdn)
        total = tl.load(dtsum + (row * n_chunks + c) * dim + offs_d, mask=md, other=0.0)
        h = tl.exp(total[:, None] * a_log) * h + tl.load(ends + at, mask=mdn, other=0.0)


@triton.jit
def _chunk_backward(u, dt, z, Bm, Cm, A, D, dout, starts, g_in, scratch,
                    du, ddt, dz, dB_part, dC_part, dA_part, dD_part,
                    L, dim, nst, n_chunks, n_blocks,
                    su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l,
                    sB_b, sB_n, sB_l, sC_b, sC_n, sC_l, sy_b, sy_d, sy_l, so_b, so_d, so_l,
                    HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                    K: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """dout is read with the sy strides; du, ddt and dz are written with the so strides."""
    row, blk, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, offs_n, md, mn, mdn, a_log = _tile(A, blk, dim, nst, BD, BN)
    at = ((row * n_chunks + c) * dim + offs_d[:, None]) * nst + offs_n[None, :]
    t0 = c * K
    steps = tl.minimum(L - t0, K)
    if HAS_D:
        d_skip = tl.load(D + offs_d, mask=md, other=0.0)
    # this program's scratch: the chunk's states, [K, BD, BN]
    tile = tl.arange(0, BD)[:, None] * BN + offs_n[None, :]
    mine = scratch + ((row * n_blocks + blk) * n_chunks + c) * (K * BD * BN) + tile
    h0 = tl.load(starts + at, mask=mdn, other=0.0)
    h = h0
    for i in range(0, steps):
        t = t0 + i
        dtv = _load_row(dt, row, t, offs_d, md, sdt_b, sdt_d, sdt_l)
        uv = _load_row(u, row, t, offs_d, md, su_b, su_d, su_l)
        bv = _load_row(Bm, row, t, offs_n, mn, sB_b, sB_n, sB_l)
        h = tl.exp(dtv[:, None] * a_log) * h + (dtv * uv)[:, None] * bv[None, :]
        tl.store(mine + i * (BD * BN), h)
    g = tl.load(g_in + at, mask=mdn, other=0.0)  # a_{t+1} dL/dh_{t+1} from the chunks after this one
    grad_a = tl.zeros((BD, BN), dtype=tl.float32)
    grad_d = tl.zeros((BD,), dtype=tl.float32)
    for j in range(0, steps):
        i = steps - 1 - j
        t = t0 + i
        dtv = _load_row(dt, row, t, offs_d, md, sdt_b, sdt_d, sdt_l)
        uv = _load_row(u, row, t, offs_d, md, su_b, su_d, su_l)
        bv = _load_row(Bm, row, t, offs_n, mn, sB_b, sB_n, sB_l)
        cv = _load_row(Cm, row, t, offs_n, mn, sC_b, sC_n, sC_l)
        dy = _load_row(dout, row, t, offs_d, md, sy_b, sy_d, sy_l)
        h = tl.load(mine + i * (BD * BN))
        prev = tl.load(mine + tl.maximum(i - 1, 0) * (BD * BN))
        prev = tl.where(i > 0, prev, h0)
        if HAS_Z:  # y = ungated * silu(z)
            zv = _load_row(z, row, t, offs_d, md, sz_b, sz_d, sz_l)
            sig = tl.sigmoid(zv)
            ungated = tl.sum(h * cv[None, :], axis=1)
            if HAS_D:
                ungated += d_skip * uv
            tl.store(dz + row * so_b + offs_d * so_d + t * so_l, dy * ungated * sig * (1 + zv * (1 - sig)),
                     mask=md)
            dy = dy * zv * sig
        g += dy[:, None] * cv[None, :]  # dL/dh_t
        a = tl.exp(dtv[:, None] * a_log)
        g_b = tl.sum(g * bv[None, :], axis=1)
        ga = g * a * prev  # dL/d(dt A) per state
        d_u = g_b * dtv
        if HAS_D:
            d_u += d_skip * dy
            grad_d += dy * uv
        tl.store(du + row * so_b + offs_d * so_d + t * so_l, d_u, mask=md)
        tl.store(ddt + row * so_b + offs_d * so_d + t * so_l, g_b * uv + tl.sum(ga * a_log, axis=1), mask=md)
        part = ((row * L + t) * n_blocks + blk) * nst + offs_n  # [b, L, n_blocks, n]: summed over blocks after
        tl.store(dB_part + part, tl.sum(g * (dtv * uv)[:, None], axis=0), mask=mn)
        tl.store(dC_part + part, tl.sum(h * dy[:, None], axis=0), mask=mn)
        grad_a += ga * dtv[:, None]
        g = a * g
    tl.store(dA_part + at, grad_a, mask=mdn)
    if HAS_D:
        tl.store(dD_part + (row * n_chunks + c) * dim + offs_d, grad_d, mask=md)


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _time_major(like: torch.Tensor) -> torch.Tensor:
    """A float32 [b, k, l] laid out [b, l, k] in memory, as the mixer's tensors are."""
    b, k, length = like.shape
    return like.new_empty((b, length, k), dtype=torch.float32).transpose(1, 2)


class TritonScan(torch.autograd.Function):
    """``SelectiveScan``'s contract (mamba-ssm's ``selective_scan_fn`` without a returned state) in Triton:
    u, dt, z [b, d, l] (dt after bias and softplus), A [d, n], B, C [b, n, l], D [d]; D and z may be None.
    float32 inside, inputs' dtype out; any strides. Keeps its inputs and the state entering every chunk."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, z):
        ctx.chunk = CHUNK
        y = _time_major(u)
        k = _launch(u, dt, A, B, C, D, z, y, ctx.chunk)
        ends = u.new_empty((k.rows, k.n_chunks, k.dim, k.nst), dtype=torch.float32)
        sums = u.new_empty((k.rows, k.n_chunks, k.dim), dtype=torch.float32)
        _chunk_scan[k.grid](*k.tensors, y, ends, sums, y, *k.sizes, *k.strides, MODE=0, **k.flags)
        starts = torch.empty_like(ends)
        _carry[k.grid[:2]](ends, sums, k.a32, starts, *k.sizes[1:], REVERSE=False, BD=BLOCK_D, BN=k.bn)
        _chunk_scan[k.grid](*k.tensors, y, starts, sums, y, *k.sizes, *k.strides, MODE=1, **k.flags)
        ctx.save_for_backward(u, dt, A, B, C, D, z, starts, sums)
        return y.to(u.dtype)

    @staticmethod
    def backward(ctx, dout):
        u, dt, A, B, C, D, z, starts, sums = ctx.saved_tensors
        dout = dout.float()
        k = _launch(u, dt, A, B, C, D, z, dout, ctx.chunk)
        ends = torch.empty_like(starts)  # the state gradient each chunk hands the one before it, from zero
        _chunk_scan[k.grid](*k.tensors, dout, ends, sums, dout, *k.sizes, *k.strides, MODE=2, **k.flags)
        g_in = torch.empty_like(starts)
        _carry[k.grid[:2]](ends, sums, k.a32, g_in, *k.sizes[1:], REVERSE=True, BD=BLOCK_D, BN=k.bn)
        du, ddt, dz = _time_major(u), _time_major(u), _time_major(u)
        scratch = u.new_empty((k.rows * k.blocks * k.n_chunks * ctx.chunk * BLOCK_D * k.bn,), dtype=torch.float32)
        dB_part = u.new_empty((k.rows, k.length, k.blocks, k.nst), dtype=torch.float32)
        dC_part = torch.empty_like(dB_part)
        dA_part = torch.empty_like(starts)
        dD_part = torch.empty_like(sums)
        _chunk_backward[k.grid](*k.tensors, dout, starts, g_in, scratch, du, ddt, dz, dB_part, dC_part, dA_part,
                                dD_part, *k.sizes, k.blocks, *k.strides, *_strides(du), **k.flags)
        dB, dC = dB_part.sum(2).transpose(1, 2), dC_part.sum(2).transpose(1, 2)
        return (du.to(u.dtype), ddt.to(dt.dtype), dA_part.sum((0, 1)).to(A.dtype), dB.to(B.dtype),
                dC.to(C.dtype), dD_part.sum((0, 1)).to(D.dtype) if D is not None else None,
                dz.to(z.dtype) if z is not None else None)


def _launch(u, dt, A, B, C, D, z, out, chunk) -> types.SimpleNamespace:
    """What every launch of one scan's kernels shares: the grid, the leading tensors (float32 A and D), the
    sizes, the strides of the inputs and of ``out`` (read or written with the last stride triple), the flags."""
    rows, dim, length = u.shape
    nst = A.shape[1]
    grid, blocks, n_chunks, bn = _grid(u, nst, chunk)
    a32 = A.float().contiguous()
    zz = z if z is not None else u
    return types.SimpleNamespace(
        rows=rows, dim=dim, length=length, nst=nst, grid=grid, blocks=blocks, n_chunks=n_chunks, bn=bn, a32=a32,
        tensors=(u, dt, zz, B, C, a32, D.float().contiguous() if D is not None else a32),
        sizes=(length, dim, nst, n_chunks),
        strides=(*_strides(u), *_strides(dt), *_strides(zz), *_strides(B), *_strides(C), *_strides(out)),
        flags=dict(HAS_D=D is not None, HAS_Z=z is not None, K=chunk, BD=BLOCK_D, BN=bn))


def fits(shape: tuple[int, int, int], n: int, chunk: int | None = None) -> bool:
    """Whether every index the kernels form for ``u`` of ``shape`` (b, d, l) fits 32 bits (the scratch holds
    b·d·l·n states)."""
    b, d, length = shape
    chunk = chunk or CHUNK
    padded = triton.cdiv(d, BLOCK_D) * BLOCK_D * triton.cdiv(length, chunk) * chunk * triton.next_power_of_2(n)
    return b * padded < 2**31


def _grid(u, n, chunk):
    """(launch grid, channel blocks, chunks, states padded to a power of two) for u [b, d, l]."""
    b, d, length = u.shape
    if not fits(tuple(u.shape), n, chunk):
        raise ValueError(f"the Triton scan indexes in 32 bits: {b} rows of {length} steps are too many at once")
    blocks, n_chunks = triton.cdiv(d, BLOCK_D), triton.cdiv(length, chunk)
    return (b, blocks, n_chunks), blocks, n_chunks, triton.next_power_of_2(n)


# How far the Triton scan may part from the PyTorch scan on the same inputs (relative to the largest value): both
# accumulate in float32, so what differs is the order of sums and, in half precision, the outputs' rounding.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


@functools.lru_cache(maxsize=None)
def verified_on(device: str, reference, dtype: str = "float32", n: int = 16, skip: bool = True,
                gate: bool = True) -> bool:
    """Whether the Triton scan equals ``reference`` (the PyTorch scan's autograd function) on this device for one
    class of launch (activations in ``dtype``, ``n`` states, with or without the skip ``D`` and the gate ``z``;
    output and every gradient, at a length that is not a multiple of a chunk): checked once per process and
    class before that class runs, so a kernel that miscompiles or fails on some GPU, in some precision or shape,
    leaves training on the PyTorch scan (with a warning) instead of on wrong numbers."""
    g = torch.Generator().manual_seed(0)
    b, d, length = 2, BLOCK_D + 7, 2 * CHUNK + 7
    act = getattr(torch, dtype)
    u, z = (torch.randn(b, length, d, generator=g).transpose(1, 2).to(act) for _ in range(2))
    dt = torch.rand(b, d, length, generator=g) * 0.1 + 0.001  # float32, as _step_sizes gives it
    B, C = (torch.randn(b, n, length, generator=g).to(act) for _ in range(2))
    A = -torch.rand(d, n, generator=g) * 4 - 0.5
    D = torch.randn(d, generator=g) if skip else None
    z = z if gate else None
    weight = torch.randn(b, d, length, generator=g).to(device)
    results = []
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(torch.device(device).type,
                                                                               enabled=False):
            for scan in (TritonScan, reference):
                inputs = [t.to(device).requires_grad_() if t is not None else None for t in (u, dt, A, B, C, D, z)]
                y = scan.apply(*inputs)
                leaves = [t for t in inputs if t is not None]
                results.append([y.detach().float(), *(t.float() for t in torch.autograd.grad(
                    (y.float() * weight).sum(), leaves))])
    except Exception as e:  # noqa: BLE001 (a kernel that does not compile or launch here, for any reason)
        warnings.warn(f"the Triton selective scan failed on {device} in {dtype} with {n} states ({type(e).__name__}: "
                      f"{e}); training uses the PyTorch scan", stacklevel=2)
        return False
    worst = max(((x - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for x, r in zip(*results))
    if not worst <= TOLERANCE.get(dtype, 1e-4):
        warnings.warn(f"the Triton selective scan differs from the PyTorch scan on {device} in {dtype} with {n} "
                      f"states by {worst:.1e} (relative); training uses the PyTorch scan", stacklevel=2)
        return False
    return True
