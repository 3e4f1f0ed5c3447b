"""A decode step compiled by TorchInductor, for replay inside the harness's own CUDA graphs.

Why: a graph removes the gaps between kernels, not the kernels. Phi-1.5's graphed decode step was ~1,000 kernels
on an H100 (per layer: copies, casts, adds, GELU's tanh form and the partial rotary embedding as a dozen
elementwise kernels) at 11% of the memory-bandwidth bound at batch 1. Inductor fuses the elementwise work into
few kernels around the matrix products; ``harness.cuda_graphs`` then captures the compiled step at its static
buffers like the eager one (``mode="reduce-overhead"`` is not used: its own graphs would copy the resident cache
in and out of a pool of their own).

One compiled function a decode (``torch.compile`` of the step with dynamic shapes: every row and capacity bucket
reuses one compiled graph, and a single row another; on a CPU the first took 13-21 s to compile, from the cache
2-6 s). Compiled code is cached on disk under the harness's cache
(``ICR_CACHE``/inductor, unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise), so a second run compiles in seconds.

Exactness is checked, not assumed: each graph's first step runs the compiled and the eager step on the same
inputs (``parted``); where they part (another greedy token that is not a near-tie, or logits further apart than the
dtype's rounding), or compiling fails, the compiled step is off for the rest of the run, with the reason logged
and described, and the graphs replay the eager step."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from harness.cache import cache_dir

log = logging.getLogger("harness")

# Logits of the compiled and eager step may differ by this much (a share of the eager logits' largest magnitude):
# fused kernels keep intermediates in float32 and sum in another order. Measured on CPU, float32: 1e-7 (Phi) to
# 2e-5 (the hybrid, over 8 steps).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


class CompileRefused(RuntimeError):
    """The compiled step cannot be used (it failed to compile, or parted from the eager step)."""


class CompiledStep:
    """``fn`` compiled by inductor, called as ``fn`` is; ``disabled`` says why it went off (then ``__call__`` is
    ``fn`` itself). ``seconds`` adds up the calls that compiled."""

    def __init__(self, fn: Callable, what: str):
        _cache_under_the_project()
        self.fn, self.what = fn, what
        self.compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        self.disabled: str | None = None
        self.seconds = 0.0
        self.checked = 0  # graphs whose first step matched the eager step

    def __call__(self, *args):
        if self.disabled:
            return self.fn(*args)
        import torch._dynamo  # noqa: PLC0415 (its config is read when a call compiles)

        # past dynamo's recompile limit a call would silently run the function eagerly: fail instead
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return self.compiled(*args)

    def first(self, run: Callable[[], torch.Tensor], eager: Callable[[], torch.Tensor], shape: str) -> None:
        """A graph's first step: ``run()`` through the compiled step (timed: it may compile), then ``eager()`` on
        the same inputs; raise ``CompileRefused`` where compiling failed or the two part."""
        t0 = time.perf_counter()
        try:
            out = run()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # inductor and dynamo raise many kinds; every one means: run the eager step
            raise CompileRefused(f"compiling failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from e
        spent = time.perf_counter() - t0
        self.seconds += spent
        if spent > 1.0:
            log.info("%s: compiled for %s in %.1f s", self.what, shape, spent)
        why = parted(out, eager())
        if why:
            raise CompileRefused(f"the compiled step parted from the eager one at {shape} ({why})")
        self.checked += 1

    def give_up(self, why: str) -> None:
        log.warning("%s: the compiled step is off for the rest of this run: %s; the graphs replay the eager step",
                    self.what, why)
        self.disabled = why

    def describe(self) -> str:
        if self.disabled:
            return f"compiled step off ({self.disabled})"
        return f"compiled (inductor, {self.seconds:.1f} s compiling)"


def _cache_under_the_project() -> None:
    """Inductor's compiled code under ``ICR_CACHE``/inductor unless the user chose a folder. Importing
    transformers can already have set ``TORCHINDUCTOR_CACHE_DIR`` to torch's default (a temporary folder); that
    one is replaced too."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: PLC0415
        default = os.path.abspath(default_cache_dir())
    except ImportError:  # another torch: leave its choice
        default = None
    if given is None or given == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


def parted(compiled: torch.Tensor, eager: torch.Tensor) -> str | None:
    """Why two steps' logits [rows, vocab] are not the same step's (None: they are): a row whose greedy tokens
    differ where eager's top two are further apart than the two steps differ there, or logits apart by more
    than ``TOLERANCE`` of the eager logits' largest magnitude."""
    c, e = compiled.float(), eager.float()
    diff = (c - e).abs().amax(-1)
    scale = e.abs().amax().clamp_min(1.0)
    tol = TOLERANCE.get(eager.dtype, 1e-2)
    if (diff > tol * scale).any():
        return f"logits apart by {diff.max().item():.3g}, allowed {tol * scale.item():.3g}"
    top2 = e.topk(2, -1).values if e.shape[-1] > 1 else torch.cat([e, e], -1)
    flipped = (c.argmax(-1) != e.argmax(-1)) & (top2[:, 0] - top2[:, 1] > 2 * diff)
    if flipped.any():
        return f"{int(flipped.sum())} greedy token(s) differ"
    return None
