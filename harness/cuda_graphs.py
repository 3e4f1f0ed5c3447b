"""Capturing a CUDA graph the way PyTorch's documentation asks, for the three places that replay one (Phi-Mamba's
and transformers' decode steps, the trainer's optimizer step): work before a capture runs on a side stream
joined to the current one, so that lazy initialisation and autotuning are not recorded and the capture starts
from a settled stream."""
from __future__ import annotations

from typing import Any, Callable

import torch


def on_side_stream(fn: Callable[[], Any], device) -> Any:
    """``fn()`` on a fresh side stream that waits for the current one, which then waits for it."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        out = fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return out


def new_pool(capture: bool = True):
    """A fresh memory pool for the graphs over a new set of static buffers (None with capture off). Never a
    dropped set's pool: when the last graph using a pool is destroyed PyTorch releases it, and capturing into its
    handle again fails in the caching allocator (``INTERNAL ASSERT FAILED ... use_count > 0``: a graphed backend
    used at batch 1 and then at batch 64 in one process, on an H200)."""
    return torch.cuda.graph_pool_handle() if capture else None


def capture(fn: Callable[[], Any], device, pool=None, warm: bool = True) -> torch.cuda.CUDAGraph:
    """A graph that replays ``fn`` (recorded, not run), after one warm-up run of it on a side stream (``warm``)."""
    if warm:
        on_side_stream(fn, device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


class ReplayedStep:
    """A step over static buffers (``run``, which leaves its result in ``self.output``): recorded into a graph
    on CUDA, or run eagerly each time with capture off (what the CPU tests exercise)."""

    graph: torch.cuda.CUDAGraph | None = None
    output: Any = None

    def run(self) -> None:
        raise NotImplementedError

    def record(self, device, pool=None, warm: bool = True) -> None:
        self.graph = capture(self.run, device, pool, warm)

    def replay(self) -> Any:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()
        return self.output
