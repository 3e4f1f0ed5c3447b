"""Mamba-1's selective scan, parallel over time in plain PyTorch: fast where mamba-ssm's CUDA extension is
missing (CPU, and GPUs where it does not build), equal to the step-by-step recurrence to float32 rounding.

The recurrence per (batch, channel, state) is ``h_t = a_t * h_{t-1} + x_t`` with ``a_t = exp(dt_t * A)`` and
``x_t = dt_t * u_t * B_t``, read out as ``y_t = sum_n C_t h_t``. Time is cut into C chunks of T ≈ sqrt(L)
steps: ``chunk_starts`` runs the recurrence inside every chunk at once from zero (T steps over all chunks) and
carries each chunk's end state into the next (C steps); ``scan_chunks`` runs it again inside every chunk from
its exact start. About 2·sqrt(L) vectorised steps instead of L, with the step loop's multiply-adds (no
exp/log-space rescaling that could overflow when ``dt * A`` is large).

Packed rows (several samples laid end to end, ``harness.models.packing``) restart the recurrence at each
sample's first token: ``starts`` [b, l] (1 there) zeroes that step's decay, ``a_t = 0``, so no state crosses
from one sample into the next, in the forward pass and (through the same decays) in the backward.

``SelectiveScan`` is a custom autograd function: it keeps its inputs (sized like ``u``, not the ``d_state``-times
larger states) and recomputes the states in the backward pass, where the gradient of the states is the same
scan run backwards in time. Peak memory is one row group's states of one layer, not every layer's, which is
what let the step loop's autograd graph reach 10 GB at batch 8 and 1,845 tokens. On a CPU the work is laid out
so that each step's tensors stay in cache (decays recomputed per step rather than stored for a layer, the skip
and gate applied per row group): past the cache, an elementwise op here ran 3-5x slower per byte.

Written by hand because no installable library does this: mamba-ssm's scan is a CUDA extension, transformers'
parallel options are mambapy (an extra package, unverified against the loop) and ``associative_scan`` (only
under ``torch.compile``)."""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.ops.causal_conv import CausalConv

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


def chunk_starts(decay, inputs, steps: int, product: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """The state entering every chunk of ``h_t = a_t * h_{t-1} + x_t`` (``h_{-1} = 0``; ``reverse``:
    ``h_t = a_t * h_{t+1} + x_t``) over time laid out as [T, C, ...] (step within a chunk, chunk: ``to_chunks``).
    ``decay[i]`` is a_t at step i of every chunk, ``inputs[i]`` a pair whose (broadcast) product is x_t (added in
    place: x never exists for a whole layer), ``product`` each chunk's product of decays. Two passes: each
    chunk's end state from zero, all chunks at once; then the exact state entering every chunk, a chunk a step."""
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    end = torch.mul(*inputs[order[0]])
    for i in order[1:]:
        end.mul_(decay[i]).addcmul_(*inputs[i])
    chunks = range(end.shape[0] - 1, -1, -1) if reverse else range(end.shape[0])
    start = torch.zeros_like(end)
    for prev, j in zip(chunks, chunks[1:]):
        torch.addcmul(end[prev], product[prev], start[prev], out=start[j])
    return start


def scan_chunks(decay, inputs, start: torch.Tensor, each, out: torch.Tensor | None = None) -> None:
    """The recurrence inside every chunk at once from ``start`` (``chunk_starts``), calling ``each(i, h)`` with
    step i's states of every chunk in time order; into ``out`` [T, C, ...] if given, else through two buffers in
    turn, so that no step allocates its state (on a CPU each step's tensors stay in cache)."""
    state = start
    spare = [scratch("scan_state_a", start.shape, start), scratch("scan_state_b", start.shape, start)]
    for i in range(len(inputs)):
        state = torch.mul(decay[i], state, out=spare[i % 2] if out is None else out[i]).addcmul_(*inputs[i])
        each(i, state)


def to_chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[b, k, L] as contiguous float32 [T, C, b, k] (time is (chunk, step in chunk)), the last chunk padded with
    zeros: in one copy."""
    b, k, length = t.shape
    full, rest = divmod(length, chunk)
    out = torch.empty((chunk, full + bool(rest), b, k), dtype=torch.float32, device=t.device)
    view = out.permute(2, 3, 1, 0)  # [b, k, C, T]
    view[:, :, :full].copy_(t[..., :full * chunk].unflatten(-1, (full, chunk)))
    if rest:
        view[:, :, full, :rest].copy_(t[..., full * chunk:])
        view[:, :, full, rest:].zero_()
    return out


def from_chunks(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[T, C, b, k] written into ``out`` [b, k, L] (L at most T*C), in one copy."""
    chunk, length = t.shape[0], out.shape[-1]
    full, rest = divmod(length, chunk)
    view = t.permute(2, 3, 1, 0)  # [b, k, C, T]
    out[..., :full * chunk].unflatten(-1, (full, chunk)).copy_(view[:, :, :full])
    if rest:
        out[..., full * chunk:].copy_(view[:, :, full, :rest])
    return out


class SelectiveScan(torch.autograd.Function):
    """mamba-ssm's ``selective_scan_fn`` (no returned state): y[b, d, l] = (sum_n C[b, n, l] h[l, b, d, n]
    + D u) * silu(z) for the recurrence above; float32 inside, inputs' dtype out. Shapes as mamba-ssm's kernel:
    u, dt, z [b, d, l] (dt after bias and softplus), A [d, n], B, C [b, n, l], D [d]; D and z may be None. The
    skip and the gate are applied a row group at a time, in cache, instead of as whole-layer autograd ops. Keeps
    its inputs, the state entering every chunk (1/T of the states) and, with a gate, the ungated output."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, z, starts=None):
        y = torch.empty_like(u, dtype=torch.float32)  # u's memory layout: copies in and out run along it
        ungated = torch.empty_like(y) if z is not None else None
        states, A_nd = [], _states_layout(A)
        with torch.autocast(u.device.type, enabled=False):
            for rows, chunked in _row_groups(u, dt, B, C, A=A, starts=starts):
                out, start = _forward_rows(*chunked[:4], A_nd, *chunked[4:])
                states.append(start)
                part = from_chunks(out, y[rows])
                if D is not None:
                    part.addcmul_(u[rows], D.float()[:, None])
                if z is not None:
                    ungated[rows] = part
                    part.mul_(F.silu(z[rows].float()))
        ctx.save_for_backward(u, dt, A, B, C, D, z, ungated, starts, *states)
        return y.to(u.dtype)

    @staticmethod
    def backward(ctx, dout):
        u, dt, A, B, C, D, z, ungated, starts, *states = ctx.saved_tensors
        grads = [torch.empty_like(t, dtype=torch.float32) for t in (u, dt, B, C)]
        dA = torch.zeros(A.shape, dtype=torch.float32, device=A.device)
        dD = torch.zeros(D.shape, dtype=torch.float32, device=D.device) if D is not None else None
        dz = torch.empty_like(z, dtype=torch.float32) if z is not None else None
        A_nd = _states_layout(A)
        with torch.autocast(u.device.type, enabled=False):
            for (rows, chunked), start in zip(_row_groups(u, dt, B, C, A=A, starts=starts), states):
                dy = dout[rows].to(torch.float32, copy=True)  # changed in place below
                if z is not None:  # d silu(z) / dz = s (1 + z (1 - s)), s = sigmoid(z)
                    zr = z[rows].to(torch.float32, copy=True)
                    s = torch.sigmoid(zr)
                    torch.mul(dy, ungated[rows], out=dz[rows]).mul_(s).mul_(zr.mul_(1 - s).add_(1))
                    dy.mul_(s.mul_(z[rows].float()))
                parts = _backward_rows(*chunked[:4], to_chunks(dy, len(chunked[0])), A_nd, start, *chunked[4:])
                for grad, part in zip(grads, parts):
                    from_chunks(part, grad[rows])
                dA += parts[4].t()
                if D is not None:
                    dD += (dy * u[rows]).sum((0, 2))
                    grads[0][rows].addcmul_(dy, D.float()[:, None])
        du, ddt, dB, dC = grads
        return (du.to(u.dtype), ddt.to(dt.dtype), dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype),
                dD.to(D.dtype) if D is not None else None, dz.to(z.dtype) if z is not None else None, None)


def _states_layout(A: torch.Tensor) -> torch.Tensor:
    """A [d, n] as float32 [n, d], the layout of the states inside the scan (state, then channel): contractions
    over the 16 states then run as [1, n] @ [n, d] products and their sums add rows, 2-3x faster on a CPU than
    over a last dimension of 16 (measured: the readout, sum_n g B and the sum for dL/d(dt))."""
    return A.float().t().contiguous()


def _row_groups(*tensors, A, starts=None):
    """Slices of at most ``GROUP_ELEMENTS`` states' rows, each with the tensors' rows in the chunked layout, and
    with ``starts`` [b, l] the rows' step multipliers ``keep`` = 1 - starts, chunked [T, C, rows, 1] (1 past
    the end)."""
    b, d, length = tensors[0].shape
    chunk = chunk_length(length)
    budget = GROUP_ELEMENTS.get(tensors[0].device.type, GROUP_ELEMENTS["cpu"])
    step = max(1, budget // max(1, d * A.shape[1] * (length + chunk)))
    for i in range(0, b, step):
        rows = slice(i, i + step)
        chunked = tuple(to_chunks(t[rows], chunk) for t in tensors)
        if starts is not None:
            chunked += (to_chunks(starts[rows, None].float(), chunk).neg_().add_(1),)
        yield rows, chunked


class Decays:
    """a_t = exp(dt_t A) at step i of every chunk (A [n, d]: states [..., n, d]); ``ahead``: a_{t+1} (at a
    chunk's last step the next chunk's first, 1 past the end). On a CPU computed when read, into one buffer: each
    pass reads every step once, and a layer's decays stored out of cache cost more to write and read back than to
    recompute in cache. Elsewhere (``STORED``) computed for all steps at once and shared by the passes: there
    each vectorised step is a kernel launch, and memory is plentiful."""

    STORED = {"cpu": False}  # device types not listed store them

    def __init__(self, dt, A, ahead: bool = False, like: Decays | None = None, keep=None):
        self.dt, self.A, self.ahead, self.keep = dt, A, ahead, keep
        if like is not None:
            self.all = like.all
        elif self.STORED.get(dt.device.type, True):
            self.all = torch.exp(dt.unsqueeze(-2) * A)
            if keep is not None:
                self.all.mul_(keep.unsqueeze(-1))
        else:
            self.all = None
        if self.all is not None:
            self.last = torch.cat([self.all[0, 1:], torch.ones_like(self.all[0, :1])]) if ahead else self.all[-1]
        else:
            self.last = torch.cat([dt[0, 1:], torch.zeros_like(dt[0, :1])]) if ahead else dt[-1]
            if keep is not None:
                self.keep_last = torch.cat([keep[0, 1:], torch.ones_like(keep[0, :1])]) if ahead else keep[-1]
                # the steps (of every chunk at once) where some row restarts: only those are multiplied
                self.restarts = (keep == 0).flatten(1).any(1).tolist() + [bool((self.keep_last == 0).any())]
            self.buf = scratch("decays_ahead" if ahead else "decays", (*dt.shape[1:-1], *A.shape), dt)

    def __len__(self):
        return len(self.dt)

    def __getitem__(self, i):
        if self.all is not None:
            return self.last if i + 1 == len(self.dt) else self.all[i + self.ahead]
        return self._exp(i, self.buf)

    def times(self, i, g, out):
        """a_t * g into ``out``."""
        if self.all is not None:
            return torch.mul(self[i], g, out=out)
        return self._exp(i, out).mul_(g)

    def _exp(self, i, out):
        """Step i's decays computed into ``out`` (zero where ``keep`` restarts the recurrence)."""
        last = i + 1 == len(self.dt)
        col = self.last if last else self.dt[i + self.ahead]
        torch.mul(col.unsqueeze(-2), self.A, out=out).exp_()
        if self.keep is not None and self.restarts[len(self.dt) if last else i + self.ahead]:
            out.mul_((self.keep_last if last else self.keep[i + self.ahead]).unsqueeze(-1))
        return out


def _forward_rows(u, dt, B, C, A, keep=None):
    dtu = dt * u
    y = torch.empty_like(u)
    inputs = list(zip(B.unsqueeze(-1).unbind(0), dtu.unsqueeze(-2).unbind(0)))
    reads = list(zip(y.unsqueeze(-2).unbind(0), C.unsqueeze(-2).unbind(0)))
    # a chunk's decays multiply to exp(A * its summed dt): one exp, not a product carried through every step
    decays = Decays(dt, A, keep=keep)
    product = torch.exp(dt.sum(0).unsqueeze(-2) * A)
    if keep is not None:  # zero across a restart
        product.mul_(keep.prod(0).unsqueeze(-1))
    start = chunk_starts(decays, inputs, len(u), product)
    scan_chunks(decays, inputs, start, lambda i, h: torch.matmul(reads[i][1], h, out=reads[i][0]))
    return y, start


def _backward_rows(u, dt, B, C, dy, A, start, keep=None):
    steps = len(u)
    dtu = dt * u
    a = Decays(dt, A, keep=keep)
    h = scratch("states", (*u.shape[:-1], *A.shape), u)
    dC = torch.empty_like(B)
    dy_rows, dtu_rows = dy.unsqueeze(-2).unbind(0), dtu.unsqueeze(-2).unbind(0)
    dC_rows = dC.unsqueeze(-2).unbind(0)
    scan_chunks(a, list(zip(B.unsqueeze(-1).unbind(0), dtu_rows)), start,
                lambda i, state: torch.matmul(dy_rows[i], state.mT, out=dC_rows[i]), out=h)  # dL/dC, y = sum_n C h
    # g_t = dL/dh_t = C_t dy_t + a_{t+1} g_{t+1}: the same scan backwards in time with each decay one step on
    # (a_{t+1} at a chunk's last step is the next chunk's first, 1 past the end)
    ahead = Decays(dt, A, ahead=True, like=a, keep=keep)
    ahead_sum = dt.sum(0) - dt[0]
    ahead_sum[:-1] += dt[0, 1:]
    product = torch.exp(ahead_sum.unsqueeze(-2) * A)
    if keep is not None:  # the same steps' keeps: a chunk's steps after its first, and the next chunk's first
        kept = keep[1:].prod(0)
        kept[:-1] *= keep[0, 1:]
        product.mul_(kept.unsqueeze(-1))
    inputs = list(zip(C.unsqueeze(-1).unbind(0), dy_rows))
    ends = chunk_starts(ahead, inputs, steps, product, reverse=True)
    spare = [scratch("scan_state_a", start.shape, u), scratch("scan_state_b", start.shape, u)]
    g = torch.mul(ahead[steps - 1], ends, out=spare[0]).addcmul_(*inputs[-1])
    du, ddt, dB = torch.empty_like(u), torch.empty_like(u), torch.empty_like(B)
    ga = scratch("ga", start.shape, u)
    prev = h.unbind(0)  # h_{t-1} is prev[i - 1], at a chunk's first step the previous chunk's last
    B_rows, dB_rows = B.unsqueeze(-2).unbind(0), dB.unsqueeze(-2).unbind(0)
    dt_rows = dt.unsqueeze(-2).unbind(0)
    ga_dt = torch.zeros_like(ga)  # sum over time of dL/d(dt A) * dt, reduced to dL/dA at the end
    for i in range(steps - 1, -1, -1):
        gB = torch.matmul(B_rows[i], g).squeeze(-2)  # sum_n B g, for x = B dt u
        torch.matmul(dtu_rows[i], g.mT, out=dB_rows[i])
        torch.mul(gB, dt[i], out=du[i])
        ag = a.times(i, g, spare[(steps - i) % 2])  # a_t g_t: in dL/d(dt A) and in g_{t-1}
        if i:  # dL/d(dt A) = g_t a_t h_{t-1}, h_{-1} = 0
            torch.mul(ag, prev[i - 1], out=ga)
        else:
            torch.mul(ag[1:], prev[-1][:-1], out=ga[1:])
            ga[0].zero_()
        ga_dt.addcmul_(ga, dt_rows[i])
        torch.addcmul(ga.mul_(A).sum(-2), gB, u[i], out=ddt[i])
        if i:
            g = ag.addcmul_(*inputs[i - 1])
    return du, ddt, dB, dC, ga_dt.sum((0, 1))


def _step_sizes(dt, delta_bias, delta_softplus):
    """dt with mamba-ssm's bias and softplus applied (elementwise: left to autograd), in float32 whatever the
    input's precision, as mamba-ssm does: with Mamba's biases (-6.9 ... -2.3) a bf16 sum moved step sizes by up to
    5% and doubled the scan's bf16 gradient error."""
    dt = dt.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[..., None]
    return F.softplus(dt) if delta_softplus else dt


SCANS = ("auto", "torch", "triton", "sequential")
SCANNED_ARCHS = ("mamba", "hybrid")  # the IsTree architectures with a selective scan (``--scan`` applies to them)
SCAN_HELP = ("the trainer's Mamba scan: auto (the Triton kernels on a GPU where they pass their check, else the "
             "PyTorch scan), torch, triton, or sequential (the step-by-step reference: slow, for comparisons)")


@dataclass(frozen=True)
class ScanChoice:
    """Which scan one call runs, on what and in which precision, and which causal convolution runs before it:
    ``choose_scan``'s answer, kept by the mixer that ran it and read back from the model into the trainer's
    result.json (``scans``)."""

    scan: str  # mamba-ssm (transformers' fused path), triton, torch or sequential
    device: str
    dtype: str
    states: int
    checked: bool | None = None  # triton: ran after its check against the PyTorch scan (False: forced)
    conv: str = "torch"  # the mixer's causal convolution: torch (``CausalConv``) or triton (``conv_triton``)
    tile: tuple | None = None  # triton: the tile it launches (``scan_triton.current_tile``'s form)
    timed: bool = False  # triton: the tile is the fastest of its launch class on this GPU (``scan_tuning``)

    def to_json(self) -> dict:
        row = {"scan": self.scan, "device": self.device, "dtype": self.dtype, "states": self.states}
        if self.scan == "triton":
            from harness.ops.scan_triton import tile_name  # lazy: imports triton, which a CPU install may lack

            row["checked"] = bool(self.checked)
            row["checked_in"] = self.dtype if self.checked else None
            row["conv"] = self.conv
            row["tile"] = tile_name(self.tile) if self.tile else None
            row["tile_chosen_by"] = "timing on this GPU (scan_tuning)" if self.timed else "scan_triton.TILES"
        return row


def choose_scan(shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype, states: int,
                scan: str = "auto", skip: bool = True, gate: bool = True, fused: bool = False,
                resets: bool = False) -> ScanChoice:
    """The one place that decides which scan runs for ``u`` of ``shape`` (b, d, l) with ``states`` states.
    ``scan`` is the run's ``--scan`` (``SCANS``); ``fused``: mamba-ssm's fused kernels can run this call
    (transformers' own Mamba path, which ``auto`` prefers). ``auto`` otherwise runs the Triton scan on a CUDA
    tensor where Triton imports, the shape fits its 32-bit indexing and the kernels matched this module's scan
    on that device (checked once per process and launch class; ``resets``: packed rows), else the PyTorch
    scan. ``triton`` on a CPU needs ``TRITON_INTERPRET=1`` (tests)."""
    if scan not in SCANS:
        raise ValueError(f"scan={scan!r}: use {', '.join(SCANS)}")
    where = dict(device=torch.device(device).type, dtype=str(dtype).replace("torch.", ""), states=states)
    if scan == "sequential":
        return ScanChoice("sequential", **where)
    if scan == "auto" and fused:
        return ScanChoice("mamba-ssm", **where)
    if scan == "torch" or (scan == "auto" and torch.device(device).type != "cuda"):
        return ScanChoice("torch", **where)
    try:
        from harness.ops import conv_triton, scan_triton, scan_tuning  # lazy: import triton, which a CPU may lack
    except ImportError:
        if scan == "triton":
            raise
        return ScanChoice("torch", **where)
    tile, timed = scan_tuning.tile_for(shape, torch.device(device), where["dtype"], states, skip, gate, resets)
    if scan == "triton":
        return ScanChoice("triton", **where, checked=False, conv="triton", tile=tile, timed=timed)
    # the tile timed fastest, else the table's: the first that fits and passes its check on this device
    for tile, timed in dict.fromkeys([(tile, timed), (scan_triton.current_tile(shape[1]), False)]):
        if scan_triton.fits(shape, states, tile) and scan_triton.verified_on(str(device), SelectiveScan,
                                                                            where["dtype"], states, skip, gate,
                                                                            resets, tile):
            b, d, length = shape
            conv = conv_triton.fits((b, length, d)) and conv_triton.verified_on(str(device), CausalConv,
                                                                                 where["dtype"], resets=resets)
            return ScanChoice("triton", **where, checked=True, conv="triton" if conv else "torch", tile=tile,
                              timed=timed)
    return ScanChoice("torch", **where)


def run_scan(choice: ScanChoice, u, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             starts=None):
    """mamba-ssm's ``selective_scan_fn`` (no returned state) by the scan ``choice`` names: the skip term ``D``
    and the gate ``z`` applied inside the scan, the bias and softplus of ``dt`` left to autograd (elementwise,
    sized like ``u``); ``starts`` [b, l]: 1 at each packed sample's first token, where the state restarts."""
    if choice.scan == "sequential":
        return sequential_scan(u, dt, A, B, C, D, z, delta_bias, delta_softplus, starts)
    dt = _step_sizes(dt, delta_bias, delta_softplus)
    if choice.scan == "triton":
        from harness.ops.scan_triton import TritonScan  # lazy: imports triton, which a CPU install may lack
        return TritonScan.apply(u, dt, A, B, C, D, z, starts, choice.tile)
    if choice.scan == "torch":
        return SelectiveScan.apply(u, dt, A, B, C, D, z, starts)
    raise ValueError(f"{choice.scan}: runs in transformers' own Mamba path, not here")


def selective_scan(u, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, scan: str = "auto",
                   starts=None):
    """``run_scan`` with the scan ``choose_scan`` picks for these tensors."""
    choice = choose_scan(tuple(u.shape), u.device, u.dtype, A.shape[1], scan, D is not None, z is not None,
                         resets=starts is not None)
    return run_scan(choice, u, dt, A, B, C, D, z, delta_bias, delta_softplus, starts)


_LOGGED_OVERRIDES: set[str] = set()  # ICR_SCAN values already logged in this process


def scan_override(configured: str) -> str:
    """The scan a run uses: ``configured`` (its ``--scan``), unless the environment's ``ICR_SCAN`` names another,
    which then overrides it and says so in the log (once per process and value)."""
    forced = os.environ.get("ICR_SCAN")
    if not forced or forced == configured:
        return configured
    if forced not in _LOGGED_OVERRIDES:
        _LOGGED_OVERRIDES.add(forced)
        logging.getLogger("harness").warning("ICR_SCAN=%s overrides --scan %s (recorded as the run's scan)", forced,
                                             configured)
    return forced



def scan_choice_problem(scan: str) -> str | None:
    """Why ``scan`` cannot be honoured on this machine (None: it can), asked before a run creates anything."""
    if scan not in SCANS:
        return f"--scan {scan!r} (or ICR_SCAN): use {', '.join(SCANS)}"
    if scan != "triton":
        return None
    if importlib.util.find_spec("triton") is None:
        return "--scan triton: Triton is not installed (pip install triton); use --scan auto or torch"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return ("--scan triton: the Triton scan runs on a CUDA GPU and none is visible here (on a CPU only under "
                "Triton's interpreter, TRITON_INTERPRET=1, for tests); use --scan auto or torch")
    return None


def sequential_scan(u, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, starts=None):
    """The step-by-step reference (one step per token, autograd through every step; the trainer's scan until
    0.4.0): what the tests and the scan benchmark compare ``selective_scan`` against."""
    dt_t = _step_sizes(dt, delta_bias, delta_softplus).permute(2, 0, 1).float()  # l b d, contiguous steps
    a = torch.exp(dt_t[..., None] * A.float())
    if starts is not None:  # a packed sample's first token: no state from the sample before
        a = a * (1 - starts.t().float())[:, :, None, None]
    a = a.unbind(0)
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
