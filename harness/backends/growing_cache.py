"""A key/value cache layer that grows in place: transformers' ``DynamicLayer`` with spare capacity.

``DynamicLayer.update`` concatenates, so every decode step copies the whole cache into a fresh tensor: on a CPU
at 2,500 tokens and batch 6 that copy was 70% of a decode step (``benchmarks/throughput.py``). ``GrowingLayer``
keeps keys and values in buffers with room to spare, writes each step's key and value in place, and grows by
half again when full (amortised O(1) copies a token). ``keys`` and ``values`` are views of the filled part, so
everything that reads a ``DynamicLayer`` reads this one the same way, and assigning them (select, repeat, merge
rows) replaces the buffers. Written here because transformers' growing cache is the concatenating one and its
static cache needs a fixed length up front.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

SPARE = 64  # positions allocated past a prefill: a short generation never copies its cache


class RowSlots:
    """A batch's keys and values, one buffer a layer, that each row's own prefill writes into (``place``): row r's
    positions [0, its length) in row r, each row's pads after them, so the rows need no join into a batch
    (``join_slots``): joined by copying, every row's keys and values were copied once more and held twice meanwhile
    (docs/throughput.md). ``width``: the longest row's length; ``SPARE`` positions to come after it."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}

    def buffer(self, layer: int, name: str, like: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s keys or values (``name``) for every row, made at its first request like ``like``."""
        if (layer, name) not in self.buffers:
            self.buffers[layer, name] = like.new_empty((self.rows, *like.shape[1:-2], self.width + SPARE,
                                                        like.shape[-1]))
        return self.buffers[layer, name]


class GrowingLayer(DynamicLayer):
    slot: tuple[RowSlots, int, int] | None = None  # (slots, layer index, row): where its next buffer lies (``place``)

    def __init__(self, *args, **kwargs):
        self._k = self._v = None
        self._n = self._nv = 0  # filled positions of the keys and of the values (assigned one at a time)
        super().__init__(*args, **kwargs)

    def __getstate__(self):
        """A copy (a snapshot's) writes a buffer of its own, never its original's slot."""
        return {**self.__dict__, "slot": None}

    def _get_keys(self):
        return None if self._k is None else self._k[..., :self._n, :]

    def _set_keys(self, value):
        self._k = value
        self._n = _length(value)

    def _get_values(self):
        return None if self._v is None else self._v[..., :self._nv, :]

    def _set_values(self, value):
        self._v = value
        self._nv = _length(value)

    keys = property(_get_keys, _set_keys)
    values = property(_get_values, _set_values)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = self._n, key_states.shape[-2]
        if self._k is None or self._k.dim() < 2:
            self._k, self._v = self._room(key_states, value_states, new + SPARE)
        elif n + new > self._k.shape[-2]:
            k, v = self._room(key_states, value_states, max(n + new, self._k.shape[-2] * 3 // 2), n + new)
            k[..., :n, :].copy_(self._k[..., :n, :])
            v[..., :n, :].copy_(self._v[..., :n, :])
            self._k, self._v = k, v
        self._k[..., n:n + new, :].copy_(key_states)
        self._v[..., n:n + new, :].copy_(value_states)
        self._n = self._nv = n + new
        return self.keys, self.values

    def nbytes(self) -> int:
        """The filled part's bytes (what ``state_nbytes`` counts): the spare room is not state."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def _room(self, keys: torch.Tensor, values: torch.Tensor, capacity: int, filled: int = 0):
        """New buffers for keys and values: the layer's row of its slot where it has one and the ``filled``
        positions fit the slot's width (taken once: a later growth gets buffers of its own), else ``capacity``."""
        if self.slot is not None and max(filled, keys.shape[-2]) <= self.slot[0].width:
            (slots, layer, row), self.slot = self.slot, None
            return (slots.buffer(layer, "keys", keys)[row:row + 1], slots.buffer(layer, "values", values)[row:row + 1])
        return self._buffer(keys, capacity), self._buffer(values, capacity)

    @staticmethod
    def _buffer(like: torch.Tensor, capacity: int) -> torch.Tensor:
        shape = (*like.shape[:-2], capacity, like.shape[-1])
        return torch.empty(shape, dtype=like.dtype, device=like.device)


def _length(t: torch.Tensor | None) -> int:
    return 0 if t is None or t.dim() < 2 else t.shape[-2]


def join_into(layer, name: str, parts: list[torch.Tensor], cuts: list[tuple[int, int, int]], at: int = 0) -> bool:
    """A growing layer's keys or values (``name``) joined from running batches' ``parts``, each cut and padded as
    ``families.join_rows`` says (width, cut, pad; the pads after the first ``at`` kept positions), written once
    into a buffer with ``SPARE`` positions to come:
    joined by concatenation the rows' cache filled its buffer, and the first decode step after a join copied all
    of it again into a larger one (24 rows of 2.5k tokens: 0.75 GB copied, 1.1 GB allocated). False for any other
    layer: the caller joins it."""
    if not isinstance(layer, GrowingLayer) or name not in ("keys", "values"):
        return False
    first, (_, cut, pad) = parts[0], cuts[0]
    width = first.shape[-2] - cut + pad
    buffer = first.new_empty((sum(t.shape[0] for t in parts), *first.shape[1:-2], width + SPARE, first.shape[-1]))
    row = 0
    for t, (_, cut, pad) in zip(parts, cuts):
        rows = buffer[row:row + t.shape[0]]
        rows[..., :at, :].copy_(t[..., cut:cut + at, :])
        rows[..., at:at + pad, :].zero_()  # masked, as a left-padded prefill's pads
        rows[..., at + pad:width, :].copy_(t[..., cut + at:, :])
        row += t.shape[0]
    if name == "keys":
        layer._k, layer._n = buffer, width
    else:
        layer._v, layer._nv = buffer, width
    return True


def place(cache, slots: RowSlots, row: int) -> None:
    """A one-row cache of growing layers writes its next buffers into row ``row`` of ``slots``."""
    for i, layer in enumerate(cache.layers):
        layer.slot = (slots, i, row)


def in_slots(cache) -> bool:
    """Whether ``place`` and ``join_slots`` take this cache: every layer a growing one."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is GrowingLayer for layer in layers)


def join_slots(caches: list, lengths: list[int], slots: RowSlots):
    """One cache of the one-row ``caches`` (``lengths`` tokens each) in ``slots``: row r's positions [0, its
    length) in row r of each layer's buffer (where its prefill wrote them, else copied now), zeros after them to
    the slots' width (masked, as a padded prefill's pads). The first cache takes the rows; the others are
    consumed."""
    out = caches[0]
    for i, layer in enumerate(out.layers):
        for name in ("keys", "values"):
            parts = [getattr(c.layers[i], name) for c in caches]
            buffer = slots.buffer(i, name, parts[0])
            for row, (part, n) in enumerate(zip(parts, lengths)):
                if part.shape[-2] != n:
                    raise ValueError("join_slots: a row's keys do not cover its prompt")
                if part.data_ptr() != buffer[row].data_ptr():  # a row that did not prefill into its slot
                    buffer[row, ..., :n, :].copy_(part[0])
                buffer[row, ..., n:slots.width, :].zero_()
        layer._k, layer._v, layer._n, layer._nv = (slots.buffers[i, "keys"], slots.buffers[i, "values"],
                                                   slots.width, slots.width)
        layer.slot = None
    for c in caches[1:]:
        for layer in c.layers:
            layer._k = layer._v = None
    return out


def install(cache) -> None:
    """Put growing layers in place of a fresh ``DynamicCache``'s plain ``DynamicLayer`` ones (sliding-window and
    recurrent layers are left as they are)."""
    layers = getattr(cache, "layers", None)
    if layers:
        for i, layer in enumerate(layers):
            if type(layer) is DynamicLayer and not layer.is_initialized:
                layers[i] = GrowingLayer()
    elif getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
