"""Causal attention over packed rows in one call on a GPU: every sample a sequence of its own for
``torch.nn.attention.varlen`` (flash attention over cumulative sequence positions), instead of one SDPA call a
sample (``harness.models.masks.per_sample_attention``: 64 calls a layer at the grid's batch of 64).

The rows' tokens are taken in their flattened order and cut into consecutive segments: each sample, and each
stretch outside every sample (a row's padded tail), which attends only to itself and is zeroed after, as the
per-sample path leaves it. Flash attention runs on CUDA in half precision only, and its signature changed
between torch releases (``is_causal`` in 2.9, ``window_size`` since), so a device uses it only after
``verified_on`` has compared it, forward and backward, with the per-sample path there."""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.nn.functional as F

from harness.ops.checked import agrees

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # flash and SDPA's kernels round apart in half precision


def packed_segments(spans: list[tuple[int, int, int]], rows: int, width: int) -> tuple[list[int], torch.Tensor]:
    """(boundaries, inside) for ``rows`` packed rows of ``width`` tokens and the samples' ``spans`` (row, offset,
    length): the cumulative positions, in the rows' flattened order, of consecutive segments that are each a
    sample or a stretch outside every sample; ``inside`` [rows, width] is True on the samples' tokens."""
    cuts = {r * width for r in range(rows + 1)}
    inside = torch.zeros(rows, width, dtype=torch.bool)
    for row, at, n in spans:
        if n:
            cuts |= {row * width + at, row * width + at + n}
            inside[row, at:at + n] = True
    return sorted(cuts), inside


def segmented_attention(attend: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """[b, t, heads, d] causal attention of each sample to itself, [b, heads, t, d] inputs, as ``attend``
    (``varlen_attn``'s form: [tokens, heads, d] each, int32 boundaries twice, the longest segment twice) computes
    it over ``packed_segments``; zeros outside every sample."""
    b, heads, t, _ = query.shape
    bounds, inside, longest = _segments_on(spans, b, t, query.device)

    def flat(x):
        return x.transpose(1, 2).reshape(b * t, x.shape[1], x.shape[-1])

    out = attend(flat(query), flat(key), flat(value), bounds, bounds, longest, longest)
    out = out.reshape(b, t, heads, value.shape[-1])
    return torch.where(inside[:, :, None, None], out, out.new_zeros(()))


_last: list = []  # the last packed batch's spans, shape and device, then its segments there


def _segments_on(spans: list, rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``packed_segments`` on ``device`` (int32 boundaries, ``inside``) and the longest segment, made once a
    packed batch: every attention layer of a forward reads the same spans object, and each copy to a GPU would
    wait for the work queued before it."""
    if not (_last and _last[0] is spans and _last[1:4] == [rows, width, device]):
        cuts, inside = packed_segments(spans, rows, width)
        _last[:] = [spans, rows, width, device, torch.tensor(cuts, dtype=torch.int32).to(device), inside.to(device),
                    max(hi - lo for lo, hi in zip(cuts, cuts[1:]))]
    return _last[4], _last[5], _last[6]


@functools.lru_cache(maxsize=None)
def flash_varlen(scale: float | None) -> Callable | None:
    """``varlen_attn`` made causal with ``scale`` in this torch's signature (None: it has no varlen attention,
    or no way to set a scale other than its own 1/sqrt(d), which the caller's is not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # lazy: absent before torch 2.9
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        causal["scale"] = scale
    elif scale is not None:
        return None
    return functools.partial(varlen_attn, **causal)


def sdpa_segments(scale: float | None) -> Callable:
    """``varlen_attn``'s contract by one causal SDPA call a segment: the reference ``verified_on`` checks
    against, and what the tests run on a CPU, where flash attention does not."""
    def attend(q, k, v, cu_q, _cu_k, _max_q, _max_k):
        cuts = cu_q.tolist()
        return torch.cat([F.scaled_dot_product_attention(*(x[lo:hi].transpose(0, 1) for x in (q, k, v)),
                                                         is_causal=True, scale=scale).transpose(0, 1)
                          for lo, hi in zip(cuts, cuts[1:])])
    return attend


@functools.lru_cache(maxsize=None)
def verified_on(device: str, dtype: torch.dtype, heads: int, head_dim: int, scale: float | None) -> bool:
    """Whether flash's varlen attention runs on this device for this class of call (half precision, heads, head
    width, scale) and equals the per-segment SDPA there, output and gradients, on packed rows with a padded
    tail: checked once per process and class; False (with a warning where it was tried) leaves packed rows on
    one SDPA call a sample."""
    attend = flash_varlen(scale)
    if torch.device(device).type != "cuda" or dtype not in TOLERANCE or attend is None:
        return False
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 37, head_dim, generator=g).to(device, dtype) for _ in range(3))
    weight = torch.randn(2, 37, heads, head_dim, generator=g).to(device)
    spans = [(0, 0, 20), (0, 20, 9), (1, 0, 37)]  # a row of two samples and a padded tail, a row of one

    def run():
        results = []
        for fn in (attend, sdpa_segments(scale)):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            y = segmented_attention(fn, *leaves, spans)
            results.append([y.detach(), *torch.autograd.grad((y.float() * weight).sum(), leaves)])
        return results

    return agrees(run, TOLERANCE[dtype], "varlen attention", "per-sample SDPA", device,
                  f"{device} in {dtype} with {heads} heads of {head_dim}", "packed rows attend one sample a call")
