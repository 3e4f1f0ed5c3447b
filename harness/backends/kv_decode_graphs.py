"""A transformers attention model's single-token decode step replayed from CUDA graphs.

Eager decoding of a Phi-1.5-sized model at batch 1 is bound by Python and kernel launches, not by memory
bandwidth (7% of the bandwidth bound on an H100). A graph replays one step's kernels at fixed addresses and
shapes. This is ``harness.models.decode_graphs`` (Phi-Mamba's graphs) for transformers' own models, with the
same buckets and the same ownership rules:

- rows: buckets 1, 2, 4, ... 64; rows past the batch are padding whose logits are dropped. A larger batch, a
  block of several tokens (a tool result) or a cache the graphs do not cover runs the eager step.
- every layer's keys and values live in static buffers of a fixed capacity (``capacity_bucket``). A step writes
  its key and value at a device-side index (``_WriteAtLayer``) and attends over the bucket's capacity through
  an additive 4D mask copied from the step's attention mask: transformers returns a 4D mask as it is, so no
  step takes a data-dependent branch or a host sync a graph could not capture.
- the cache is *resident*: after a step, the caller's cache layers (``GrowingLayer``) hold views of the static
  buffers, so the next step copies only its token, position and mask. An eager step on that cache (a tool
  result) writes its keys and values into those views in place; a ``select`` of rows or a cache that outgrew
  the buffers leaves new tensors, copied in at the next graphed step. Before another cache takes the buffers
  over, the previous owner's views are replaced by copies, so no cache is overwritten behind its back.

Greedy output equals eager decoding: the extra capacity is masked with the dtype's minimum, so it adds exact
zeros to every softmax. ``capture=False`` runs the same static-buffer code eagerly (what the CPU tests compare
with the eager step, per family); capture and replay need CUDA (``harness.doctor`` compares them on a GPU).
A family whose step cannot be captured falls back to eager decoding with a warning, never to a wrong answer."""
from __future__ import annotations

import logging
import weakref

import torch
from transformers.cache_utils import Cache, DynamicLayer

from harness.backends.growing_cache import GrowingLayer
from harness.cuda_graphs import ReplayedStep, new_pool
from harness.models.decode_graphs import ROW_BUCKETS, capacity_bucket

log = logging.getLogger("harness")

ATTENTION = ("sdpa", "eager")  # implementations that take an additive 4D mask as it is


def unsupported(model, family) -> str | None:
    """Why this model's decode step cannot run from these graphs (None: it can)."""
    if family.padding != "masked" or family.own_cache or family.module_state or not family.positions \
            or not family.step_mask or family.cache_out != "past_key_values":
        return f"{family.name} keeps a cache other than keys and values"
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in ATTENTION:
        return f"its attention implementation {impl!r} takes no additive mask (graphs need {' or '.join(ATTENTION)})"
    if getattr(model.config, "sliding_window", None) or getattr(model.config, "layer_types", None) and any(
            t != "full_attention" for t in model.config.layer_types):
        return f"{family.name} has sliding-window layers"
    return None


class _WriteAtLayer(DynamicLayer):
    """One layer's keys and values over a static capacity: ``update`` writes the step's key and value at the
    device-side index ``write_at`` and returns the whole capacity (what the mask leaves out is never seen)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, write_at: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.write_at = keys, values, write_at
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.write_at, key_states)
        self.values.index_copy_(2, self.write_at, value_states)
        return self.keys, self.values


class _StaticBuffers:
    """Keys and values of every layer (``rows`` x ``capacity``), the step's token, position and mask."""

    def __init__(self, like: list[GrowingLayer], rows: int, capacity: int, dtype: torch.dtype, device):
        self.rows, self.capacity = rows, capacity

        def room(t):
            return torch.zeros((rows, t.shape[1], capacity, t.shape[3]), dtype=t.dtype, device=device)

        self.keys = [room(layer.keys) for layer in like]
        self.values = [room(layer.values) for layer in like]
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.mask = torch.zeros((rows, 1, 1, capacity), dtype=dtype, device=device)  # additive: 0 or min
        self.write_at = torch.zeros(1, dtype=torch.long, device=device)

    def fits(self, like: list[GrowingLayer]) -> bool:
        return len(like) == len(self.keys) and all(
            mine.shape[1] == t.keys.shape[1] and mine.shape[3] == t.keys.shape[3] and mine.dtype == t.keys.dtype
            and v.shape[3] == t.values.shape[3] for mine, v, t in zip(self.keys, self.values, like))


class _Graph(ReplayedStep):
    """One (rows, capacity) step over views of the static buffers, captured on CUDA or run eagerly."""

    def __init__(self, model, buf: _StaticBuffers, rows: int, capacity: int, capture: bool, pool):
        self.model = model
        self.ids, self.pos, self.mask = buf.ids[:rows], buf.pos[:rows], buf.mask[:rows, :, :, :capacity]
        self.cache = Cache(layers=[_WriteAtLayer(k[:rows, :, :capacity], v[:rows, :, :capacity], buf.write_at)
                                   for k, v in zip(buf.keys, buf.values)])
        # Warm-up runs (lazy initialisation, autotuning; on every device, so the CPU tests run this too) write
        # their keys and values at write_at, which this step writes anyway; nothing else of the state changes.
        self.run()
        if capture:
            self.record(self.ids.device, pool)

    def run(self):
        out = self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=self.pos,
                         past_key_values=self.cache, use_cache=True)
        self.output = out.logits[:, -1]


class GraphedKVDecode:
    """Callable as ``(state, ids [b, 1], attention_mask [b, past + 1]) -> logits [b, V] or None``, where
    ``state`` is ``TransformersBackend``'s (``{"cache": DynamicCache, "pos": [b]}``), updated in place. None:
    this step is not one the graphs cover (the caller runs its eager step)."""

    def __init__(self, model, capture: bool = True):
        self.model, self.capture = model, capture
        self.device = next(model.parameters()).device
        self.dtype = model.dtype
        self.buffers: _StaticBuffers | None = None
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.copies_in = 0  # caches copied into the buffers (a resident cache is not): the tests count them
        self.disabled: str | None = None  # why the graphs stopped (a capture that failed): eager from then on
        self.pool = new_pool(self.capture)
        self._owner = None  # weak reference to the cache whose layers are views of the static buffers

    def __call__(self, state: dict, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        b = ids.shape[0]
        rows = next((r for r in ROW_BUCKETS if r >= b), None)
        layers = _kv_layers(state["cache"])
        if self.disabled or rows is None or ids.shape[1] != 1 or layers is None:
            return None
        past = attention_mask.shape[1] - 1
        if any(layer.keys.shape[2] != past for layer in layers):
            raise ValueError(f"attention mask covers {past + 1} positions; the cache holds "
                             f"{layers[0].keys.shape[2]} and the step adds 1")
        capacity = capacity_bucket(past + 1)
        try:
            self._reserve(layers, rows, capacity)
            buf = self.buffers
            if not self._resident(state["cache"], layers, b):
                self._release_owner()
                self._copy_in(layers, b, past)
            step = attention_mask[:, -1:]
            pos = state["pos"] + step[:, 0]
            buf.ids[:b].copy_(ids)
            buf.pos[:b, 0].copy_(pos)
            mask = buf.mask[:rows, 0, 0, :capacity]
            mask.fill_(torch.finfo(self.dtype).min)
            mask[:b, : past + 1].masked_fill_(attention_mask.bool(), 0.0)
            mask[:, past] = 0.0  # a query sees itself (as Phi-Mamba's graphs): no padding row is all masked
            buf.write_at.fill_(past)
            key = (rows, capacity)
            if key not in self.graphs:
                self.graphs[key] = _Graph(self.model, buf, rows, capacity, self.capture, self.pool)
            # a copy: the next replay overwrites the graph's logits
            logits = self.graphs[key].replay()[:b].to(torch.float32, copy=True)
        except torch.cuda.OutOfMemoryError:
            self._give_up("the static cache does not fit in free GPU memory")
            return None
        except RuntimeError as e:  # a family whose step syncs with the host cannot be captured
            if not self.capture or "captur" not in str(e).lower():
                raise
            self._give_up(f"its step could not be captured ({str(e).splitlines()[0][:160]})")
            return None
        # the cache becomes (or stays) views of the static buffers: the next step copies none of it
        for layer, k, v in zip(layers, buf.keys, buf.values):
            layer._k, layer._v = k[:b], v[:b]
            layer._n = layer._nv = past + 1
        state["pos"] = pos
        self._owner = weakref.ref(state["cache"])
        return logits

    def describe(self) -> str:
        return f"eager ({self.disabled})" if self.disabled else "CUDA graphs" if self.capture else "static cache"

    def _give_up(self, why: str) -> None:
        log.warning("CUDA-graph decode is off for the rest of this run: %s; decoding eagerly", why)
        self._release_owner()
        self.disabled, self.buffers = why, None
        self.graphs.clear()

    def _reserve(self, layers, rows: int, capacity: int) -> None:
        """Static buffers at least ``rows`` x ``capacity``; growing them drops every graph (new addresses)."""
        buf = self.buffers
        if buf is not None and buf.rows >= rows and buf.capacity >= capacity and buf.fits(layers):
            return
        if buf is not None and buf.fits(layers):
            rows, capacity = max(rows, buf.rows), max(capacity, buf.capacity)
        self._release_owner()
        self.graphs.clear()
        self.pool = new_pool(self.capture)
        self.buffers = None  # freed before the larger set is allocated
        self.buffers = _StaticBuffers(layers, rows, capacity, self.dtype, self.device)

    def _copy_in(self, layers, b: int, past: int) -> None:
        self.copies_in += 1
        for layer, k, v in zip(layers, self.buffers.keys, self.buffers.values):
            k[:b, :, :past].copy_(layer.keys)
            v[:b, :, :past].copy_(layer.values)

    def _resident(self, cache, layers, b: int) -> bool:
        """Whether ``cache`` is already the static buffers' first ``b`` rows (left so by the previous step)."""
        if self._owner is None or self._owner() is not cache:
            return False
        return all(layer._k.data_ptr() == k.data_ptr() and layer._k.shape == k[:b].shape
                   and layer._v.data_ptr() == v.data_ptr() and layer._v.shape == v[:b].shape
                   for layer, k, v in zip(layers, self.buffers.keys, self.buffers.values))

    def _release_owner(self) -> None:
        """Give the cache that holds views of the static buffers its own copies before they are reused."""
        owner = self._owner() if self._owner is not None else None
        self._owner = None
        if owner is None or self.buffers is None:
            return
        for layer in _kv_layers(owner) or ():
            for name in ("_k", "_v"):
                t = getattr(layer, name)
                if any(t.untyped_storage().data_ptr() == mine.untyped_storage().data_ptr()
                       for mine in self.buffers.keys + self.buffers.values):
                    filled = layer._n if name == "_k" else layer._nv
                    setattr(layer, name, t[:, :, :filled].clone())



def _kv_layers(cache) -> list[GrowingLayer] | None:
    """The cache's layers as growing key/value layers (plain ones are converted in place: the same tensors), or
    None where a layer is of another kind (sliding window, recurrent)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            grown = GrowingLayer()
            grown.lazy_initialization(layer.keys, layer.values)
            grown.keys, grown.values = layer.keys, layer.values
            layers[i] = grown
        elif type(layers[i]) is not GrowingLayer or layers[i].keys is None or layers[i].keys.dim() != 4:
            return None
    return layers
