"""Attention masks shared by the project's models and read by nothing else: a leaf module, so the models never
import the decode loop."""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

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


@functools.cache
def register_causal_sdpa() -> str:
    """``CAUSAL_SDPA`` registered with transformers' attention and mask interfaces (public: custom attention);
    outside ``causal_rows`` it is transformers' own SDPA attention and mask. Returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def mask(*args, **kwargs):
        if _CAUSAL_ROWS.get() and kwargs.get("attention_mask") is None:
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(CAUSAL_SDPA, ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register(CAUSAL_SDPA, mask)
    return CAUSAL_SDPA


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
