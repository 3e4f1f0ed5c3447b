"""What each transformers model family's cache can do: the one place model types are special-cased.

Greedy output must not depend on the batch a sample lands in. Attention layers keep padding out by the
attention mask, but recurrent layers (Mamba, RG-LRU, RWKV, short convolutions) fold every token they are fed
into their state, so each family declares how padding is kept out:

    masked   left pads and right-padded blocks are masked in every layer: batch freely (attention models)
    restore  a left-padded prefill is exact (pads are zeroed before the recurrent layers); a right-padded block
             is fed one token per call and the recurrent state of rows whose block has ended is put back
    alone    no padding is ever exact: each sample runs by itself, unpadded (exact, slower; logged)

Columns were measured on tiny random checkpoints of each family (transformers 5.23): single-token and
multi-token cached steps against a full forward, left-padded prefills against unpadded ones (pad counts that are
not multiples of a chunk, prompts several chunks long: ``tests/test_families.py`` measures it for every family
declared masked or restore, to float32 rounding);
``tests/test_families.py`` re-checks the whole table as greedy output at batch 1 = batch 4 = no prefix reuse =
an uncached per-sample reference, with and without tool calls. A model type that is not listed is inspected
once at load: a cache of key/value layers only is an attention model (``masked``); anything else runs
``alone`` with a warning that names this file.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.cache_utils import DynamicLayer

from harness.backends import growing_cache

log = logging.getLogger("harness")


@dataclass(frozen=True)
class Family:
    name: str
    padding: str = "masked"  # masked | restore | alone (see the module docstring)
    cache_arg: str = "past_key_values"  # the forward's keyword for the cache
    cache_out: str | None = "past_key_values"  # output attribute with the updated cache; None: ours, updated in place
    positions: bool = True  # the forward takes position_ids (positions stay right under left padding)
    step_mask: bool = True  # a cached step takes the attention mask of everything so far
    block_steps: bool = True  # a cached step may feed several tokens per row in one call
    module_state: bool = False  # the recurrent state lives in the model's modules: one sequence at a time
    max_context: bool = True  # config.max_position_embeddings limits the context
    own_cache: bool = False  # the model builds its own cache class at prefill (fla's), not a DynamicCache
    segments_exact: bool = True  # a prompt fed in cached segments (one-token ones included) equals it fed whole

    @property
    def copied_prefix_exact(self) -> bool:
        """Copying a prefilled prefix and feeding each row's suffix as a right-padded block is exact and pays."""
        return self.padding == "masked" and not self.module_state


_MAMBA = dict(padding="restore", cache_arg="cache_params", cache_out="cache_params", positions=False,
              step_mask=False, block_steps=False, max_context=False)

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("mamba", **_MAMBA),
    Family("falcon_mamba", **_MAMBA),
    Family("mamba2", padding="restore", cache_arg="cache_params", cache_out="cache_params", positions=False,
           max_context=False),
    Family("icr_hybrid", padding="restore", cache_arg="cache_params", cache_out="cache_params",
           block_steps=False),  # the trainer's Mamba + one attention layer (harness.models.istree)
    # transformers' Zamba2 is not consistent between a one-token cached step and a chunk (a real checkpoint's
    # last logit moved by up to 1.26 through the prefix tree), nor between a left-padded prefill and an unpadded
    # one (a real checkpoint's logits moved by 9.5e-3 at 1 pad on a 2,441-token prompt, and a greedy output
    # changed at batch 4; the tiny one's by 1e-4 to 3e-3 at 1, 6, 16 and 17 pads): each sample runs alone
    Family("zamba2", padding="alone", segments_exact=False),
    Family("jamba", padding="restore", block_steps=False),
    Family("bamba", padding="restore"),  # its cached steps need position_ids (the mask alone gives wrong logits)
    Family("falcon_h1", padding="restore"),
    Family("lfm2", padding="restore"),
    Family("recurrent_gemma", padding="alone", cache_out=None, module_state=True, block_steps=False),
    Family("rwkv", padding="alone", cache_arg="state", cache_out="state", positions=False, step_mask=False,
           max_context=False),
    # flash-linear-attention (harness.backends.fla_models): each layer unpads its rows by the attention mask
    *(Family(name, positions=False, max_context=False, own_cache=True) for name in ("gla", "delta_net")),
    Family("retnet", padding="restore", positions=False, max_context=False, own_cache=True),
]}

# Layer attributes of transformers' cache layers that hold per-row tensors (a tensor, or a dict/list of them).
_KV = ("keys", "values")
_RECURRENT = ("conv_states", "recurrent_states")


def family_of(model) -> Family:
    """The family of a loaded model: its table entry, or for an unlisted type what its cache shows."""
    mt = model.config.model_type
    if mt in FAMILIES:
        return FAMILIES[mt]
    fam = _inspect(model)
    if fam.padding == "alone":
        log.warning("model type %r is not in harness/backends/families.py and its cache holds more than keys and "
                    "values; each sample runs alone and unpadded (exact, slower). Add a row for it to batch it.", mt)
    return fam


def _inspect(model) -> Family:
    mt = model.config.model_type
    try:
        with torch.inference_mode():
            ids = torch.zeros((1, 2), dtype=torch.long, device=model.device)
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        cache = getattr(out, "past_key_values", None)
        layers = getattr(cache, "layers", None)
        if layers and all(isinstance(getattr(l, k, None), torch.Tensor) for l in layers for k in _KV) and \
                not any(_tensors(l, _RECURRENT) for l in layers):
            return Family(mt)
    except Exception as e:  # an unusual forward signature: the safe mode still runs it
        log.debug("cache inspection of %s failed: %s", mt, e)
    return Family(mt, padding="alone", block_steps=False)


# ------------------------------------------------------------------------------ per-row cache tensors
def _caches(cache) -> list:
    """The cache objects in a decoding state: one Cache, a tuple of them (icr_hybrid), or RWKV's tensor list."""
    return [c for c in (cache if isinstance(cache, tuple) else (cache,)) if c is not None]


def _tensors(layer, names) -> list[tuple[Any, Any]]:
    """(container, key) for each per-row tensor a cache layer holds under ``names``."""
    slots = []
    for name in names:
        val = getattr(layer, name, None)
        if isinstance(val, torch.Tensor):
            slots.append((layer, name))
        elif isinstance(val, dict):
            slots += [(val, k) for k, v in val.items() if isinstance(v, torch.Tensor)]
        elif isinstance(val, list):
            slots += [(val, i) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return slots


def _get(box, key):
    return box[key] if isinstance(box, (dict, list)) else getattr(box, key)


def _set(box, key, value) -> None:
    if isinstance(box, (dict, list)):
        box[key] = value
    else:
        setattr(box, key, value)


def _slots(cache, names=_KV + _RECURRENT) -> list[tuple[Any, Any]]:
    out = []
    for c in _caches(cache):
        if isinstance(c, list):  # RWKV: a list of [B, ...] state tensors
            out += [(c, i) for i, t in enumerate(c) if isinstance(t, torch.Tensor)]
        else:
            for layer in getattr(c, "layers", []):
                out += _tensors(layer, names)
    return out


# fla's cache layers keep one dict per layer: recurrent_state, attn_state (keys, values), conv_state, ffn_state,
# each a tensor or a tuple of them.
_FLA_RECURRENT = ("recurrent_state", "conv_state", "ffn_state")


def _fla_layers(cache) -> list:
    return [layer for c in _caches(cache) if not isinstance(c, list) for layer in getattr(c, "layers", [])
            if isinstance(getattr(layer, "state", None), dict)]


def _fla_map(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_fla_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _fla_map(v, fn) for k, v in value.items()}
    return value


def _fla_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _fla_tensors(v)]
    return []


def map_rows(cache, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply a batch-dimension op (keep rows, repeat rows) to every per-row tensor of a cache, in place.
    Written here because transformers' linear-attention cache layers have no batch_select_indices."""
    for box, key in _slots(cache):
        _set(box, key, fn(_get(box, key)))
    for layer in _fla_layers(cache):
        layer.state = _fla_map(layer.state, fn)


def repeat_rows(cache, n: int):
    """A fresh cache holding each of ``cache``'s rows ``n`` times (a prefix's state, copied into each row): every
    tensor copied, but the keys and values of a layer that only appends (``DynamicLayer`` concatenates,
    ``GrowingLayer`` writes past its filled part: neither writes where a tensor already holds) are shared as their
    filled part while ``n`` is 1, and the next update writes a buffer of its own. A prefix tree's snapshot had been
    copied three times a segment: deep-copied, repeated once, and grown by the segment's update."""
    memo = {}
    for c in _caches(cache):
        for layer in [] if isinstance(c, list) else getattr(c, "layers", []):
            if isinstance(layer, growing_cache.GrowingLayer):
                if layer._k is not None and layer._k.dim() >= 2:
                    memo.update({id(layer._k): layer.keys, id(layer._v): layer.values})
            elif type(layer) is DynamicLayer:
                memo.update({id(t): t for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)})
    fresh = copy.deepcopy(cache, memo)
    if n > 1:
        map_rows(fresh, lambda t: t.repeat_interleave(n, dim=0))
    return fresh


def recurrent_state(cache, clone: bool = False) -> list[torch.Tensor]:
    """The recurrent tensors of a cache (not keys/values: a padded position's KV entry is masked anyway)."""
    found = [_get(b, k) for b, k in _slots(cache, _RECURRENT)]
    found += [t for layer in _fla_layers(cache) for k in _FLA_RECURRENT for t in _fla_tensors(layer.state.get(k))]
    return [t.clone() for t in found] if clone else found


# Cache layers whose per-row tensors are all keys/values of the whole sequence or a fixed-size recurrent state:
# rows prefilled apart can be merged into one batch (sliding-window, static and quantized layers cannot).
MERGEABLE_LAYERS = ("DynamicLayer", "GrowingLayer", "LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer")


def mergeable(cache) -> bool:
    """Whether ``merge_rows`` can batch rows of this kind of cache."""
    caches = _caches(cache)
    return bool(caches) and all(not isinstance(c, list) and getattr(c, "layers", None) and
                                all(type(l).__name__ in MERGEABLE_LAYERS for l in c.layers) for c in caches)


def merge_rows(caches: list, lengths: list[int], shared: int = 0):
    """One cache holding the rows of ``caches`` (one row each, prefilled unpadded, ``lengths`` tokens): keys
    and values left-padded with zeros to the longest (the attention mask hides them, as it hides a left-padded
    prefill's pads), or padded after their first ``shared`` positions; recurrent state stacked; ``caches`` are
    consumed. A join of one-row batches (``join_rows``)."""
    width = max(lengths)
    return join_rows(caches, [(n, 0, width - n) for n in lengths], at=shared)


def key_share(cache) -> float:
    """The share of a cache's layers that keep keys and values (positions a mask must hide, which attention
    computes over), against those holding only recurrent state."""
    layers = [layer for c in _caches(cache) if not isinstance(c, list) for layer in getattr(c, "layers", [])]
    return sum(bool(_tensors(layer, _KV)) for layer in layers) / max(1, len(layers))


def join_rows(caches: list, cuts: list[tuple[int, int, int]], at: int = 0):
    """One cache holding the rows of running batches' ``caches``, in order; each batch's (width, cut, pad) from
    ``generation.join_masks``: its keys and values (``width`` positions, as its mask) lose their first ``cut``
    positions (masked in all its rows) and gain ``pad`` zeros (masked) in front, or after the first ``at`` kept
    positions; recurrent state stacked. The first cache takes the rows; the others are consumed. Written here
    because transformers' caches can only select or repeat rows, not join caches of different lengths."""
    out = caches[0]
    for names, kv in ((_KV, True), (_RECURRENT, False)):
        per_cache = [_slots(c, names) for c in caches]
        for k, (box, key) in enumerate(per_cache[0]):
            parts = [_get(*slots[k]) for slots in per_cache]
            if kv and any(t.shape[-2] != width for t, (width, _, _) in zip(parts, cuts)):
                raise ValueError("join_rows: a batch's keys do not cover its attention mask (or a row's, its "
                                 "whole prompt)")
            if not kv:
                _set(box, key, torch.cat(parts))
            elif not growing_cache.join_into(box, key, parts, cuts, at):  # a growing layer's rows: written once
                _set(box, key, torch.cat([torch.cat([t[..., cut:cut + at, :], t.new_zeros((*t.shape[:-2], pad,
                                                     t.shape[-1])), t[..., cut + at:, :]], dim=-2)
                                          for t, (_, cut, pad) in zip(parts, cuts)]))
            for slots in per_cache[1:]:
                _set(*slots[k], None)
    return out


def restore_rows(cache, saved: list[torch.Tensor], rows: torch.Tensor) -> None:
    """Put back the recurrent state of the rows where ``rows`` is True (their block had already ended)."""
    for cur, old in zip(recurrent_state(cache), saved):
        cur[rows] = old[rows]
