"""Mamba-1's selective scan as fused Triton kernels for a GPU without mamba-ssm's CUDA extension, with the states
kept on chip in both passes.

Per (row, channel, state) the scan is the scalar recurrence ``h_t = a_t h_{t-1} + x_t`` (``a_t = exp(dt_t A)``,
``x_t = dt_t u_t B_t``), read out as ``y_t = sum_n C_t h_t``. One program owns (row, block of channels) and walks
its time in chunks of steps (``TILES``: the chunk and the block by the layer's channels); inside a chunk each
state's recurrence is one parallel prefix scan over the chunk's steps (``tl.associative_scan``) seeded with the
state entering the chunk, which the program carries in registers to the next. Nothing the size of steps x
channels x states ever reaches memory:

    ``_scan_forward``   the gated output, and the state entering every chunk (chunks x channels x states, the
                        backward's checkpoints: 1/64 of the states, not the states)
    ``_scan_backward``  the chunks in reverse: each chunk's states recomputed from its checkpoint, the state
                        gradient ``g_t = C_t dy_t + a_{t+1} g_{t+1}`` as a reversed prefix scan seeded with what
                        the chunk after it handed back (carried in registers), then every gradient

The memory they move is their inputs, outputs and gradients, plus (backward) one partial sum of dB and dC per
block of channels. Sums run in a fixed order (each program loops its chunks and states in order, and the partial
sums over channel blocks (dB, dC) and over rows (dA, dD) are reduced by a plain torch sum, no atomics), so a run
is reproducible bit for bit on one device and build.

Written by hand because no installable library has Mamba-1's scan in Triton (mamba-ssm's is CUDA C++; its
Triton kernels are Mamba-2's, whose decay is a scalar per head). Tested against the sequential scan in Triton's
CPU interpreter and compiled for sm_80/sm_90 in the tests; on a GPU ``selective_scan`` uses it only after
``verified_on`` has compared it with the PyTorch scan on that device."""
from __future__ import annotations

import contextlib
import functools
import types

import torch
import triton
import triton.language as tl

from harness.ops.scan_triton_steps import (_entering, _handed_back, _in_split, _split_ends_backward,
                                           _split_ends_forward, _steps_backward, _steps_forward)
from harness.ops.checked import agrees
from harness.ops.triton_shared import store_rounded

# The tile a scan takes by its channels where tiles are not timed (``scan_tuning``: on a GPU each class of launch
# times these, each in 1, 2, 4 and 8 splits, and takes the fastest): (up to this many channels, (layout, steps of
# a chunk (a power of two), channels a program owns, warps a program runs on, splits of time run side by side
# (``scan_triton_steps``; 1 launches no side pass))). Measured on an
# H100, batch 64, bf16 forward+backward (``benchmarks/scan.py --tune``, docs/results/scan-on-chip.md): at 128
# channels (the 0.5M models) chunks of 64, 4 channels, 1 warp took 4.8 ms at 2,535 steps against 7.1 for the former
# chunks of 32, 16 channels, 4 warps (1.44x; 615 steps 1.25x; the step-by-step layout's best 5.3 ms); at 256
# (1M, 2M) step by step, chunks of 16, 16 channels, 1 warp 6.9 ms against 13.7 (2.0x at 615 and 2,535 steps;
# chunks' best 9.7). More programs of more warps were slower at every size: one warp a program won.
TILES = ((128, ("chunks", 64, 4, 1, 1)), (None, ("steps", 16, 16, 1, 1)))
_forced: tuple | None = None  # the tile a ``tiled`` block sets


def current_tile(dim: int) -> tuple:
    """(layout, chunk, channel block, warps, splits): what a scan of ``dim`` channels launched now runs without a
    tile of its own (``scan_tuning`` gives one on a GPU)."""
    return _forced if _forced is not None else table_tiles(dim)[0]


def table_tiles(dim: int) -> list[tuple]:
    """The tile ``TILES`` gives ``dim`` channels, then the first tile it gives the other layout (if any)."""
    tile = next(tile for most, tile in TILES if most is None or dim <= most)
    return [tile, *[t for _, t in TILES if t[0] != tile[0]][:1]]


def forced() -> bool:
    """Whether a ``tiled`` block sets the tile every scan takes now."""
    return _forced is not None


def tile_name(tile: tuple) -> str:
    """A tile as reports name it: "chunks 64/4/1" (layout, chunk, channel block, warps), "... in 4 splits" where
    time is cut in splits."""
    layout, chunk, block, warps, splits = tile
    return f"{layout} {chunk}/{block}/{warps}" + (f" in {splits} splits" if splits > 1 else "")


def _at_least_one(splits: int) -> int:
    if splits < 1:
        raise ValueError(f"splits={splits}: time is cut into 1 or more splits")
    return splits


@contextlib.contextmanager
def tiled(layout: str, chunk: int, block: int, warps: int, splits: int = 1):
    """Every scan in a block of code on one layout and tile (benchmarks and the quick suite time the choices)."""
    global _forced
    if layout not in ("chunks", "steps"):
        raise ValueError(f"layout={layout!r}: use chunks or steps")
    saved, _forced = _forced, (layout, chunk, block, warps, _at_least_one(splits))
    try:
        yield
    finally:
        _forced = saved


@triton.jit
def _load_tile(ptr, row, offs_d, t, mask, s_b, s_d, s_l):
    """A [channels, steps] tile of a [b, d, l] tensor, as float32."""
    return tl.load(ptr + row * s_b + offs_d[:, None] * s_d + t[None, :] * s_l, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _block(blk, dim, nst, K: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """A program's channels, states and steps of a chunk (offsets), the first step, and the channel masks."""
    offs_d, offs_n, offs_t = blk * BD + tl.arange(0, BD), tl.arange(0, BN), tl.arange(0, K)
    md = offs_d < dim
    return offs_d, offs_n, offs_t, (offs_t == 0)[None, :], md, md[:, None] & (offs_n < nst)[None, :]


@triton.jit
def _keep(resets, row, t, mt, L, HAS_RESETS: tl.constexpr):
    """[1, steps] multipliers of the decays: 0 at a packed sample's first token, else 1 (all 1 without resets:
    the kernels then skip the multiply)."""
    flag = tl.zeros_like(t).to(tl.float32)
    if HAS_RESETS:
        flag = tl.load(resets + row * L + t, mask=mt, other=0.0)
    return (1.0 - flag)[None, :]


@triton.jit
def _then(a1, x1, a2, x2):
    """Two steps of ``h -> a h + x`` as one: first (a1, x1), then (a2, x2)."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _scan_forward(u, dt, z, Bm, Cm, A, D, resets, y, starts, ends, decays,
                  L, dim, nst, n_chunks, per_split, n_splits,
                  su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l,
                  sB_b, sB_n, sB_l, sC_b, sC_n, sC_l, sy_b, sy_d, sy_l,
                  HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_RESETS: tl.constexpr,
                  K: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """``resets`` [b, l] (contiguous, float32): 1 at a packed sample's first token, whose decay is zeroed. Grid
    (rows, channel blocks, splits); ``ends`` and ``decays``: what ``_split_ends_forward`` wrote (unread with one
    split)."""
    row, blk, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, offs_n, offs_t, first, md, mdn = _block(blk, dim, nst, K, BD, BN)
    if HAS_D:
        d_skip = tl.load(D + offs_d, mask=md, other=0.0)
    # the state entering the chunk, all states
    h_in = _entering(ends, decays, row, s, n_splits, dim, nst, offs_d, offs_n, mdn, BD, BN)
    for c in range(s * per_split, tl.minimum((s + 1) * per_split, n_chunks)):
        tl.store(starts + ((row * n_chunks + c) * dim + offs_d[:, None]) * nst + offs_n[None, :], h_in, mask=mdn)
        t = c * K + offs_t
        last = tl.minimum(L - c * K, K) - 1
        at_last = (offs_t == last)[None, :]
        mt = t < L
        m = md[:, None] & mt[None, :]
        dtv = _load_tile(dt, row, offs_d, t, m, sdt_b, sdt_d, sdt_l)  # 0 past the end: a = 1, x = 0
        uv = _load_tile(u, row, offs_d, t, m, su_b, su_d, su_l)
        dtu = dtv * uv
        keep = _keep(resets, row, t, mt, L, HAS_RESETS)
        out = tl.zeros((BD, K), dtype=tl.float32)
        for n in range(0, nst):
            state_n = (offs_n == n)[None, :]  # state n's column of the [channels, states] tiles
            a = tl.exp(dtv * tl.load(A + offs_d * nst + n, mask=md, other=0.0)[:, None])
            if HAS_RESETS:
                a = a * keep
            x = dtu * tl.load(Bm + row * sB_b + n * sB_n + t * sB_l, mask=mt, other=0.0).to(tl.float32)[None, :]
            seeded = tl.where(first, x + a * tl.sum(tl.where(state_n, h_in, 0.0), axis=1)[:, None], x)
            _, h = tl.associative_scan((a, seeded), 1, _then)
            out += h * tl.load(Cm + row * sC_b + n * sC_n + t * sC_l, mask=mt, other=0.0).to(tl.float32)[None, :]
            h_in = tl.where(state_n, tl.sum(tl.where(at_last, h, 0.0), axis=1)[:, None], h_in)
        if HAS_D:
            out += d_skip[:, None] * uv
        if HAS_Z:
            zv = _load_tile(z, row, offs_d, t, m, sz_b, sz_d, sz_l)
            out = out * zv * tl.sigmoid(zv)
        store_rounded(y + row * sy_b + offs_d[:, None] * sy_d + t[None, :] * sy_l, out, m)


@triton.jit
def _scan_backward(u, dt, z, Bm, Cm, A, D, resets, dout, starts, carries, decays,
                   du, ddt, dz, dB_part, dC_part, dA_part, dD_part,
                   L, dim, nst, n_chunks, per_split, n_splits, n_blocks,
                   su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l, sB_b, sB_n, sB_l,
                   sC_b, sC_n, sC_l, sy_b, sy_d, sy_l, so_b, so_d, so_l, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                   HAS_RESETS: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr):
    """dout read with the sy strides, du, ddt, dz written with the so strides. dB_part, dC_part [b, blocks, n, L],
    dA_part, dD_part [b x splits, d(, n)]: summed over dim 1 (0) after. carries, decays: _split_ends_backward's."""
    row, blk, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, offs_n, offs_t, first, md, mdn = _block(blk, dim, nst, K, BD, BN)
    if HAS_D:
        d_skip = tl.load(D + offs_d, mask=md, other=0.0)
    g_in = _handed_back(carries, decays, row, s, n_splits, dim, nst, offs_d, offs_n, mdn, BD, BN)  # a_{t+1} g_{t+1}
    grad_a, grad_d = tl.zeros((BD, BN), dtype=tl.float32), tl.zeros((BD,), dtype=tl.float32)
    first_chunk, last_chunk = s * per_split, tl.minimum((s + 1) * per_split, n_chunks)
    for j in range(0, last_chunk - first_chunk):
        c = last_chunk - 1 - j
        t = c * K + offs_t
        last = tl.minimum(L - c * K, K) - 1
        at_last = (offs_t == last)[None, :]
        mt = t < L
        m = md[:, None] & mt[None, :]
        dtv = _load_tile(dt, row, offs_d, t, m, sdt_b, sdt_d, sdt_l)
        dt_next = _load_tile(dt, row, offs_d, t + 1, md[:, None] & (offs_t < last)[None, :], sdt_b, sdt_d, sdt_l)
        uv = _load_tile(u, row, offs_d, t, m, su_b, su_d, su_l)
        dy = _load_tile(dout, row, offs_d, t, m, sy_b, sy_d, sy_l)
        if HAS_Z:  # y = ungated * silu(z)
            zv = _load_tile(z, row, offs_d, t, m, sz_b, sz_d, sz_l)
            sig = tl.sigmoid(zv)
            dy_ungated = dy * zv * sig
        else:
            dy_ungated = dy
        h0 = tl.load(starts + ((row * n_chunks + c) * dim + offs_d[:, None]) * nst + offs_n[None, :], mask=mdn,
                     other=0.0)
        dtu = dtv * uv
        keep = _keep(resets, row, t, mt, L, HAS_RESETS)
        keep_next = _keep(resets, row, t + 1, offs_t < last, L, HAS_RESETS)
        d_u = tl.zeros((BD, K), dtype=tl.float32)
        d_dt = tl.zeros((BD, K), dtype=tl.float32)
        ungated = tl.zeros((BD, K), dtype=tl.float32)
        for n in range(0, nst):
            state_n = (offs_n == n)[None, :]  # state n's column of the [channels, states] tiles
            a_n = tl.load(A + offs_d * nst + n, mask=md, other=0.0)[:, None]
            bv = tl.load(Bm + row * sB_b + n * sB_n + t * sB_l, mask=mt, other=0.0).to(tl.float32)[None, :]
            cv = tl.load(Cm + row * sC_b + n * sC_n + t * sC_l, mask=mt, other=0.0).to(tl.float32)[None, :]
            a = tl.exp(dtv * a_n)
            if HAS_RESETS:
                a = a * keep
            x = dtu * bv
            seeded = tl.where(first, x + a * tl.sum(tl.where(state_n, h0, 0.0), axis=1)[:, None], x)
            _, h = tl.associative_scan((a, seeded), 1, _then)
            ungated += h * cv
            # g_t = C_t dy_t + a_{t+1} g_{t+1}: the same recurrence reversed, each step's decay the next step's
            # (0 at the chunk's last step, whose a_{t+1} g_{t+1} is g_in)
            ahead = tl.where((offs_t < last)[None, :], tl.exp(dt_next * a_n), 0.0)
            if HAS_RESETS:
                ahead = ahead * keep_next
            source = dy_ungated * cv
            source = tl.where(at_last, source + tl.sum(tl.where(state_n, g_in, 0.0), axis=1)[:, None], source)
            _, g = tl.associative_scan((ahead, source), 1, _then, reverse=True)
            ga = g * (h - x)  # dL/d(dt A) = g_t a_t h_{t-1}, and a_t h_{t-1} = h_t - x_t
            d_u += g * dtv * bv
            d_dt += g * uv * bv + ga * a_n
            part = ((row * n_blocks + blk) * nst + n) * L + t
            tl.store(dB_part + part, tl.sum(g * dtu, axis=0), mask=mt)
            tl.store(dC_part + part, tl.sum(h * dy_ungated, axis=0), mask=mt)
            grad_a += tl.where(state_n, tl.sum(ga * dtv, axis=1)[:, None], 0.0)
            g_in = tl.where(state_n, tl.sum(tl.where(first, g * a, 0.0), axis=1)[:, None], g_in)
        if HAS_D:
            d_u += d_skip[:, None] * dy_ungated
            grad_d += tl.sum(dy_ungated * uv, axis=1)
            ungated += d_skip[:, None] * uv
        if HAS_Z:
            store_rounded(dz + row * so_b + offs_d[:, None] * so_d + t[None, :] * so_l,
                   dy * ungated * sig * (1 + zv * (1 - sig)), m)
        store_rounded(du + row * so_b + offs_d[:, None] * so_d + t[None, :] * so_l, d_u, m)
        store_rounded(ddt + row * so_b + offs_d[:, None] * so_d + t[None, :] * so_l, d_dt, m)
    tl.store(dA_part + _in_split(row, s, n_splits, dim, nst, offs_d, offs_n), grad_a, mask=mdn)
    if HAS_D:
        tl.store(dD_part + (row * n_splits + s) * dim + offs_d, grad_d, mask=md)


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _time_major(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A [b, k, l] tensor laid out [b, l, k] in memory, as the mixer's tensors are."""
    b, k, length = like.shape
    return like.new_empty((b, length, k), dtype=dtype).transpose(1, 2)


class TritonScan(torch.autograd.Function):
    """``SelectiveScan``'s contract (mamba-ssm's ``selective_scan_fn`` without a returned state) in Triton:
    u, dt, z [b, d, l] (dt after bias and softplus), A [d, n], B, C [b, n, l], D [d]; D and z may be None.
    float32 inside, each gradient in its input's dtype; any strides. Keeps its inputs and the state entering
    every chunk."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, z, resets=None, tile=None):
        # the given tile, else the one read now; the backward launches as the forward did
        ctx.tile = tile or current_tile(u.shape[1])
        y = _time_major(u, u.dtype)
        resets = resets.float().contiguous() if resets is not None else None
        k = _launch(u, dt, A, B, C, D, z, y, ctx.tile, resets)
        starts = u.new_empty((k.rows, k.n_chunks, k.dim, k.nst), dtype=torch.float32)
        ends = decays = k.tensors[5]  # unread with one split
        if k.splits > 1:  # each split's end state from zero and its decays' product, split by split side by side
            ends, decays = (u.new_empty((k.rows, k.splits, k.dim, k.nst), dtype=torch.float32) for _ in range(2))
            _split_ends_forward[k.grid[:2] + (k.splits - 1,)](
                u, dt, B, k.tensors[5], k.tensors[7], ends, decays, *k.sizes, *_strides(u), *_strides(dt),
                *_strides(B), HAS_RESETS=resets is not None, K=k.chunk, BD=k.block, BN=k.bn, num_warps=k.warps)
        forward = _steps_forward if k.layout == "steps" else _scan_forward
        forward[k.grid](*k.tensors, y, starts, ends, decays, *k.sizes, *k.strides, **k.flags, num_warps=k.warps)
        ctx.save_for_backward(u, dt, A, B, C, D, z, resets, starts)
        return y

    @staticmethod
    def backward(ctx, dout):
        u, dt, A, B, C, D, z, resets, starts = ctx.saved_tensors
        k = _launch(u, dt, A, B, C, D, z, dout, ctx.tile, resets)
        du, ddt = _time_major(u, u.dtype), _time_major(u, dt.dtype)
        dz = _time_major(u, z.dtype) if z is not None else du  # not written without a gate
        dB_part = u.new_empty((k.rows, k.blocks, k.nst, k.length), dtype=torch.float32)
        dC_part = torch.empty_like(dB_part)
        dA_part = u.new_empty((k.rows * k.splits, k.dim, k.nst), dtype=torch.float32)
        dD_part = u.new_empty((k.rows * k.splits, k.dim), dtype=torch.float32) if D is not None else dA_part
        outputs = [du, ddt, dz, dB_part, dC_part, dA_part, dD_part]
        if k.layout == "steps":  # a chunk's recomputed states, one slab a program
            outputs.append(u.new_empty((k.rows * k.blocks * k.splits, k.chunk, k.block, k.bn), dtype=torch.float32))
        carries = decays = k.tensors[5]  # unread with one split
        if k.splits > 1:  # the gradient each split hands back from zero after it, and its decays' product
            carries, decays = (u.new_empty((k.rows, k.splits, k.dim, k.nst), dtype=torch.float32) for _ in range(2))
            _split_ends_backward[k.grid[:2] + (k.splits - 1,)](
                dt, k.tensors[2], C, k.tensors[5], k.tensors[7], dout, carries, decays, *k.sizes, *_strides(dt),
                *_strides(k.tensors[2]), *_strides(C), *_strides(dout), HAS_Z=z is not None,
                HAS_RESETS=resets is not None, K=k.chunk, BD=k.block, BN=k.bn, num_warps=k.warps)
        backward = _steps_backward if k.layout == "steps" else _scan_backward
        backward[k.grid](*k.tensors, dout, starts, carries, decays, *outputs, *k.sizes, k.blocks, *k.strides,
                         *_strides(du), **k.flags, num_warps=k.warps)
        return (du, ddt, dA_part.sum(0).to(A.dtype), _over_blocks(dB_part).to(B.dtype),
                _over_blocks(dC_part).to(C.dtype), dD_part.sum(0).to(D.dtype) if D is not None else None,
                dz if z is not None else None, None, None)


def _over_blocks(part: torch.Tensor) -> torch.Tensor:
    """[b, channel blocks, n, l] partial sums summed over the blocks (one block: a view)."""
    return part[:, 0] if part.shape[1] == 1 else part.sum(1)


def _launch(u, dt, A, B, C, D, z, out, tile, resets=None) -> types.SimpleNamespace:
    """What every launch of one scan's kernels shares: the ``tile`` (layout, chunk, channel block, warps, splits),
    the grid, the leading tensors (float32 A and D), the sizes, the strides of the inputs and of ``out`` (read or
    written with the last stride triple), the flags."""
    rows, dim, length = u.shape
    nst = A.shape[1]
    layout, chunk, block, warps, wanted = tile
    grid, blocks, n_chunks, bn = _grid(u, nst, tile)
    per_split, splits = splits_of(n_chunks, wanted)
    a32 = A.float().contiguous()
    zz = z if z is not None else u
    return types.SimpleNamespace(
        rows=rows, dim=dim, length=length, nst=nst, grid=(*grid, splits), blocks=blocks, n_chunks=n_chunks, bn=bn,
        chunk=chunk, block=block, warps=warps, layout=layout, splits=splits,
        tensors=(u, dt, zz, B, C, a32, D.float().contiguous() if D is not None else a32,
                 resets if resets is not None else a32),
        sizes=(length, dim, nst, n_chunks, per_split, splits),
        strides=(*_strides(u), *_strides(dt), *_strides(zz), *_strides(B), *_strides(C), *_strides(out)),
        flags=dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_RESETS=resets is not None, K=chunk, BD=block,
                   BN=bn))


def fits(shape: tuple[int, int, int], n: int, tile: tuple | None = None) -> bool:
    """Whether every index the kernels form for ``u`` of ``shape`` (b, d, l) on ``tile`` (default: the table's
    for d) fits 32 bits: the inputs (as the mixer lays them out, z a slice of a tensor twice as wide), the partial
    sums of dB and dC (b x channel blocks x n x l), the chunks' states (b x chunks x d x n), the splits' (b x
    splits x d x n) and the step-by-step backward's scratch (b x channel blocks x splits x chunk x block x n)."""
    b, d, length = shape
    layout, chunk, block, _, wanted = tile or current_tile(d)
    blocks, n_chunks, bn = triton.cdiv(d, block), triton.cdiv(length, chunk), triton.next_power_of_2(n)
    padded_d, padded_l, (_, splits) = blocks * block, n_chunks * chunk, splits_of(n_chunks, wanted)
    largest = max(2 * padded_d * padded_l, blocks * n * padded_l, n_chunks * padded_d * bn,
                  splits * chunk * padded_d * bn if layout == "steps" else splits * padded_d * bn)
    return b * largest < 2**31


def splits_of(n_chunks: int, wanted: int) -> tuple[int, int]:
    """(chunks a split, splits) for ``wanted`` splits of ``n_chunks`` chunks: never an empty split, never more
    splits than chunks."""
    per_split = triton.cdiv(n_chunks, max(1, min(wanted, n_chunks)))
    return per_split, triton.cdiv(n_chunks, per_split)




def _grid(u, n, tile):
    """(launch grid, channel blocks, chunks, states padded to a power of two) for u [b, d, l] on ``tile``."""
    b, d, length = u.shape
    _, chunk, block, _, _ = tile
    if not fits(tuple(u.shape), n, tile):
        raise ValueError(f"the Triton scan indexes in 32 bits: {b} rows of {length} steps are too many at once")
    blocks, n_chunks = triton.cdiv(d, block), triton.cdiv(length, chunk)
    return (b, blocks), blocks, n_chunks, triton.next_power_of_2(n)


# How far the Triton scan may part from the PyTorch scan on the same inputs (relative to the largest value): both
# accumulate in float32, so what differs is the order of sums and, in half precision, the outputs' rounding.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


def check_shape(tile: tuple) -> tuple[int, int, int]:
    """(rows, channels, steps) ``verified_on`` checks ``tile`` at: channel blocks, the last short; two chunks a
    split in every one of its splits, the last chunk short."""
    _, chunk, block, _, splits = tile
    return 2, block + 7, 2 * splits * chunk - 3


def random_inputs(shape: tuple[int, int, int], n: int, act: torch.dtype, skip: bool, gate: bool,
                  g: torch.Generator) -> list:
    """[u, dt, A, B, C, D, z] of one launch class on the CPU, drawn from ``g``, laid out as the mixer hands them
    over: u, z, B, C time-major views in the activations' dtype ``act``, dt float32 (as ``_step_sizes`` gives
    it); D and z None without the skip or the gate. What the device check and the tiles' timing run."""
    b, d, length = shape

    def time_major(k):
        return torch.randn(b, length, k, generator=g).transpose(1, 2).to(act)

    u, z = time_major(d), time_major(d)
    dt = torch.rand(b, d, length, generator=g) * 0.1 + 0.001
    B, C = time_major(n), time_major(n)
    A = -torch.rand(d, n, generator=g) * 4 - 0.5
    D = torch.randn(d, generator=g) if skip else None
    return [u, dt, A, B, C, D, z if gate else None]


@functools.lru_cache(maxsize=None)
def verified_on(device: str, reference, dtype: str = "float32", n: int = 16, skip: bool = True,
                gate: bool = True, resets: bool = False, tile: tuple | None = None) -> bool:
    """Whether the Triton scan equals ``reference`` (the PyTorch scan's autograd function) on this device for one
    class of launch (activations in ``dtype``, ``n`` states, with or without the skip ``D`` and the gate ``z``;
    output and every gradient, at a length that is not a multiple of a chunk): checked once per process and
    class (``resets``: packed rows, restarting at samples' first tokens; ``tile``: ``current_tile(channels)``,
    the kernels and tile it runs with) before that class runs, so a kernel that miscompiles or fails on some GPU, in some
    precision or shape, leaves training on the PyTorch scan (with a warning) instead of on wrong numbers. Without
    ``tile``, the narrowest layers' tile."""
    tile = tile or current_tile(1)
    chunk, (b, d, length) = tile[1], check_shape(tile)
    g = torch.Generator().manual_seed(0)
    u, dt, A, B, C, D, z = random_inputs((b, d, length), n, getattr(torch, dtype), skip, gate, g)
    weight = torch.randn(b, d, length, generator=g).to(device)
    starts = None
    if resets:  # at the first step, mid-chunk, twice in a row at a chunk's start
        starts = torch.zeros(b, length, device=device)
        starts[:, [0, 5, chunk, chunk + 1]] = 1

    def run():
        results = []
        for scan in (TritonScan, reference):
            inputs = [t.to(device).requires_grad_() if t is not None else None for t in (u, dt, A, B, C, D, z)]
            with tiled(*tile):
                y = scan.apply(*inputs, starts)
            leaves = [t for t in inputs if t is not None]
            results.append([y.detach(), *torch.autograd.grad((y.float() * weight).sum(), leaves)])
        return results

    return agrees(run, TOLERANCE.get(dtype, 1e-4), "Triton selective scan", "PyTorch scan", device,
                  f"{device} in {dtype} with {n} states", "training uses the PyTorch scan")
