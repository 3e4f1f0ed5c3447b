"""Phi-Mamba's and the hybrid's single-token decode step replayed from CUDA graphs.

A decode step is dozens of small kernels per layer whose launch overhead, not memory bandwidth, bounds
batch-1 decoding on a GPU. A graph replays them at fixed addresses and shapes, so ``GraphedDecode`` keeps one
set of static buffers (the largest batch and context seen so far) and captures one graph per (batch bucket,
context bucket) over views of them; the cache of graphs, the buckets, the resident state and the failure policy
are ``harness.cuda_graphs``'s (``StaticDecode``), shared with transformers' graphs:

- rows: buckets 1, 2, 4, ... 64. Rows past the batch are padding (mask 0), which leaves their state untouched
  and their logits unused. A larger batch runs the eager step (the backend's).
- attention layers (the hybrid): a fixed-capacity KV cache with a device-side write index. Each step writes
  the new key and value at that index and attends over the graph's capacity (``attended_capacity``) through a
  visibility mask copied from the step's attention mask, so a graph never sees a shape change; past 256
  positions the capacity is at most 1.25x the filled positions (1.0625x past 1,024 from 16 rows).
- the state is *resident*: it is copied in once, and after each step the caller's state holds views of the
  static buffers, so a step copies only its token and masks (a copy per layer and step would cost the kernel
  launches the graph saves, and copying a KV cache O(context)). An eager step on it (a multi-token tool result)
  writes its keys and values into those views in place; its new recurrent state and a select() of rows are new
  tensors, copied in at the next graphed step. Before another state takes the buffers over, the previous
  owner's views are replaced by copies, so no state is ever overwritten behind its back.

``capture=False`` runs the same static-buffer code eagerly: that is what the CPU tests check against the plain
step; graph capture and replay need CUDA (``harness.doctor`` compares them with the eager step on a GPU).
"""
from __future__ import annotations

import torch

from harness.compiled_steps import CompiledStep
from harness.cuda_graphs import ReplayedStep, StaticDecode
from harness.models.phi_mamba import PhiMambaState


class _StaticBuffers:
    """The static inputs and state every graph reads and writes: ``rows`` x ``capacity`` at most."""

    def __init__(self, model, rows: int, capacity: int, device):
        self.rows, self.capacity = rows, capacity
        self.attn = list(model.config.attn_layers)
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.state = model.init_state(rows, device=device)
        self.visible = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self.write_at = torch.zeros(1, dtype=torch.long, device=device)
        for i in self.attn:
            mixer = model.backbone.layers[i].mixer
            self.state.layers[i] = mixer.init_state(rows, device, model.lm_head.weight.dtype, capacity=capacity)

    def kv(self, i: int, name: str) -> torch.Tensor:
        return self.state.layers[i][name]

    def view(self, rows: int, capacity: int):
        """The model state over the first ``rows`` rows and ``capacity`` positions, in the static form the
        attention mixer recognises by its ``write_at`` key."""
        layers = []
        for i, layer in enumerate(self.state.layers):
            if i in self.attn:
                layers.append({"k": layer["k"][:rows, :, :capacity], "v": layer["v"][:rows, :, :capacity],
                               "write_at": self.write_at, "visible": self.visible[:rows, :capacity]})
            else:
                layers.append({k: v[:rows] for k, v in layer.items()})
        return PhiMambaState(layers, self.state.pos[:rows])


def _replaced_by_a_step(state: PhiMambaState) -> list[torch.Tensor]:
    """The tensors a step replaces: recurrent state and position (keys and values are written in place)."""
    return [v for layer in state.layers if "write_at" not in layer for v in layer.values()] + [state.pos]


def mamba_step(model, ids, mask, state: PhiMambaState) -> torch.Tensor:
    """The model's own step on the static views; the new recurrent state is written back into them (the
    attention mixer writes its key and value in place), so a graph reads and writes fixed addresses. Returns the
    last position's logits."""
    logits, new = model(ids, mask, PhiMambaState([dict(x) for x in state.layers], state.pos))
    for static, fresh in zip(_replaced_by_a_step(state), _replaced_by_a_step(new)):
        static.copy_(fresh)
    return logits[:, -1]


class _Graph(ReplayedStep):
    """One (rows, capacity) step over views of the static buffers, captured on CUDA or run eagerly; the step
    ``compiled`` where given."""

    def __init__(self, model, buffers: _StaticBuffers, rows: int, capacity: int, capture: bool, pool,
                 compiled: CompiledStep | None = None):
        self.model, self.step = model, compiled or mamba_step
        self.ids, self.mask = buffers.ids[:rows], buffers.mask[:rows]
        self.state = buffers.view(rows, capacity)
        # The graph is built after this step's inputs were copied in. Warm-up runs (lazy initialisation,
        # autotuning; on every device, so the CPU tests run this too) advance the recurrent state and position:
        # they are put back, also when the capture fails (the state may be resident in these buffers, and the run
        # goes on eagerly from it). Their keys and values go to position write_at, which this step writes anyway.
        self._kept = [t.clone() for t in _replaced_by_a_step(self.state)]
        try:
            if compiled is not None:
                compiled.first(self._warm, self._eager, f"{rows} rows x {capacity} positions")
            else:
                self._warm()
            if capture:
                self.record(self.ids.device, pool)
        finally:
            self._put_back()

    def run(self):
        self.output = self.step(self.model, self.ids, self.mask, self.state)

    def _put_back(self):
        for t, saved in zip(_replaced_by_a_step(self.state), self._kept):
            t.copy_(saved)

    def _warm(self) -> torch.Tensor:
        self.run()
        self._put_back()
        return self.output

    def _eager(self) -> torch.Tensor:
        out = mamba_step(self.model, self.ids, self.mask, self.state)
        self._put_back()
        return out


class GraphedDecode(StaticDecode):
    """``StaticDecode`` over a ``PhiMambaState``, updated in place (for the hybrid, its KV cache becomes views of
    the static cache)."""

    step_function = staticmethod(mamba_step)

    def __init__(self, model, capture: bool = True, compile: bool = False):
        super().__init__(model, capture, compile)
        self.attn = list(model.config.attn_layers)
        self.has_capacity = bool(self.attn)

    def past(self, state, attention_mask):
        past = state.layers[self.attn[0]]["len"] if self.attn else 0
        if self.attn and attention_mask.shape[1] != past + 1:
            raise ValueError(f"attention mask covers {attention_mask.shape[1]} positions; the state holds {past} "
                             "and the step adds 1")
        return past

    def allocate(self, state, rows, capacity):
        return _StaticBuffers(self.model, rows, capacity, self.device)

    def fill(self, state, ids, attention_mask, rows, capacity, past):
        buf, b = self.buffers, ids.shape[0]
        buf.ids[:b].copy_(ids)
        buf.mask.zero_()
        buf.mask[:b].copy_(attention_mask[:, -1:])
        if self.attn:
            buf.visible[:rows, :capacity].zero_()
            buf.visible[:b, : past + 1].copy_(attention_mask.bool())
            buf.visible[:rows, past] = True  # a query sees itself (as in block_attention_mask): no empty row
            buf.write_at.fill_(past)

    def new_graph(self, rows, capacity, pool, compiled):
        return _Graph(self.model, self.buffers, rows, capacity, self.capture, pool, compiled)

    def hold(self, state, b, past):
        buf = self.buffers
        for i, (mine, theirs) in enumerate(zip(buf.state.layers, state.layers)):
            theirs.update({k: mine[k][:b] for k in self._held(i, mine)})
            if i in self.attn:
                theirs["len"] = past + 1
        state.pos = buf.state.pos[:b]

    def _held(self, i: int, layer: dict) -> tuple[str, ...]:
        """The names of layer ``i``'s tensors the static buffers hold."""
        return ("k", "v") if i in self.attn else tuple(layer)

    def copy_in(self, state, b, past):
        for i, (mine, theirs) in enumerate(zip(self.buffers.state.layers, state.layers)):
            for k in self._held(i, mine):
                if i in self.attn:
                    mine[k][:b, :, :past].copy_(theirs[k][:, :, :past])
                else:
                    mine[k][:b].copy_(theirs[k])
        self.buffers.state.pos[:b].copy_(state.pos)

    def resident(self, state, b):
        """Whether ``state`` is already the static buffers' first ``b`` rows (left so by the previous step)."""
        buf = self.buffers
        pairs = [(theirs[k], mine[k]) for i, (mine, theirs) in enumerate(zip(buf.state.layers, state.layers))
                 for k in self._held(i, mine)] + [(state.pos, buf.state.pos)]
        return all(t.data_ptr() == m.data_ptr() and t.shape[0] == b for t, m in pairs)

    def detach(self, owner):
        for i, (mine, theirs) in enumerate(zip(self.buffers.state.layers, owner.layers)):
            for k in self._held(i, mine):
                if theirs[k].data_ptr() == mine[k].data_ptr():
                    theirs[k] = (theirs[k][:, :, : max(theirs["len"], 1)] if i in self.attn else theirs[k]).clone()
        if owner.pos.data_ptr() == self.buffers.state.pos.data_ptr():
            owner.pos = owner.pos.clone()
