"""Attention masks shared by the project's models and read by nothing else: a leaf module, so the models never
import the decode loop."""
from __future__ import annotations

import torch


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
