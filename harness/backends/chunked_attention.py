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

Where this machine runs oneDNN's matrix products faster than PyTorch's BLAS (``onednn_linear.choice``: MKL's
AVX2 code on an AMD CPU with AVX-512), a float32 block of ``ONEDNN_MIN_QUERIES`` or more queries attends through
them instead: per head and chunk of queries, the scores as one product, the mask added, a softmax, the values as
another product (SDPA's CPU kernel makes its products through the BLAS). Measured on one layer's segment (4 heads
of 64, 2 threads, AMD EPYC, medians of 25 alternating calls against the chunked SDPA): p = 1,500, s = 1,000 11.8
ms against 15.6; p = 1,000, s = 500 3.7 against 5.3; p = 2,000, s = 100 1.5 against 1.6; below about 100 queries
slower (s = 30: 1.1 against 0.6). They round apart from SDPA by ~1e-7, like the chunks.

Where the project's CPU flash kernel is built (``harness/ops/cpu_flash.py``), it takes a causal float32 block of
``FLASH_MIN_QUERIES`` or more queries (one pass over the scores, the block's unseen keys never computed) and a
step of up to ``DECODE_MAX_QUERIES`` queries a key head and row (its decoding pass, the merged rows' front read
from the first row); the paths below are every other case's.

Decoding steps of rows merged by the prefix tree read their common front once (``front_once_attention``): the
merge keeps the positions every row shares in front and the pads after them (``StepModel.merge`` with
``shared``), and within ``known(shared)`` a step's queries of all rows attend over the first row's copy of the
front in one call, each row over its own rest, the two merged by their log-sum-exp (cascade attention, as in
FlashInfer). Each SDPA call otherwise reads every row's copy of the front: 24 HotpotQA rows of ~2,400 positions
sharing 774 read ~40k positions a layer and step instead of ~58k, and the 31 decoding steps ran ~0.17 s faster.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from harness.backends import onednn_linear
from harness.backends.additive_mask import BuiltMask
from harness.ops import cpu_flash

CHUNKED_SDPA = "icr_chunked_sdpa"
SHARED_MIN = 128  # a shared front this long or longer is read once for all rows (``known``)
SHARED_MAX_QUERIES = 16  # ... by blocks of up to this many queries (decoding steps)
# (shared front, BuiltMask, kept, middles: cpu_flash.Middles or None)
_KNOWN = contextvars.ContextVar("icr_attention_known", default=(0, None, 0, None))
KEPT_LAST = "_icr_last_attention"  # set on the last layer's attention where it may compute the kept queries alone
CHUNK = 256  # queries a call
MIN_QUERIES = 768  # blocks shorter than this attend in one call
# queries a key head and row (grouped heads x queries) the decoding pass takes: it computes each query's scores on
# its own, which beat PyTorch's kernels up to 4 (1.1-1.5x on merged rows' steps) and lost from 8 (0.9x)
DECODE_MAX_QUERIES = 4
FLASH_MIN_QUERIES = 16  # blocks this long or longer attend through the CPU flash kernel where it is built
ONEDNN_MIN_QUERIES = 128  # blocks this long or longer make their products through oneDNN where it is faster
ONEDNN_CHUNK = 512  # queries a product: fewer calls read the keys fewer times (prefill 3.40 s against 3.55 at 256)
# what transformers may pass an attention function that the products can ignore (anything else: SDPA)
HARMLESS = {"scaling", "dropout", "is_causal", "sliding_window", "position_ids", "use_cache", "cache_position"}


def chunked_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, called once a chunk of queries where that pays (a CPU, a long block, a 4D
    mask of the block's queries, nothing else that spans the keys); else called as it is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

    q, kv = query.shape[2], key.shape[2]
    # a compiled step traces no context variable
    shared, built, _, middles = (0, None, 0, None) if torch.compiler.is_compiling() else _KNOWN.get()
    scale = kwargs.get("scaling") if kwargs.get("scaling") is not None else query.shape[-1] ** -0.5
    kept = kept_queries(module, q)
    if kept and (attention_mask.dim() == 4 if attention_mask is not None else kept == 1):
        return _last_queries(module, query, key, value, attention_mask, kept, kwargs), None
    if _by_decode_kernel(module, query, key, value, attention_mask, kwargs):
        mask = None if attention_mask is None else attention_mask[..., :kv]
        front = shared if 0 < shared < kv and query.shape[0] > 1 else 0  # read from the first row, once
        middles = middles if front and middles is not None and middles.owner.shape[0] == query.shape[0] else None
        return cpu_flash.decode(query, key, value, mask, front, scale, middles), None
    if shared and _reads_front_once(module, query, key, attention_mask, kwargs, shared):
        return front_once_attention(query, key, value, attention_mask[..., :kv], shared, kwargs.get("scaling")), None
    if _by_flash(module, query, key, value, kwargs):
        if attention_mask is None and q == kv and kwargs.get("is_causal", getattr(module, "is_causal", True)):
            return cpu_flash.attention(query, key, value, None, [[]] * query.shape[0], scale), None  # SDPA's causal
        mask = None if attention_mask is None else attention_mask[..., :kv]
        if built is not None and mask is not None and built.describes(mask) and built.mask.shape[3] == kv:
            pads = [built.pad_runs(row) for row in range(query.shape[0])]
            return cpu_flash.attention(query, key, value, built.mask, pads, scale), None
    if _by_products(module, query, attention_mask, kwargs):
        mask = attention_mask[..., :kv]
        built = built if built is not None and built.describes(mask) else None
        return onednn_attention(query, key, value, mask, kwargs.get("scaling"), built), None
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


def _last_queries(module, query, key, value, attention_mask, n: int, kwargs) -> torch.Tensor:
    """[b, q, heads, d]: the block's last ``n`` queries attend (the positions a forward keeps, ``kept_queries``),
    each over the keys it sees (its rows of the mask, or every key for the last query alone); the other rows of
    the output are zero."""
    mask = None if attention_mask is None else attention_mask[:, :, -n:]
    out, _ = chunked_sdpa(module, query[:, :, -n:], key, value, mask, **{**kwargs, "is_causal": False})
    full = out.new_zeros(out.shape[0], query.shape[2], *out.shape[2:])
    full[:, -n:] = out
    return full


def _by_flash(module, query, key, value, kwargs) -> bool:
    """Whether a block may attend through the CPU flash kernel (``harness/ops/cpu_flash.py``): ``FLASH_MIN_QUERIES``
    or more queries whose scores the kernel computes as SDPA would (``_kernel_scores``); its mask is then either
    none where SDPA would take its causal flag over as many queries as keys, or the one the backend built over
    exactly these keys (causal, and elsewhere nonzero only at the rows' pads: ``BuiltMask``)."""
    return query.shape[2] >= FLASH_MIN_QUERIES and _kernel_scores(module, query, key, value, kwargs)


def _by_decode_kernel(module, query, key, value, attention_mask, kwargs) -> bool:
    """Whether a step attends through the CPU flash kernel's decoding pass (``cpu_flash.decode``): up to
    ``DECODE_MAX_QUERIES`` queries a key head and row, under an additive [rows, 1, queries, keys] mask (or none,
    for one query a row), scores as SDPA would compute them (``_kernel_scores``)."""
    if query.shape[2] * (query.shape[1] // key.shape[1]) > DECODE_MAX_QUERIES:
        return False
    if attention_mask is None:
        fits = query.shape[2] == 1
    else:
        fits = (attention_mask.dim() == 4 and attention_mask.dtype == query.dtype and attention_mask.shape[1] == 1
                and attention_mask.shape[0] == query.shape[0] and attention_mask.shape[2] == query.shape[2]
                and attention_mask.shape[3] >= key.shape[2])
    return fits and _kernel_scores(module, query, key, value, kwargs)


def _kernel_scores(module, query, key, value, kwargs) -> bool:
    """float32 on a CPU, as many key heads as divide the query heads, values of the queries' size, no dropout,
    nothing else that changes the scores, and the kernel built for this head size."""
    return (query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32
            and not torch.compiler.is_compiling()  # a compiled step traces no C call: it keeps SDPA
            and query.shape[-1] == value.shape[-1] and query.shape[1] % key.shape[1] == 0
            and not (module.training and kwargs.get("dropout")) and set(kwargs) <= HARMLESS
            and kwargs.get("sliding_window") is None and cpu_flash.available(query.shape[-1]))


def _by_products(module, query, attention_mask, kwargs) -> bool:
    """Whether a block attends through ``onednn_attention``: a float32 CPU block of ``ONEDNN_MIN_QUERIES`` or
    more queries, an additive 4D mask of its queries, no dropout, nothing else that changes the scores, on a
    machine whose linear layers take oneDNN."""
    return (query.device.type == "cpu" and query.dtype == torch.float32 and query.shape[2] >= ONEDNN_MIN_QUERIES
            and attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype == query.dtype
            and attention_mask.shape[2] == query.shape[2] and not (module.training and kwargs.get("dropout"))
            and set(kwargs) <= HARMLESS and kwargs.get("sliding_window") is None
            and onednn_linear.choice().onednn)


def onednn_attention(query, key, value, mask, scaling: float | None, known: BuiltMask | None = None) -> torch.Tensor:
    """[b, q, heads, d] attention of [b, heads, q, d] queries to [b, kv heads, kv, d] keys and values under an
    additive [b, 1 or heads, q, kv] mask, the block's queries being the last q positions: per row, head and chunk
    of ``ONEDNN_CHUNK`` queries, over the keys the chunk can see, the products by oneDNN (written by hand: PyTorch's
    batched products and SDPA's CPU kernel go through the BLAS). ``known``: ``mask`` as the backend built it
    (``additive_mask.BuiltMask``): it is added only where it is not zero (the same sums: adding 0 changes no
    score)."""
    b, heads, q, d = query.shape
    group, past = heads // key.shape[1], key.shape[2] - q
    scaled = query * (scaling if scaling is not None else d ** -0.5)
    out = query.new_empty(b, q, heads, value.shape[-1])
    for row in range(b):
        spans = {}  # each chunk's columns where the mask is not zero, for every head
        for h in range(heads):
            keys, vals = key[row, h // group].contiguous(), value[row, h // group].contiguous()
            seen = mask[row, h if mask.shape[1] > 1 else 0]
            for a in range(0, q, ONEDNN_CHUNK):
                e = min(a + ONEDNN_CHUNK, q)
                n = past + e
                if a not in spans:
                    spans[a] = known.masked_spans(row, a, e, n) if known is not None else [(0, n)]
                scores = onednn_linear.product(scaled[row, h, a:e], keys[:n])
                for lo, hi in spans[a]:
                    scores[:, lo:hi].add_(seen[a:e, lo:hi])
                probs = torch.softmax(scores, dim=-1)
                # the values the chunk sees as the product's [d, n] second operand: their transpose, not a copy
                out[row, a:e, h] = onednn_linear.product(probs, vals[:n].t())
    return out


@contextlib.contextmanager
def known(shared: int = 0, mask: BuiltMask | None = None, kept: int = 0, middles: cpu_flash.Middles | None = None):
    """Within it, what attention may know of a forward: every key row's first ``shared`` positions are the same in
    every row of the batch and seen by every query (a merge with ``shared``: ``StepModel.merge``; 0: nothing is
    known), and groups of rows share more (``middles``: ``MergesRows.merge_slots``), ``mask`` is the mask the
    backend built (read where it ``describes`` the mask attention gets), and the forward's caller reads only its
    last ``kept`` positions' logits (0: every position; the last layer then computes those alone where
    ``kept_positions`` marked it)."""
    token = _KNOWN.set((shared, mask, kept, middles))
    try:
        yield
    finally:
        _KNOWN.reset(token)


def kept() -> int:
    """The positions a forward keeps (``known``); 0 while dynamo traces (a compiled step traces no context
    variable, and keeps every position)."""
    return 0 if torch.compiler.is_compiling() else _KNOWN.get()[2]


def kept_queries(module, queries: int) -> int:
    """How many last queries of ``module``'s block are needed: the kept positions in the marked last layer's
    attention (``KEPT_LAST``), else 0 (all of them)."""
    n = kept()
    return n if n and n < queries and getattr(module, KEPT_LAST, False) else 0


def _reads_front_once(module, query, key, attention_mask, kwargs, shared: int) -> bool:
    """Whether a step attends through ``front_once_attention``: a CPU block of a few queries in two or more rows,
    a front of ``SHARED_MIN`` or more positions with keys after it, an additive [rows, 1, queries, keys] mask,
    nothing else that changes the scores."""
    return (query.device.type == "cpu" and query.shape[0] > 1 and query.shape[2] <= SHARED_MAX_QUERIES
            and SHARED_MIN <= shared < key.shape[2] and query.shape[1] % key.shape[1] == 0
            and attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
            and attention_mask.shape[2] == query.shape[2] and attention_mask.dtype == query.dtype
            and not (module.training and kwargs.get("dropout")) and set(kwargs) <= HARMLESS
            and kwargs.get("sliding_window") is None)


def front_once_attention(query, key, value, mask, shared: int, scaling: float | None) -> torch.Tensor:
    """[b, q, heads, d] attention of [b, heads, q, d] queries where the first ``shared`` of the keys and values
    are the same in every row and seen by every query: every row's queries (of every head a key head serves)
    attend over the first row's front in one call, its keys and values read once, not once a row; each row's over
    the rest of its own under its [b, 1, q, kv] mask; the two parts merged by their log-sum-exp (cascade
    attention). Written by hand: PyTorch's SDPA reads each row's keys whole, and only its private CPU flash
    kernel returns the log-sum-exp."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    b, heads, q, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = scaling if scaling is not None else d ** -0.5
    # every row's queries of a key head's group as one row's: [1, kv heads, group * b * q, d]
    folded = query.reshape(b, kv_heads, group * q, d)
    front_q = folded.permute(1, 0, 2, 3).reshape(1, kv_heads, b * group * q, d)
    front, front_lse = flash(front_q, key[:1, :, :shared], value[:1, :, :shared], scale=scale)
    front, front_lse = front.reshape(kv_heads, b, group * q, -1).transpose(0, 1), \
        front_lse.reshape(kv_heads, b, group * q).transpose(0, 1)
    rest_mask = mask[..., shared:]
    if group > 1:  # each query's mask row for each head of its group
        rest_mask = rest_mask.expand(b, group, q, rest_mask.shape[-1]).reshape(b, 1, group * q, -1)
    rest, rest_lse = flash(folded, key[:, :, shared:], value[:, :, shared:], attn_mask=rest_mask, scale=scale)
    top = torch.maximum(front_lse, rest_lse)
    w_front, w_rest = (front_lse - top).exp_().unsqueeze(-1), (rest_lse - top).exp_().unsqueeze(-1)
    out = (front * w_front + rest * w_rest) / (w_front + w_rest)  # [b, kv heads, group * q, d]
    return out.reshape(b, heads, q, -1).transpose(1, 2).contiguous()


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
    products = (f"; float32 blocks of >= {ONEDNN_MIN_QUERIES} queries by oneDNN's products"
                if onednn_linear.choice().onednn else "")
    config = model.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    flash = (f"; causal float32 blocks of >= {FLASH_MIN_QUERIES} queries by the CPU flash attention kernel"
             if model.dtype == torch.float32 and cpu_flash.available(dim) else "")
    return (f"SDPA over blocks of >= {MIN_QUERIES} queries in chunks of {CHUNK}, each over the keys it can see"
            f"{products}{flash}")

