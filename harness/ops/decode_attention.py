"""Decode attention over the filled positions of a static key/value buffer (flash-decoding's split-KV form).

The graphed decode step (``harness.backends.kv_decode_graphs``) keeps every layer's keys and values in buffers of
a fixed capacity, so that one captured graph serves many steps, and SDPA attends over the whole capacity through
an additive mask: up to 1.25x the filled positions read and multiplied, and at batch 1 a kernel with one program
a head, a few dozen programs on a GPU of a hundred-odd multiprocessors. ``filled_attention`` reads the filled
length from the device (``last``: the index this step wrote, the same for every row), so a captured launch stops
where the cache ends at replay, and splits each row's positions across programs whose partial softmaxes a second
kernel merges by their log-sum-exp. The additive mask is still applied (left padding, rows of other lengths).
Written here because SDPA takes no device-side length, FlexAttention's block mask is built on the host each step
(a sync a graph cannot capture), and transformers' attention functions take the cache's full tensors.

``reference_attention`` is the same attention in PyTorch (SDPA over the filled positions): what a CPU runs, and
what the Triton kernels are tested against in Triton's CPU interpreter (``tests/test_decode_attention.py``)."""
from __future__ import annotations

import importlib.util

import torch

from harness.ops.kernels import usable_on

BLOCK_N = 64  # positions a program reads at a time
CHUNK = 512  # positions a program of the first kernel covers (the split)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        last: torch.Tensor, scale: float) -> torch.Tensor:
    """q [b, h, 1, d], k and v [b, h_kv, capacity, d], an additive mask [b, 1, 1, capacity], ``last`` a one-element
    index tensor: SDPA over positions ``0..last`` (one host read of ``last``). Returns [b, h, 1, d]."""
    n = int(last.reshape(-1)[0]) + 1
    return torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :n], v[:, :, :n], attn_mask=mask[..., :n].to(q.dtype), scale=scale,
        enable_gqa=k.shape[1] != q.shape[1])


_TRITON = importlib.util.find_spec("triton") is not None  # an optional install


def triton_usable(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on this tensor: Triton installed, and a CUDA tensor or its CPU
    interpreter (``kernels.usable_on``)."""
    return _TRITON and usable_on(t)


def filled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, last: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``reference_attention``'s result through the Triton kernels, with no host read: shapes as there."""
    # lazy: triton is an optional install
    from harness.ops.decode_attention_triton import split_kv_attention  # noqa: PLC0415

    return split_kv_attention(q, k, v, mask, last, scale, BLOCK_N, CHUNK)


def _define_op():
    """``icr::filled_attention``: an operator compiled steps see whole (dynamo cannot trace a Triton launch whose
    bounds come from a tensor on every torch; inductor leaves a custom operator as one call)."""
    lib = torch.library.custom_op("icr::filled_attention", mutates_args=())

    @lib
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, last: torch.Tensor,
           scale: float) -> torch.Tensor:
        if triton_usable(q):
            return filled_attention(q, k, v, mask, last, scale)
        return reference_attention(q, k, v, mask, last, scale)

    @op.register_fake
    def _(q, k, v, mask, last, scale):
        return torch.empty_like(q)

    return op


attention_op = _define_op()
