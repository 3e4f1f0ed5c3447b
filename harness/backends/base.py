"""The request-level backend interface (``Backend``), what a run counts, and the device/dtype choices every
backend makes the same way. The step-level contract is ``harness.backends.step``."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from harness.backends.generation import GenRequest, GenResult

log = logging.getLogger("harness")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, float32_default: bool = False) -> torch.dtype:
    """``auto`` is bfloat16 on a GPU that supports it, else float32 (CPU half precision is slow and lossy);
    always float32 for a backend whose ``float32_default`` says so."""
    if dtype == "auto":
        if device.type == "cuda" and not float32_default:
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def counters(backend) -> dict[str, int]:
    """A backend's running counts (prefill tokens, prefix-tree snapshots, rows scored after a shared context),
    created on first use; read by attribute, so a wrapper that forwards attributes counts with what it wraps."""
    stats = getattr(backend, "stats", None)
    if stats is None:
        stats = backend.stats = {}
    return stats


def count(backend, key: str, n: int) -> None:
    stats = counters(backend)
    stats[key] = stats.get(key, 0) + n


def state_nbytes(state: Any) -> int:
    """Bytes of the decoding state a model holds (the paper's memory axis): every distinct tensor reachable from
    ``state`` (a transformers cache's keys, values, conv and SSM states), except that an object with an
    ``nbytes()`` method says its own (Phi-Mamba's cache, ``GrowingLayer``: the filled part of buffers allocated
    with room to spare, which is memory but not state)."""
    seen, total, todo = set(), 0, [state]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.nn.Module)):
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            total += obj.numel() * obj.element_size()
        elif callable(getattr(obj, "nbytes", None)):
            total += obj.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return total


@dataclass
class PlanRecord:
    """What a ``generate_all`` chose (the prefill plan, and why) and, once its batches have run, what prefill
    cost: ``results.json``'s timings (``to_json``)."""

    ran: str  # the plan that ran: tree-rows, tree-block, batch, none, or an engine's own ("vllm prefix caching")
    asked: str  # --prefix-reuse as given
    reason: str | None = None
    estimates_s: dict[str, float] | None = None  # auto: each candidate's predicted prefill seconds
    costs: dict | None = None  # auto: the measured cost model
    prompt_tokens: int | None = None
    tree_tokens: int | None = None
    prefix_memory_bytes: int | None = None  # the tree's snapshot budget
    prefill_tokens: int | None = None  # once run: tokens prefilled
    snapshots: dict[str, int] = field(default_factory=dict)  # once run: the tree's snapshot bytes and recomputes

    @property
    def mode(self) -> str:
        """The plan's family: ``tree`` for both of the tree's prefills."""
        return "tree" if self.ran.startswith("tree-") else self.ran

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prefix_reuse": self.mode, "prefix_reuse_asked": self.asked}
        optional = {"plan_reason": self.reason, "tree_prefill": self.ran[5:] if self.mode == "tree" else None,
                    "plan_estimates_s": {k: round(v, 4) for k, v in self.estimates_s.items()} if self.estimates_s else None,
                    "prefill_costs": self.costs, "prompt_tokens": self.prompt_tokens, "tree_tokens": self.tree_tokens,
                    "prefix_memory_bytes": self.prefix_memory_bytes, "prefill_tokens": self.prefill_tokens}
        out.update((k, v) for k, v in optional.items() if v is not None)
        return {**out, **self.snapshots}


class Generation:
    """What ``Backend.generate_all`` returns: iterate it for (request indices, their results), batch by batch, in
    the order the backend computes them; ``plan`` says what was chosen and, once the iteration has ended, what
    prefill cost."""

    def __init__(self, plan: PlanRecord, batches: Iterator[tuple[list[int], list[GenResult]]]):
        self.plan, self._batches = plan, batches

    def __iter__(self) -> Iterator[tuple[list[int], list[GenResult]]]:
        return self._batches

    def results(self, n: int) -> list[GenResult]:
        """Every result, in request order (``n`` requests)."""
        out: list[GenResult | None] = [None] * n
        for idx, results in self:
            for i, r in zip(idx, results):
                out[i] = r
        return out  # type: ignore[return-value]


class Backend(ABC):
    """Request level: what the engine, the lm-eval adapter and the audit call. A backend that schedules its own
    batches (vLLM) implements ``generate_all`` and ``describe``; ``StepBackend`` implements it for models the
    harness steps itself."""

    name = "base"
    tokenizer: Any
    device: torch.device
    max_context: int | None = None
    # What a backend class can do, asked by generic code (never its name):
    float32_default = False  # ``--dtype auto`` is float32 on every device
    cuda_graphs = False  # decodes from CUDA graphs (``--cuda-graphs on``, and ``auto`` on CUDA)
    own_checkpoints = False  # its checkpoints are no transformers models: no other backend can run them
    takes_engine_args = False  # built with an engine's own settings (``--vllm-arg KEY=VALUE``)
    # the backend ``--audit`` regenerates rows with, in a child process, where this one cannot be its own reference
    # (an engine that caches and schedules across requests would regenerate through the very paths it audits)
    audit_reference: str | None = None

    @abstractmethod
    def generate_all(self, requests: Sequence[GenRequest], batch_size: int | str = "auto",
                     prefix_reuse: str = "auto", prefix_memory: str | int = "auto") -> Generation:
        """Greedy generations for every request. ``batch_size``: rows per batch, or ``auto`` (a token budget);
        ``prefix_reuse``: auto | tree | batch | none (outputs are identical in all; where a mode is not exact or
        not possible for this backend it falls back, and ``info`` says why)."""

    def generate(self, requests: Sequence[GenRequest], batch_size: int | str | None = None,
                 prefix_reuse: str = "none", prefix_memory: str | int = "auto") -> list[GenResult]:
        """``generate_all``'s results in request order; by default one batch, every prompt prefilled whole."""
        if not requests:
            return []
        gen = self.generate_all(requests, batch_size=len(requests) if batch_size is None else batch_size,
                                prefix_reuse=prefix_reuse, prefix_memory=prefix_memory)
        return gen.results(len(requests))

    def loglikelihood(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8,
                      share_contexts: bool = True) -> list[tuple[float, bool]]:
        raise NotImplementedError(f"the {self.name} backend does not score text (loglikelihood); use the "
                                  "transformers or phi-mamba backend")

    @classmethod
    def run_identity(cls, path: str, device: str, dtype: str, options: dict) -> dict[str, Any]:
        """What a run's settings hash holds for this backend beyond the flags (an engine's version and settings),
        decided before the model loads; raising here refuses the run before anything is written."""
        return {}

    def state_bytes(self, tokens: int) -> int | None:
        """Bytes of decoding state a sequence of ``tokens`` tokens holds; None where the backend keeps none of
        its own (vLLM)."""
        return None
