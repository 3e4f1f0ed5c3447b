"""Attention masks shared by the project's models and read by nothing else: a leaf module, so the models never
import the decode loop."""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from harness.models.packing import current_spans
from harness.ops import varlen_attention

# The Transformer's attention (``build_model``): transformers' SDPA attention under a mask function that, inside
# ``causal_rows``, leaves the mask to SDPA's causal flag. transformers decides that itself by reading the data
# (packed-sequence detection, ``padding_mask.all()``), which it cannot do while a CUDA graph is captured: there it
# builds a dense causal mask, which keeps SDPA off flash attention. On an H100 (0.5M Transformer, n=64 retrieval,
# batch 64) the graphed step then ran memory-efficient attention, 168 ms against 99 ms eager, and parted from the
# eager step by 2.7e-3 in the loss within 8 steps at n=16 direct, where two eager runs agree exactly.
CAUSAL_SDPA = "icr_causal_sdpa"
_CAUSAL_ROWS: contextvars.ContextVar[bool] = contextvars.ContextVar("causal_rows", default=False)


@contextlib.contextmanager
def causal_rows():
    """Within it, a forward without an attention mask or cache (the trainer's padded rows: padding only after
    each sample's tokens, never a target) attends causally through SDPA's causal kernels, captured or not."""
    token = _CAUSAL_ROWS.set(True)
    try:
        yield
    finally:
        _CAUSAL_ROWS.reset(token)


def in_causal_rows() -> bool:
    """Whether a forward runs inside ``causal_rows``; False while dynamo traces (a compiled decode step is never
    the trainer's rows, and dynamo cannot trace a context variable)."""
    return not torch.compiler.is_compiling() and _CAUSAL_ROWS.get()


@functools.cache
def register_causal_sdpa() -> str:
    """``CAUSAL_SDPA`` registered with transformers' attention and mask interfaces (public: custom attention);
    outside ``causal_rows`` and packed rows it is transformers' own SDPA attention and mask. Returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa_mask, sdpa = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"], ALL_ATTENTION_FUNCTIONS["sdpa"]

    def mask(*args, **kwargs):
        if (in_causal_rows() and kwargs.get("attention_mask") is None) or current_spans() is not None:
            return None
        return sdpa_mask(*args, **kwargs)

    def attention(module, query, key, value, attention_mask, **kwargs):
        spans = current_spans()
        if spans is None or query.shape[2] != key.shape[2]:
            return sdpa(module, query, key, value, attention_mask, **kwargs)
        scale = kwargs.get("scaling")
        if not kwargs.get("dropout") and key.shape[1] == query.shape[1] and varlen_attention.verified_on(
                str(query.device), query.dtype, query.shape[1], query.shape[-1], scale):
            # a GPU: every sample in one flash call
            return varlen_attention.segmented_attention(varlen_attention.flash_varlen(scale), query, key, value,
                                                        spans), None
        return per_sample_attention(lambda q, k, v: sdpa(module, q, k, v, None, **{**kwargs, "is_causal": True})[0],
                                    query, key, value, spans)

    AttentionInterface.register(CAUSAL_SDPA, attention)
    AttentionMaskInterface.register(CAUSAL_SDPA, mask)
    return CAUSAL_SDPA


def per_sample_attention(causal, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         spans: list[tuple[int, int, int]]) -> tuple[torch.Tensor, None]:
    """Attention over packed rows, each sample (``spans``: row, offset, length) attending causally to itself
    alone: ``causal(q, k, v)`` ([1, heads, n, d] each, giving [1, n, heads, d]) once a sample. A dense
    block-diagonal mask would compute every row's whole square (SDPA cannot skip masked blocks, and a mask keeps
    it off its causal kernels: a packed Transformer step ran 0.95x the padded one on a CPU); a sample alone is
    the lower half of its own square. Positions outside every span (a row's padded tail) give zeros, which reach
    no loss. On a GPU, ``harness.ops.varlen_attention`` computes the same in one flash call where it passes its
    check (varlen attention is CUDA's flash kernel only: this loop is every other device's)."""
    b, _, t, _ = query.shape
    out = query.new_zeros(b, t, query.shape[1], value.shape[-1])
    for row, at, n in spans:
        if n:
            out[row, at:at + n] = causal(query[row:row + 1, :, at:at + n], key[row:row + 1, :, at:at + n],
                                         value[row:row + 1, :, at:at + n])[0]
    return out, None


def block_attention_mask(attention_mask: torch.Tensor, q_len: int, starts: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Boolean [B, 1, q_len, T] mask for the last ``q_len`` queries over all T positions: causal and
    padding-aware. A padded query may see itself, so no row is all-masked (which would give NaN). ``starts``
    [B, T] (packed rows, q_len = T: 1 at each sample's first token) also confines each query to its sample."""
    t = attention_mask.shape[1]
    dev = attention_mask.device
    allowed = torch.ones(q_len, t, dtype=torch.bool, device=dev).tril(t - q_len)[None] & attention_mask.bool()[:, None]
    # each query's own position: the diagonal at offset t - q_len, built on the device (index tensors made on
    # the host are a host-to-device copy, which a CUDA graph capture refuses)
    own = torch.ones(q_len, t, dtype=torch.bool, device=dev).tril(t - q_len).triu(t - q_len)
    if starts is not None:
        sample = starts.cumsum(1)
        allowed = allowed & (sample[:, :, None] == sample[:, None, :])
    return (allowed | own[None])[:, None]
