"""A transformers attention model's single-token decode step replayed from CUDA graphs.

Eager decoding of a Phi-1.5-sized model at batch 1 is bound by Python and kernel launches, not by memory
bandwidth (7% of the bandwidth bound on an H100). A graph replays one step's kernels at fixed addresses and
shapes. This is ``harness.models.decode_graphs`` (Phi-Mamba's graphs) for transformers' own models: the same
``harness.cuda_graphs.StaticDecode`` (buckets, graph cache, resident state, failure policy), its own buffers
and run:

- rows: buckets 1, 2, 4, ... 64; rows past the batch are padding whose logits are dropped. A larger batch, a
  block of several tokens (a tool result) or a cache the graphs do not cover runs the eager step.
- every layer's keys and values live in static buffers of a fixed capacity (``capacity_bucket``). A step writes
  its key and value at a device-side index (``_WriteAtLayer``) and attends over the graph's capacity
  (``attended_capacity``: the bucket, or tighter from 16 rows) through an additive 4D mask copied from the
  step's attention mask: transformers returns a 4D mask as it is, so no step takes a data-dependent branch or
  a host sync a graph could not capture.
- the cache is *resident*: after a step, the caller's cache layers (``GrowingLayer``) hold views of the static
  buffers, so the next step copies only its token, position and mask. An eager step on that cache (a tool
  result) writes its keys and values into those views in place; a ``select`` of rows or a cache that outgrew
  the buffers leaves new tensors, copied in at the next graphed step. Before another cache takes the buffers
  over, the previous owner's views are replaced by copies, so no cache is overwritten behind its back.

Greedy output equals eager decoding: the extra capacity is masked with the dtype's minimum, so it adds exact
zeros to every softmax. ``attention="filled"`` attends over the filled positions only (``FILLED_SDPA``: the Triton
split-KV kernel of ``harness.ops.decode_attention``, stopping at the device-side write index), checked against the
capacity's SDPA at each graph's first step and off for the run, with the reason, where they part. ``capture=False``
runs the same static-buffer code eagerly (what the CPU tests compare with the eager step, per family); capture and
replay need CUDA (``harness.doctor`` compares them on a GPU). A family whose step cannot be captured falls back to
eager decoding with a warning, never to a wrong answer."""
from __future__ import annotations

import functools
import logging

import torch
from transformers.cache_utils import Cache, DynamicLayer

from harness.backends.growing_cache import GrowingLayer
from harness.compiled_steps import CompiledStep, parted
from harness.cuda_graphs import ReplayedStep, StaticDecode
from harness.ops.decode_attention import attention_op

log = logging.getLogger("harness")

ATTENTION = ("sdpa", "eager")  # implementations that take an additive 4D mask as it is
FILLED_SDPA = "icr_filled_sdpa"
DECODE_ATTENTION = ("capacity", "filled")  # a graphed step's attention: SDPA over the capacity, or the filled part


def unsupported(model, family) -> str | None:
    """Why this model's decode step cannot run from these graphs (None: it can, and its attention is now one
    that takes an additive mask: ``masked_attention``)."""
    if family.padding != "masked" or family.own_cache or family.module_state or not family.positions \
            or not family.step_mask or family.cache_out != "past_key_values":
        return f"{family.name} keeps a cache other than keys and values"
    if getattr(model.config, "sliding_window", None) or getattr(model.config, "layer_types", None) and any(
            t != "full_attention" for t in model.config.layer_types):
        return f"{family.name} has sliding-window layers"
    if masked_attention(model) is None:
        return f"its attention cannot be set to one that takes an additive mask (graphs need {' or '.join(ATTENTION)})"
    return None


def masked_attention(model) -> str | None:
    """Set the model's attention to the first of ``ATTENTION`` it supports, through transformers' public
    ``set_attn_implementation`` (the configured one is a private attribute): the one set, or None where it takes
    neither. Both compute the same attention; the eager step, on the same model, then runs it too."""
    for impl in ATTENTION:
        try:
            model.set_attn_implementation(impl)
            return impl
        except (ValueError, ImportError, AttributeError):
            continue
    return None


def filled_sdpa(module, query, key, value, attention_mask, decode_last=None, **kwargs):
    """transformers' SDPA attention, except a graphed step's single query given ``decode_last`` (the write index,
    on the device): attention over positions ``0..decode_last`` of the static buffers, under the same additive
    mask (``harness.ops.decode_attention``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

    if (decode_last is None or query.shape[2] != 1 or attention_mask is None or attention_mask.dim() != 4
            or kwargs.get("dropout") or any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks"))):
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    scale = kwargs.get("scaling")
    out = attention_op(query, key, value, attention_mask, decode_last,
                       float(query.shape[-1] ** -0.5 if scale is None else scale))
    return out.transpose(1, 2), None


@functools.cache
def register_filled_sdpa() -> str:
    """``FILLED_SDPA`` in transformers' attention and mask interfaces (its masks are SDPA's)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(FILLED_SDPA, filled_sdpa)
    AttentionMaskInterface.register(FILLED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return FILLED_SDPA


class FilledRefused(RuntimeError):
    """The filled positions' attention parted from the capacity's at a graph's first step."""


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


def kv_step(model, ids, mask, pos, cache, last=None) -> torch.Tensor:
    """One decode step of a transformers model over a static cache: the last position's logits. ``last``: the
    write index, given to ``filled_sdpa`` (None: attention over the capacity)."""
    extra = {} if last is None else {"decode_last": last}
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                **extra)
    return out.logits[:, -1]


class _Graph(ReplayedStep):
    """One (rows, capacity) step over views of the static buffers, captured on CUDA or run eagerly; the step
    ``compiled`` where given."""

    def __init__(self, model, buf: _StaticBuffers, rows: int, capacity: int, capture: bool, pool,
                 compiled: CompiledStep | None = None, filled: bool = False):
        self.model, self.step = model, compiled or kv_step
        self.last = buf.write_at if filled else None
        self.ids, self.pos, self.mask = buf.ids[:rows], buf.pos[:rows], buf.mask[:rows, :, :, :capacity]
        self.cache = Cache(layers=[_WriteAtLayer(k[:rows, :, :capacity], v[:rows, :, :capacity], buf.write_at)
                                   for k, v in zip(buf.keys, buf.values)])
        # Warm-up runs (lazy initialisation, autotuning; on every device, so the CPU tests run this too) write
        # their keys and values at write_at, which this step writes anyway; nothing else of the state changes.
        if compiled is not None:
            compiled.first(self.replay, self.eager, f"{rows} rows x {capacity} positions")  # not captured yet: runs
        else:
            self.run()
        if filled:  # the filled positions' attention against the capacity's, on the same inputs
            why = parted(self.output, kv_step(self.model, self.ids, self.mask, self.pos, self.cache))
            if why:
                raise FilledRefused(f"it parted from SDPA over the capacity at {rows} rows x {capacity} "
                                    f"positions ({why})")
        if capture:
            self.record(self.ids.device, pool)

    def run(self):
        self.output = self.step(self.model, self.ids, self.mask, self.pos, self.cache, self.last)

    def eager(self) -> torch.Tensor:
        return kv_step(self.model, self.ids, self.mask, self.pos, self.cache, self.last)


class GraphedKVDecode(StaticDecode):
    """``StaticDecode`` over ``TransformersBackend``'s state (``{"cache": DynamicCache, "pos": [b]}``), updated in
    place; a cache whose layers are not plain keys and values is not covered (None: the eager step runs it)."""

    logits_dtype = torch.float32
    step_function = staticmethod(kv_step)

    def __init__(self, model, capture: bool = True, compile: bool = False, attention: str = "capacity"):
        if attention not in DECODE_ATTENTION:
            raise ValueError(f"attention={attention!r}: give one of {', '.join(DECODE_ATTENTION)}")
        super().__init__(model, capture, compile)
        self.dtype = model.dtype
        self._layers: list[GrowingLayer] | None = None  # this step's cache layers (``takes`` reads them)
        # the filled positions' attention replaces SDPA (every other call runs SDPA as before); filled_off: why not
        self.filled, self.filled_off = False, None
        if attention == "filled":
            if masked_attention(model) == "sdpa":
                model.set_attn_implementation(register_filled_sdpa())
                self.filled = True
            else:
                self.filled_off = "the model cannot take SDPA"

    def describe(self) -> str:
        what = super().describe()
        if self.filled:
            return f"{what}, attention over the filled positions (split-KV)"
        return f"{what}, attention over the capacity ({self.filled_off})" if self.filled_off else what

    def takes(self, state):
        # read once a step (every hook below uses them): the layer walk is Python on the decode's hot path
        self._layers = _kv_layers(state["cache"])
        return self._layers is not None

    def past(self, state, attention_mask):
        past = attention_mask.shape[1] - 1
        layers = self._layers
        if any(layer.keys.shape[2] != past for layer in layers):
            raise ValueError(f"attention mask covers {past + 1} positions; the cache holds "
                             f"{layers[0].keys.shape[2]} and the step adds 1")
        return past

    def fits(self, state):
        return self.buffers.fits(self._layers)

    def allocate(self, state, rows, capacity):
        return _StaticBuffers(self._layers, rows, capacity, self.dtype, self.device)

    def copy_in(self, state, b, past):
        for layer, k, v in zip(self._layers, self.buffers.keys, self.buffers.values):
            k[:b, :, :past].copy_(layer.keys)
            v[:b, :, :past].copy_(layer.values)

    def fill(self, state, ids, attention_mask, rows, capacity, past):
        buf, b = self.buffers, ids.shape[0]
        buf.ids[:b].copy_(ids)
        buf.pos[:b, 0].copy_(state["pos"] + attention_mask[:, -1])
        mask = buf.mask[:rows, 0, 0, :capacity]
        mask.fill_(torch.finfo(self.dtype).min)
        mask[:b, : past + 1].masked_fill_(attention_mask.bool(), 0.0)
        mask[:, past] = 0.0  # a query sees itself (as Phi-Mamba's graphs): no padding row is all masked
        buf.write_at.fill_(past)

    def new_graph(self, rows, capacity, pool, compiled):
        if self.filled:
            try:
                return _Graph(self.model, self.buffers, rows, capacity, self.capture, pool, compiled, filled=True)
            except FilledRefused as e:
                log.warning("decode steps: the filled positions' attention is off for the rest of this run: %s; "
                            "the graphs attend over their capacity", e)
                self.filled, self.filled_off = False, str(e)
        return _Graph(self.model, self.buffers, rows, capacity, self.capture, pool, compiled)

    def hold(self, state, b, past):
        for layer, k, v in zip(self._layers, self.buffers.keys, self.buffers.values):
            layer._k, layer._v = k[:b], v[:b]
            layer._n = layer._nv = past + 1
        state["pos"] = self.buffers.pos[:b, 0].clone()

    def owned(self, state):
        return state["cache"]

    def resident(self, state, b):
        """Whether the cache is already the static buffers' first ``b`` rows (left so by the previous step)."""
        cache = state["cache"]
        if self._owner is None or self._owner() is not cache:
            return False
        return all(layer._k.data_ptr() == k.data_ptr() and layer._k.shape == k[:b].shape
                   and layer._v.data_ptr() == v.data_ptr() and layer._v.shape == v[:b].shape
                   for layer, k, v in zip(self._layers, self.buffers.keys, self.buffers.values))

    def detach(self, owner):
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
