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

Given a weight as it lies, oneDNN reorders it into its blocked layout at every call. Where the machine's choice
found the reordered ("packed") weight's outputs equal to the plain one's, bit for bit, from two rows a call
(``PACKED_FROM_ROWS``; one row takes another code path and rounds apart), each layer keeps a packed copy, made at
its first call and again if its weight changes (in place, or replaced), as TorchInductor's CPU code does with
frozen weights (measured in docs/throughput.md). The copies are the weights' size again, so a model packs only
where they fit ``PACK_SHARE`` of the memory free at load time (``use_onednn``). Packed and plain give the same
bits, so packing is not part of a run's settings.
``ICR_CPU_LINEAR``: ``auto`` (default), ``onednn`` (every call, from one row) or ``blas`` (PyTorch's own)."""
from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from harness.backends.memory import available_memory
from harness.cache import MachineChoices, machine_key

log = logging.getLogger("harness")

ROWS = (1, 4, 16, 64, 256)  # rows a call, where the two kernels are timed
WIDTHS = (512, 1024)  # the timed layer: inputs, outputs
REPEATS = 5  # timed calls a kernel and row count, in turn with the other kernel; the fastest counts
SPEEDUP = 1.1  # oneDNN runs a call from the row count where it was this much faster at every count measured above
TOLERANCE = 1e-5  # largest difference between the kernels' outputs, relative to the output's largest value
PACKED_FROM_ROWS = 2  # calls of this many rows or more take a layer's packed weight, where it packs
EQUAL_ROWS = (PACKED_FROM_ROWS, 3, 4, 16, 64, 256)  # row counts where packed and plain outputs must be equal
PACKED_SLOWEST = 0.95  # packed weights are not taken where they ran slower than this (plain time / packed)
PACK_SHARE = 0.25  # a model packs where its packed copies fit this share of the memory free at load time
CHOICES = MachineChoices("cpu-linear.json", "the CPU's linear kernel")
IDENTITY = "oneDNN, GELU epilogue"  # what a run's settings hold where the kernel is taken (``identity``)


@dataclass(frozen=True)
class LinearKernel:
    """oneDNN from ``min_rows`` rows a call (``min_rows`` None: BLAS for every call), and why; ``packed``:
    layers may keep their weights packed (equal outputs measured)."""

    min_rows: int | None
    why: str
    packed: bool = False

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
    packs = False  # keeps a packed copy of its weight (``use_onednn``)
    _packed, _packed_of = None, None  # the copy, and what it was made from (``_source``)

    def forward(self, x):
        return _oneDNN(x, self._weight(x), self.bias) if self._takes(x) else F.linear(x, self.weight, self.bias)

    def _weight(self, x) -> torch.Tensor:
        """The weight oneDNN takes for this call: the packed copy from ``PACKED_FROM_ROWS`` rows where the layer
        packs (made now if it has none, or if the weight changed since: in place, its storage, or the parameter
        itself; checked on this call's input against the plain weight, to the bit), else the weight itself."""
        if not self.packs or x.numel() < PACKED_FROM_ROWS * x.shape[-1]:
            return self.weight
        if self._packed is None or not _same_source(self._packed_of, self.weight):
            packed = pack(self.weight)
            if not torch.equal(_oneDNN(x, packed, self.bias), _oneDNN(x, self.weight, self.bias)):
                self.packs = False  # the machine's check held, this layer's shape or input does not: never packed
                log.warning("a %s linear layer's packed weight parted from its plain one on a call of %d rows; "
                            "the layer keeps its plain weight", tuple(self.weight.shape), x.numel() // x.shape[-1])
                return self.weight
            self._packed, self._packed_of = packed, _source(self.weight)
        return self._packed

    def __getstate__(self):
        """A copy (``copy.deepcopy``, pickle) leaves the packed weight behind, which neither can read: the copy
        packs its own at its first call."""
        return {**self.__dict__, "_packed": None, "_packed_of": None}

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
            return _oneDNN(x, self._weight(x), self.bias, "gelu", "tanh")
        return F.gelu(F.linear(x, self.weight, self.bias), approximate="tanh")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered into oneDNN's own layout (a copy; ``_linear_pointwise`` takes it as the weight)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _source(weight: torch.Tensor) -> tuple:
    """What a packed copy was made from: the parameter (weakly), its storage and its in-place version."""
    return weakref.ref(weight), weight.data_ptr(), _version(weight)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter (None for an inference tensor, which keeps none and cannot change)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _same_source(source: tuple | None, weight: torch.Tensor) -> bool:
    """Whether ``weight`` is still what ``source`` was taken from, unchanged (every call of a packing layer asks:
    no new reference made to answer)."""
    if source is None:
        return False
    ref, address, version = source
    return ref() is weight and address == weight.data_ptr() and version == _version(weight)


def use_onednn(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Every plain ``nn.Linear`` of a float32 model on a CPU runs through ``OneDNNLinear`` where ``choice`` says
    so, with packed weights where it says so and they fit (``PACK_SHARE``); what changed, for the run's record
    (None: nothing)."""
    kernel = _taken(device, dtype)
    if kernel is None:
        return None
    swapped = [m for m in model.modules() if type(m) is nn.Linear]
    weights = {m.weight.data_ptr(): m.weight.numel() * m.weight.element_size() for m in swapped}
    free = available_memory()
    packs = kernel.packed and free is not None and sum(weights.values()) <= PACK_SHARE * free
    for module in swapped:
        module.__class__ = OneDNNLinear
        module.min_rows, module.packs = kernel.min_rows, packs
    if not swapped:
        return None
    if kernel.packed:
        mb = sum(weights.values()) / 2**20
        packing = (f", weights packed ({mb:.0f} MiB more)" if packs else
                   f", weights not packed: {mb:.0f} MiB more would not fit {PACK_SHARE:.0%} of the free memory")
    else:
        packing = ""
    return f"nn.Linear x{len(swapped)} -> {kernel.describe()}{packing} ({kernel.why})"


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
        return LinearKernel(1, "ICR_CPU_LINEAR=onednn")  # unmeasured: weights not packed
    key = machine_key()

    def measured() -> dict:
        entry = measure()
        log.info("CPU linear kernel, %s: %s", key, entry)
        return entry

    entry = CHOICES.recall(key, measured, _usable)
    return LinearKernel(entry["min_rows"], entry["why"], entry["packed"])


def _usable(entry) -> bool:
    """A remembered choice this code can use (one from before packing was measured is measured again)."""
    return (isinstance(entry, dict) and isinstance(entry.get("why"), str) and isinstance(entry.get("packed"), bool)
            and (entry.get("min_rows") is None or (isinstance(entry["min_rows"], int) and entry["min_rows"] >= 1)))


def measure() -> dict:
    """Both kernels timed in turn on a ``WIDTHS`` layer at each of ``ROWS``: oneDNN from the smallest count from
    which it was ``SPEEDUP`` faster at every larger one, if its outputs equal BLAS's within ``TOLERANCE``; its
    weights packed if that is equal to the bit and not slower (``packing``)."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(WIDTHS[1], WIDTHS[0], generator=g), torch.randn(WIDTHS[1], generator=g)
    ratios = {}
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, WIDTHS[0], generator=g)
            ours, theirs = _oneDNN(x, weight, bias), F.linear(x, weight, bias)  # warm: oneDNN builds its primitive
            gap = float((ours - theirs).abs().max() / theirs.abs().max())
            if gap > TOLERANCE:
                return {"min_rows": None, "why": f"oneDNN parted from BLAS by {gap:.1e} at {rows} rows",
                        "packed": False}
            ratios[rows] = _speedup(lambda: F.linear(x, weight, bias), lambda: _oneDNN(x, weight, bias))
        chosen = decide(ratios)
        packed, said = packing(weight, bias, g) if chosen["min_rows"] is not None else (False, "")
    return {**chosen, "packed": packed, "why": chosen["why"] + said}


def _speedup(slow, fast) -> float:
    """``slow()``'s time over ``fast()``'s, the fastest of ``REPEATS`` calls each, taken in turn."""
    best = [float("inf"), float("inf")]
    for _ in range(REPEATS):
        for i, fn in enumerate((slow, fast)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0] / best[1]


def packing(weight: torch.Tensor, bias: torch.Tensor, g: torch.Generator) -> tuple[bool, str]:
    """Whether layers keep packed weights here: the outputs from a packed weight equal the plain weight's to the
    bit at every ``EQUAL_ROWS`` count (with and without a bias, and through the GELU epilogue), and it is not
    slower (``PACKED_SLOWEST``) at the largest ``ROWS`` count; and what was found, for the choice's record."""
    packed = pack(weight)
    for rows in EQUAL_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=g)
        for b in (bias, None):
            for how in (("none", ""), ("gelu", "tanh")):
                if not torch.equal(_oneDNN(x, packed, b, *how), _oneDNN(x, weight, b, *how)):
                    return False, f"; packed weights not taken: outputs part at {rows} rows"
    x = torch.randn(ROWS[-1], weight.shape[1], generator=g)
    ratio = _speedup(lambda: _oneDNN(x, weight, bias), lambda: _oneDNN(x, packed, bias))
    if ratio < PACKED_SLOWEST:
        return False, f"; packed weights not taken: {ratio:.2f}x at {ROWS[-1]} rows"
    return True, f"; packed weights {ratio:.2f}x at {ROWS[-1]} rows, equal to the bit from {EQUAL_ROWS[0]} rows"


def decide(ratios: dict[int, float]) -> dict:
    """The choice from BLAS's time over oneDNN's at each row count."""
    counts = sorted(ratios)
    wins = [r for r in counts if all(ratios[s] >= SPEEDUP for s in counts if s >= r)]
    said = ", ".join(f"{r} rows {ratios[r]:.2f}x" for r in counts)
    if not wins:
        return {"min_rows": None, "why": f"oneDNN not faster than BLAS here ({said})"}
    return {"min_rows": wins[0], "why": f"measured over BLAS: {said}"}
