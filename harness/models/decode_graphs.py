"""Phi-Mamba's single-token decode step replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a pure Phi-Mamba stack is a fixed-shape function of (token, mask, conv and SSM state,
position): dozens of small kernels per layer whose launch overhead, not memory bandwidth, bounds batch-1
decoding on a GPU. ``GraphedDecode`` keeps static buffers per bucket (1, 2, 4, ... rows), copies the live
rows' inputs and state in, replays the captured step and copies the new state out; rows past the batch are
padding (mask 0), which leaves their state untouched and their logits unused. A batch larger than the largest
bucket, and any model with attention layers (its KV cache grows), runs the eager step.

``capture=False`` runs the same static-buffer code eagerly: that is what the CPU tests check against the plain
step; graph capture and replay themselves need CUDA (``harness.doctor`` compares them with the eager step).
"""
from __future__ import annotations

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _Bucket:
    """Static inputs, state and outputs of one batch size, and its captured graph."""

    def __init__(self, model, rows: int, device, capture: bool):
        self.model = model
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.state = model.init_state(rows, device=device)
        self.graph = None
        if capture:
            self._run()  # warm-up outside the graph (lazy initialisation, autotuning) on a side stream
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._run()
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._run()

    def _run(self):
        """The model's own step on the static buffers; the new state is written back into them, so the graph
        reads and writes fixed addresses."""
        logits, new = self.model(self.ids, self.mask, _shallow_copy(self.state))
        for old_layer, new_layer in zip(self.state.layers, new.layers):
            for k, v in old_layer.items():
                v.copy_(new_layer[k])
        self.state.pos.copy_(new.pos)
        self.logits = logits[:, -1]

    def step(self, state, ids, mask) -> torch.Tensor:
        b = ids.shape[0]
        self.ids[:b].copy_(ids)
        self.mask.zero_()
        self.mask[:b].copy_(mask)
        for mine, theirs in zip(self.state.layers, state.layers):
            for k, v in mine.items():
                v[:b].copy_(theirs[k])
        self.state.pos[:b].copy_(state.pos)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()
        for mine, theirs in zip(self.state.layers, state.layers):
            for k, v in theirs.items():
                v.copy_(mine[k][:b])
        state.pos.copy_(self.state.pos[:b])
        return self.logits[:b].clone()


def _shallow_copy(state):
    from harness.models.phi_mamba import PhiMambaState

    return PhiMambaState([dict(layer) for layer in state.layers], state.pos)


class GraphedDecode:
    """Callable as ``(state, ids [b, 1], block_mask [b, 1]) -> logits [b, V]``, updating ``state`` in place."""

    def __init__(self, model, capture: bool = True):
        if model.config.attn_layers:
            raise ValueError("CUDA graphs cover Phi-Mamba stacks without attention layers (a KV cache grows)")
        self.model, self.capture = model, capture
        self.device = model.lm_head.weight.device
        self.buckets: dict[int, _Bucket] = {}

    def __call__(self, state, ids, mask) -> torch.Tensor:
        b = ids.shape[0]
        rows = next((r for r in BUCKETS if r >= b), None)
        if rows is None:
            logits, _ = self.model(ids, mask, state)
            return logits[:, -1]
        if rows not in self.buckets:
            self.buckets[rows] = _Bucket(self.model, rows, self.device, self.capture)
        return self.buckets[rows].step(state, ids, mask)
