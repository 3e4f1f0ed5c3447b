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
"""
from __future__ import annotations

import torch


def additive_mask(attention_mask: torch.Tensor, queries: int, dtype: torch.dtype) -> torch.Tensor:
    """The (rows, 1, queries, keys) additive causal mask of a 2D padding mask whose last ``queries`` columns are
    this forward's tokens, or the 2D mask itself where transformers would need no 4D mask."""
    keys = attention_mask.shape[1]
    padded = not bool(attention_mask.all())
    if not padded and (queries == 1 or queries == keys):
        return attention_mask
    seen = attention_mask.bool()[:, None, None, :]
    if queries > 1:  # query i (at key position keys - queries + i) sees keys up to its own
        causal = torch.ones((queries, keys), dtype=torch.bool, device=attention_mask.device).tril(keys - queries)
        seen = seen & causal
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(seen, zero, torch.finfo(dtype).min)
