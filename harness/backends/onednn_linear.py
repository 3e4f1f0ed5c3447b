"""On a CPU, float32 linear layers through oneDNN where this machine runs oneDNN faster than PyTorch's BLAS.

PyTorch's ``F.linear`` in float32 on a CPU calls its BLAS (MKL in the PyPI wheels), and MKL runs its AVX2 code
on AMD processors that have AVX-512: on a 2-core AMD EPYC it ran the tiny Phi's layers at 205 GFLOP/s where
oneDNN, which PyTorch also ships (``torch.ops.mkldnn._linear_pointwise``, what TorchInductor's CPU code calls),
ran them at 420-490 (the LM head at 24 rows: 3.1 ms against 7.8), within float32 rounding of each other; vLLM's
CPU build takes the same route. Which is faster is the machine's business, so it is measured once a machine
(``choice``: a generic layer at a few row counts, both kernels in turn) and remembered in the harness's cache
(``cpu-linear.json``): every process on the machine then takes the same kernel, and a run's rows stay
reproducible bit for bit. oneDNN runs a call only from the row count where it won at every larger count measured
(one row, a batch-1 decoding step, stays on BLAS's matrix-vector code there). Long blocks' attention follows the
same choice (``chunked_attention``: its products through ``product``).

The two kernels round apart (an ulp of the sums' order, as SDPA's kernels do against eager attention), so the
kernel is part of a CPU run's settings (``identity``): rows from both kernels never mix in one run.
``ICR_CPU_LINEAR``: ``auto`` (default), ``onednn`` (every call, from one row) or ``blas`` (PyTorch's own)."""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from harness.cache import MachineChoices, machine_key

log = logging.getLogger("harness")

ROWS = (1, 4, 16, 64, 256)  # rows a call, where the two kernels are timed
WIDTHS = (512, 1024)  # the timed layer: inputs, outputs
REPEATS = 5  # timed calls a kernel and row count, in turn with the other kernel; the fastest counts
SPEEDUP = 1.1  # oneDNN runs a call from the row count where it was this much faster at every count measured above
TOLERANCE = 1e-5  # largest difference between the kernels' outputs, relative to the output's largest value
CHOICES = MachineChoices("cpu-linear.json", "the CPU's linear kernel")
IDENTITY = "oneDNN, GELU epilogue"  # what a run's settings hold where the kernel is taken (``identity``)


@dataclass(frozen=True)
class LinearKernel:
    """oneDNN from ``min_rows`` rows a call (``min_rows`` None: BLAS for every call), and why."""

    min_rows: int | None
    why: str

    @property
    def onednn(self) -> bool:
        return self.min_rows is not None

    def describe(self) -> str | None:
        """How a run's record names it (None: PyTorch's own kernel, as before this choice existed)."""
        return f"oneDNN from {self.min_rows} rows a call" if self.onednn else None


def _oneDNN(x, weight, bias, epilogue: str = "none", algorithm: str = ""):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, epilogue, [], algorithm)


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` by oneDNN (float32 on a CPU; ``weight`` contiguous, or the transpose of a contiguous
    matrix, which oneDNN reads as it lies: the attention's values): attention's products on a machine whose choice
    is oneDNN (``chunked_attention``)."""
    return _oneDNN(x, weight, None)


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose float32 CPU calls without gradients run oneDNN from ``min_rows`` rows; its parameters
    and state dict are the module's own (the class of a loaded module is swapped, nothing is copied). Traced by
    TorchInductor (a compiled step) it is a plain linear layer: inductor picks its own CPU kernels."""

    min_rows = 1

    def forward(self, x):
        return _oneDNN(x, self.weight, self.bias) if self._takes(x) else F.linear(x, self.weight, self.bias)

    def _takes(self, x) -> bool:
        """Whether oneDNN runs this call."""
        return not (torch.compiler.is_compiling() or x.dim() < 2 or x.device.type != "cpu"
                    or x.dtype != torch.float32 or self.weight.dtype != torch.float32
                    or x.numel() < self.min_rows * x.shape[-1]
                    or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))


class OneDNNLinearGELU(OneDNNLinear):
    """``OneDNNLinear`` then the tanh GELU, which oneDNN applies as the product's epilogue (one pass over the
    MLP's widest activation fewer: the tiny Phi's fc1 at 2,300 rows 2.6 ms against 3.8 ms, the two within 5e-7
    at a scale of 4). Set up by ``fused_activations.gelu_into_linear``, which verifies it on the model."""

    def forward(self, x):
        if self._takes(x):
            return _oneDNN(x, self.weight, self.bias, "gelu", "tanh")
        return F.gelu(F.linear(x, self.weight, self.bias), approximate="tanh")


def use_onednn(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Every plain ``nn.Linear`` of a float32 model on a CPU runs through ``OneDNNLinear`` where ``choice`` says
    so; what changed, for the run's record (None: nothing)."""
    kernel = _taken(device, dtype)
    if kernel is None:
        return None
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            module.min_rows = kernel.min_rows
            swapped += 1
    return f"nn.Linear x{swapped} -> {kernel.describe()} ({kernel.why})" if swapped else None


def identity(device: torch.device, dtype: torch.dtype) -> dict:
    """What a run's settings hold of the linear kernel, decided before the model loads: ``oneDNN`` where a float32
    run on a CPU takes it, else nothing (so other runs' settings are what they were). The kernel, not its row
    count: two machines of one model whose timings drew the line at another count round apart only in calls of
    a few rows, as two CPUs' BLAS code paths do."""
    return {"linear": IDENTITY} if _taken(device, dtype) is not None else {}


def _taken(device: torch.device, dtype: torch.dtype) -> LinearKernel | None:
    """The machine's choice where a float32 model on a CPU takes oneDNN, else None."""
    kernel = choice() if device.type == "cpu" and dtype == torch.float32 else None
    return kernel if kernel is not None and kernel.onednn else None


@functools.lru_cache(maxsize=None)
def choice() -> LinearKernel:
    """The kernel float32 linear layers take on this CPU: ``ICR_CPU_LINEAR`` if set, else remembered, else
    measured now (about 0.05 s) and remembered."""
    how = os.environ.get("ICR_CPU_LINEAR") or "auto"
    if how not in ("auto", "onednn", "blas"):
        raise ValueError(f"ICR_CPU_LINEAR={how!r}: use auto, onednn or blas (or leave it unset)")
    if how == "blas":
        return LinearKernel(None, "ICR_CPU_LINEAR=blas")
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return LinearKernel(None, "this torch has no oneDNN linear")
    if how == "onednn":
        return LinearKernel(1, "ICR_CPU_LINEAR=onednn")
    key = machine_key()

    def measured() -> dict:
        entry = measure()
        log.info("CPU linear kernel, %s: %s", key, entry)
        return entry

    entry = CHOICES.recall(key, measured, _usable)
    return LinearKernel(entry["min_rows"], entry["why"])


def _usable(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("why"), str)
            and (entry.get("min_rows") is None or (isinstance(entry["min_rows"], int) and entry["min_rows"] >= 1)))


def measure() -> dict:
    """Both kernels timed in turn on a ``WIDTHS`` layer at each of ``ROWS``: oneDNN from the smallest count from
    which it was ``SPEEDUP`` faster at every larger one, if its outputs equal BLAS's within ``TOLERANCE``."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(WIDTHS[1], WIDTHS[0], generator=g), torch.randn(WIDTHS[1], generator=g)
    ratios = {}
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, WIDTHS[0], generator=g)
            ours, theirs = _oneDNN(x, weight, bias), F.linear(x, weight, bias)  # warm: oneDNN builds its primitive
            gap = float((ours - theirs).abs().max() / theirs.abs().max())
            if gap > TOLERANCE:
                return {"min_rows": None, "why": f"oneDNN parted from BLAS by {gap:.1e} at {rows} rows"}
            best = {"onednn": float("inf"), "blas": float("inf")}
            for _ in range(REPEATS):
                for name, fn in (("onednn", _oneDNN), ("blas", F.linear)):
                    start = time.perf_counter()
                    fn(x, weight, bias)
                    best[name] = min(best[name], time.perf_counter() - start)
            ratios[rows] = best["blas"] / best["onednn"]
    return decide(ratios)


def decide(ratios: dict[int, float]) -> dict:
    """The choice from BLAS's time over oneDNN's at each row count."""
    counts = sorted(ratios)
    wins = [r for r in counts if all(ratios[s] >= SPEEDUP for s in counts if s >= r)]
    said = ", ".join(f"{r} rows {ratios[r]:.2f}x" for r in counts)
    if not wins:
        return {"min_rows": None, "why": f"oneDNN not faster than BLAS here ({said})"}
    return {"min_rows": wins[0], "why": f"measured over BLAS: {said}"}
