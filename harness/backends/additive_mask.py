"""A masked family's attention mask built once a forward, as the additive 4D mask SDPA computes in.

Given a 2D padding mask, transformers builds a boolean 4D mask per forward and SDPA turns it into an additive one
in every layer (``torch.where`` over queries x keys): on a CPU, for a 1,000-token segment after 1,400 cached
tokens, that conversion cost as much as a fifth of the attention kernel, six times a forward
(``benchmarks/throughput.py``). transformers takes a prepared 4D mask as it is (its documented custom-mask
input), so the backend builds the additive one itself, once. Where transformers builds no mask at all (no
padding, and one query or as many queries as keys: SDPA's causal flag, which skips the masked blocks), the 2D
mask is passed on unchanged.

The mask's values are 0 and the dtype's minimum, not -inf: a query with no key to see (a left pad's own position)
then averages instead of returning NaN, and every other row is the boolean mask's result to the bit (the minimum
underflows to exactly 0 in the softmax, as -inf does).

Told of the mask as a ``BuiltMask`` (``chunked_attention.known``), attention that computes its scores itself
(``chunked_attention.onednn_attention``) knows where such a mask is not zero (``BuiltMask.masked_spans``: the
row's pads and each chunk's own triangle) and adds it there only: an unpadded 1,400-token segment after 850 cached tokens added its mask over every score, 14% of the
attention's time, where a chunk of 512 queries needs it over its last 512 keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def additive_mask(attention_mask: torch.Tensor, queries: int, dtype: torch.dtype) -> torch.Tensor:
    """The (rows, 1, queries, keys) additive causal mask of a 2D padding mask whose last ``queries`` columns are
    this forward's tokens, or the 2D mask itself where transformers would need no 4D mask."""
    keys = attention_mask.shape[1]
    padded = not bool(attention_mask.all())
    if not padded and (queries == 1 or queries == keys):
        return attention_mask
    if not padded:  # the causal triangle alone, written in two passes (a prefix tree's segments: 1.4 ms -> 0.5)
        low = torch.finfo(dtype).min
        causal = torch.full((queries, keys), low, dtype=dtype, device=attention_mask.device).triu_(keys - queries + 1)
        return causal.expand(attention_mask.shape[0], 1, queries, keys).contiguous()
    seen = attention_mask.bool()[:, None, None, :]
    if queries > 1:  # query i (at key position keys - queries + i) sees keys up to its own
        causal = torch.ones((queries, keys), dtype=torch.bool, device=attention_mask.device).tril(keys - queries)
        seen = seen & causal
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(seen, zero, torch.finfo(dtype).min)


@dataclass(frozen=True)
class BuiltMask:
    """A mask ``additive_mask`` built ([rows, 1, queries, keys]) and its 2D padding mask ([rows, keys], 0 at a pad):
    key j is masked for query i of a row iff j is one of the row's pads or j > keys - queries + i."""

    mask: torch.Tensor
    padding: torch.Tensor
    _pads: dict = field(default_factory=dict, compare=False)

    def describes(self, mask: torch.Tensor) -> bool:
        """Whether ``mask`` is this mask, or its first keys (``mask[..., :kv]``, as attention slices it):
        transformers hands a prepared 4D mask to every layer as it is (``tests/test_fused_forward.py``)."""
        m = self.mask
        return (mask.data_ptr() == m.data_ptr() and mask.dim() == 4 and mask.shape[:3] == m.shape[:3]
                and mask.shape[3] <= m.shape[3] and mask.stride() == m.stride() and mask.dtype == m.dtype)

    def masked_spans(self, row: int, start: int, end: int, keys: int) -> list[tuple[int, int]]:
        """The column spans, sorted and disjoint, where the mask's queries ``start..end-1`` (indices among its
        queries) have a nonzero entry among its first ``keys`` columns: every other column is zero there."""
        past = self.mask.shape[3] - self.mask.shape[2]
        spans = [(lo, min(hi, keys)) for lo, hi in self.pad_runs(row) if lo < keys]
        if past + start + 1 < keys:  # the first query sees no key after its own; the last sees up to its own
            spans.append((past + start + 1, keys))
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        return merged

    def pad_runs(self, row: int) -> list[tuple[int, int]]:
        """The row's runs of pads, as [lo, hi) spans (once a row)."""
        if row not in self._pads:
            pad = torch.cat([torch.zeros(1, dtype=torch.int8), (self.padding[row] == 0).to("cpu", torch.int8),
                             torch.zeros(1, dtype=torch.int8)])
            edges = (pad[1:] - pad[:-1]).nonzero().flatten().tolist()  # starts and ends of runs, in turn
            self._pads[row] = list(zip(edges[::2], edges[1::2]))
        return self._pads[row]

