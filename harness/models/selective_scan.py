"""Mamba-1's selective scan, parallel over time in plain PyTorch: fast where mamba-ssm's CUDA extension is
missing (CPU, and GPUs where it does not build), equal to the step-by-step recurrence to float32 rounding.

The recurrence per (batch, channel, state) is ``h_t = a_t * h_{t-1} + x_t`` with ``a_t = exp(dt_t * A)`` and
``x_t = dt_t * u_t * B_t``, read out as ``y_t = sum_n C_t h_t``. ``chunked_scan`` cuts time into C chunks of
T ≈ sqrt(L) steps, runs the recurrence inside every chunk at once (T steps over all chunks, zero start), then
carries each chunk's end state into the next (C steps): about 2·sqrt(L) vectorised steps instead of L, the same
multiply-adds as the step loop (no exp/log-space rescaling that could overflow when ``dt * A`` is large).

``SelectiveScan`` is a custom autograd function: it keeps only its inputs (sized like ``u``, not the
``d_state``-times larger states) and recomputes the states in the backward pass, where the gradient of the
states is the same scan run backwards in time. Peak memory is one row group's states of one layer, not every
layer's, which is what let the step loop's autograd graph reach 10 GB at batch 8 and 1,845 tokens.

Written by hand because no installable library does this: mamba-ssm's scan is a CUDA extension, transformers'
parallel options are mambapy (an extra package, unverified against the loop) and ``associative_scan`` (only
under ``torch.compile``)."""
from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

# Rows of the batch are scanned in groups of at most this many state elements (batch x channels x states x
# time), so one layer's transient tensors stay bounded at any batch size: on a CPU small enough to stay near the
# cache (measured fastest here), on a GPU large enough that each vectorised step is one big kernel (every group
# launches about 30·sqrt(L) kernels).
GROUP_ELEMENTS = {"cpu": 2**23, "cuda": 2**28}


_SCRATCH = threading.local()


def scratch(name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised buffer that one thread reuses across calls on a CPU. glibc hands blocks this large back
    to the kernel when freed, and writing to fresh pages cost 4x the arithmetic written into them (measured in
    the backward pass here); a GPU's caching allocator already reuses its blocks."""
    if like.device.type != "cpu":
        return like.new_empty(shape)
    numel = math.prod(shape)
    buffers = _SCRATCH.__dict__
    buf = buffers.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != like.dtype:
        buf = buffers[name] = like.new_empty(numel)
    return buf[:numel].view(shape)


def chunk_length(length: int) -> int:
    """T ≈ sqrt(L): T steps inside the chunks plus L/T across them is the fewest vectorised steps."""
    return max(1, math.isqrt(max(length - 1, 0)) + 1)


def chunked_scan(decay, inputs, steps: int, each, reverse: bool = False, out: torch.Tensor | None = None,
                 start: torch.Tensor | None = None) -> torch.Tensor:
    """Runs ``h_t = a_t * h_{t-1} + x_t`` (``h_{-1} = 0``; ``reverse``: ``h_t = a_t * h_{t+1} + x_t``) over time
    laid out as [T, C, ...] (step within a chunk, chunk: ``to_chunks``), calling ``each(i, h)`` with the states
    of step ``i`` of every chunk, in time order; returns the state entering every chunk (pass it back as
    ``start`` to run the same scan again without its first two passes). ``decay(i)`` gives a_t for step i of
    every chunk and ``inputs(i)`` a pair whose (broadcast) product is x_t, added in place, so neither x nor,
    unless ``out`` keeps every state, h exists for a whole layer (on a CPU each step's tensors stay in cache).
    Three passes: each chunk's end state from zero and its decay product, for all chunks at once; the exact
    state entering every chunk, one step per chunk; the recurrence inside every chunk from that state."""
    order = list(range(steps))[::-1] if reverse else list(range(steps))
    if start is None:
        end = torch.mul(*inputs(order[0]))
        product = decay(order[0]).clone()
        for i in order[1:]:
            a = decay(i)
            end.mul_(a).addcmul_(*inputs(i))
            product.mul_(a)
        chunks = list(range(end.shape[0]))[::-1] if reverse else list(range(end.shape[0]))
        start = torch.zeros_like(end)
        for prev, j in zip(chunks, chunks[1:]):
            torch.addcmul(end[prev], product[prev], start[prev], out=start[j])
        del end, product
    state = start
    spare = [scratch("scan_state_a", start.shape, start), scratch("scan_state_b", start.shape, start)]
    for n, i in enumerate(order):  # without ``out``, two buffers in turn: no step allocates its state
        state = torch.mul(decay(i), state, out=spare[n % 2] if out is None else out[i]).addcmul_(*inputs(i))
        each(i, state)
    return start


def to_chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[b, k, L] (L a multiple of ``chunk``) as contiguous [T, C, b, k]: time is (chunk, step in chunk)."""
    b, k, length = t.shape
    return t.reshape(b, k, length // chunk, chunk).permute(3, 2, 0, 1).contiguous()


def from_chunks(t: torch.Tensor) -> torch.Tensor:
    """[T, C, b, k] back to [b, k, L]."""
    steps, c, b, k = t.shape
    return t.permute(2, 3, 1, 0).reshape(b, k, c * steps)


class SelectiveScan(torch.autograd.Function):
    """y[b, d, l] = sum_n C[b, n, l] h[l, b, d, n] for the recurrence above; float32 inside, inputs' dtype out.
    Shapes as mamba-ssm's kernel: u, dt [b, d, l] (dt after bias and softplus), A [d, n], B, C [b, n, l].
    Keeps its inputs and the state entering every chunk (1/T of the states) for the backward pass."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C):
        with torch.autocast(u.device.type, enabled=False):
            out = [_forward_rows(*rows, A.float()) for rows in _row_groups(u, dt, B, C, A=A)]
        ctx.save_for_backward(u, dt, A, B, C, *(start for _, start in out))
        return torch.cat([y for y, _ in out]).to(u.dtype)

    @staticmethod
    def backward(ctx, dy):
        u, dt, A, B, C, *starts = ctx.saved_tensors
        parts = []
        with torch.autocast(u.device.type, enabled=False):
            for rows, start in zip(_row_groups(u, dt, B, C, dy, A=A), starts):
                parts.append(_backward_rows(*rows, A.float(), start))
        du, ddt, dB, dC = (torch.cat([p[k] for p in parts]) for k in range(4))
        dA = sum(p[4] for p in parts)
        return du.to(u.dtype), ddt.to(dt.dtype), dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype)


def _row_groups(*tensors, A):
    """The tensors' rows in groups of at most ``GROUP_ELEMENTS`` states, as float32 in the [T, C, b, k]
    layout, time padded to whole chunks with steps that change nothing (dt = 0: decay 1, input 0)."""
    b, d, length = tensors[0].shape
    chunk = chunk_length(length)
    pad = -length % chunk
    budget = GROUP_ELEMENTS.get(tensors[0].device.type, GROUP_ELEMENTS["cpu"])
    step = max(1, budget // max(1, d * A.shape[1] * (length + pad)))
    for i in range(0, b, step):
        yield tuple(to_chunks(F.pad(t[i:i + step].float(), (0, pad)), chunk) for t in tensors) + (length,)


def _forward_rows(u, dt, B, C, length, A):
    dtu = dt * u
    y = torch.empty_like(u)

    def read(i, h):
        torch.matmul(h, C[i].unsqueeze(-1), out=y[i].unsqueeze(-1))

    decay = scratch("decay", (*u.shape[1:], A.shape[1]), u)

    start = chunked_scan(lambda i: torch.mul(dt[i].unsqueeze(-1), A, out=decay).exp_(),
                         lambda i: (dtu[i].unsqueeze(-1), B[i].unsqueeze(-2)), len(u), read)
    return from_chunks(y)[..., :length], start


def _backward_rows(u, dt, B, C, dy, length, A, start):
    steps = len(u)
    dtu = dt * u
    shape = (*u.shape, A.shape[1])
    a = torch.mul(dt.unsqueeze(-1), A, out=scratch("decays", shape, u)).exp_()  # read twice by each scan below

    def ahead(i):  # a_{t+1}: the next step of the chunk, or the next chunk's first (1 past the end)
        return a[i + 1] if i + 1 < steps else torch.cat([a[0, 1:], torch.ones_like(a[0, :1])])

    h = scratch("states", shape, u)
    dC = torch.empty_like(B)

    def keep(i, state):  # dL/dC from y = sum_n C h
        torch.matmul(dy[i].unsqueeze(-2), state, out=dC[i].unsqueeze(-2))

    chunked_scan(a.__getitem__, lambda i: (dtu[i].unsqueeze(-1), B[i].unsqueeze(-2)), steps, keep, out=h,
                 start=start)
    # g_t = dL/dh_t = C_t dy_t + a_{t+1} g_{t+1}: the same scan backwards in time, each step's decay moved one
    # step back.
    du, ddt, dB = torch.empty_like(u), torch.empty_like(u), torch.empty_like(B)
    ga_dt = torch.zeros_like(h[0])  # sum over time of dL/d(dt A) * dt, reduced to dL/dA at the end
    ga_buf, gB_buf = scratch("ga", h.shape[1:], u), scratch("gB", (*u.shape[1:], 1), u)

    def grads(i, g):
        # h_{t-1} (zero before the first step): the previous step of the chunk, or the previous chunk's last
        prev = h[i - 1] if i else torch.cat([torch.zeros_like(h[-1, :1]), h[-1, :-1]])
        ga = torch.mul(g, a[i], out=ga_buf)  # dL/d(dt A) = g_t a_t h_{t-1}
        ga *= prev
        ga_dt.addcmul_(ga, dt[i].unsqueeze(-1))
        gB = torch.matmul(g, B[i].unsqueeze(-1), out=gB_buf).squeeze(-1)  # sum_n g B, for x = dt u B
        torch.matmul(dtu[i].unsqueeze(-2), g, out=dB[i].unsqueeze(-2))
        torch.addcmul(ga.mul_(A).sum(-1), gB, u[i], out=ddt[i])
        torch.mul(gB, dt[i], out=du[i])

    chunked_scan(ahead,
                 lambda i: (dy[i].unsqueeze(-1), C[i].unsqueeze(-2)), steps, grads, reverse=True)
    return tuple(from_chunks(g)[..., :length] for g in (du, ddt, dB, dC)) + (ga_dt.sum((0, 1)),)


def _step_sizes(dt, delta_bias, delta_softplus):
    """dt with mamba-ssm's bias and softplus applied (elementwise: left to autograd)."""
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    return F.softplus(dt.float()) if delta_softplus else dt


def selective_scan(u, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """mamba-ssm's ``selective_scan_fn`` (no returned state), with the skip term ``D``, the gate ``z``, the
    bias and softplus of ``dt`` left to autograd (they are elementwise and sized like ``u``)."""
    y = SelectiveScan.apply(u, _step_sizes(dt, delta_bias, delta_softplus), A, B, C)
    if D is not None:
        y = y + u * D[:, None]
    if z is not None:
        y = y * F.silu(z)
    return y


def sequential_scan(u, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """The step-by-step reference (one step per token, autograd through every step; the trainer's scan until
    0.4.0): what the tests and the scan benchmark compare ``selective_scan`` against."""
    dt_t = _step_sizes(dt, delta_bias, delta_softplus).permute(2, 0, 1).float()  # l b d, contiguous steps
    a = torch.exp(dt_t[..., None] * A.float()).unbind(0)
    x = ((dt_t * u.permute(2, 0, 1).float())[..., None] * B.permute(2, 0, 1).float()[:, :, None, :]).unbind(0)
    state = torch.zeros_like(a[0])
    ys = []
    for at, xt, ct in zip(a, x, C.permute(2, 0, 1).float().unbind(0)):
        state = at * state + xt
        ys.append(torch.einsum("bdn,bn->bd", state, ct))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + u.float() * D[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(u.dtype)
