"""A long block of queries after cached tokens attends in chunks on a CPU: SDPA over the keys each chunk can see.

A segment of s tokens fed after p cached ones (the prefix tree's extends, a prompt's rest after a shared prefix)
is one SDPA call of s queries over p + s keys under a mask, and PyTorch's CPU kernel computes every query-key
pair of it, the masked half of the block's own keys included: its causal flag aligns to the top left, so it
cannot skip the block's upper triangle after cached keys without a mask. Queries in chunks of ``CHUNK``, each
given only the keys at or before its last query, shrink the masked part to the chunks' own triangles. Measured on
one layer (4 heads of 64, float32, 2 threads): p = 1,500, s = 1,000 took 21.9 ms against 28.3 ms; p = 600,
s = 1,800 31.5 against 40.6; below ``MIN_QUERIES`` chunks cost more than they save (s = 300: 6.5 against 5.2).
Each query sees the same keys under the same mask, so only the kernel's blocking changes: the result rounds
apart by ~1e-7, as the tree's segments themselves do. Written here because SDPA has no lower-right causal mode
on a CPU (``torch.nn.attention.bias.causal_lower_right`` materializes the mask there) and transformers chunks
no queries.
"""
from __future__ import annotations

import functools

import torch

CHUNKED_SDPA = "icr_chunked_sdpa"
CHUNK = 256  # queries a call
MIN_QUERIES = 768  # blocks shorter than this attend in one call


def chunked_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, called once a chunk of queries where that pays (a CPU, a long block, a 4D
    mask of the block's queries, nothing else that spans the keys); else called as it is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

    q, kv = query.shape[2], key.shape[2]
    if (query.device.type != "cpu" or q < MIN_QUERIES or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[2] != q or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None):
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    past = kv - q  # the block's queries are the last q positions: a query sees no key after its own
    mask = attention_mask[..., :kv]
    parts = []
    for a in range(0, q, CHUNK):
        b = min(a + CHUNK, q)
        out, _ = sdpa(module, query[:, :, a:b], key[:, :, :past + b], value[:, :, :past + b],
                      mask[:, :, a:b, :past + b], **kwargs)
        parts.append(out)  # [batch, queries, heads, dim]
    return torch.cat(parts, dim=1), None


@functools.cache
def register() -> str:
    """``CHUNKED_SDPA`` in transformers' attention and mask interfaces (its masks are SDPA's). Returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(CHUNKED_SDPA, chunked_sdpa)
    AttentionMaskInterface.register(CHUNKED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return CHUNKED_SDPA


def chunk_attention(model, device: torch.device) -> str | None:
    """On a CPU, a model whose attention is SDPA attends through ``chunked_sdpa`` (set through transformers'
    public ``set_attn_implementation``); what changed, for the run's record (None: nothing)."""
    if device.type != "cpu":
        return None
    try:
        model.set_attn_implementation("sdpa")  # fails where the model cannot take SDPA: left as it is
        model.set_attn_implementation(register())
    except (ValueError, ImportError, AttributeError):
        return None
    return f"SDPA over blocks of >= {MIN_QUERIES} queries in chunks of {CHUNK}, each over the keys it can see"
