"""The backends' contract, on the ground floor: what a caller sends (``GenRequest``) and gets back (``GenResult``,
``Generation``, ``PlanRecord``), what a backend says of itself (``BackendInfo``), the request level every backend
implements (``Backend``), the step level of models the harness steps itself (``StepModel``, with its optional
abilities as mixins named in the class line: ``MergesRows``, ``ScoresText``, ``ScoresBlocks``), and the
device/dtype choices every backend makes the same way. Nothing here imports another backend module; the decode
loop, the planner, the scorer and the memory probes import this file (``harness.backends.step`` wires them)."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import torch

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


class Tool(Protocol):
    """Something the model calls by writing text that ends in ``call_end``; returns text to insert.

    ``text`` is the whole generation up to and including ``call_end``; ``start`` is where the model's own
    writing since the previous tool result begins, so a call is parsed from that part only (a pattern can
    never swallow an earlier result). Calls of one decoding step run concurrently, so a tool must be safe
    to call from a worker thread. A tool whose calls wait on nothing outside the interpreter (no worker
    process) sets ``waits = False`` and is called in turn: threads would only take turns at the interpreter."""

    call_end: str
    max_calls: int
    # waits: bool = True  (optional; read with getattr)

    def __call__(self, text: str, start: int = 0) -> str: ...


@dataclass
class GenRequest:
    prompt: str
    max_new_tokens: int
    stop: Sequence[str] = ()
    tool: Tool | None = None
    prompt_ids: list[int] | None = None  # pre-tokenised prompt, when the caller already counted it


@dataclass
class GenResult:
    text: str
    finish_reason: str  # "stop" | "eos" | "length" | "context"
    prompt_tokens: int
    new_tokens: int  # tokens the model chose
    tool_tokens: int = 0  # tokens inserted by the tool
    token_ids: list[int] = field(default_factory=list)  # model and tool tokens, in order, before stop-cutting
    tool_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of inserted tokens in token_ids
    # [start, end) of tokens fed in place of a model token that ran past a call's closing tag (the call text
    # re-tokenized up to the tag end): the model chose their text, not these exact tokens
    retokenized_spans: list[tuple[int, int]] = field(default_factory=list)
    stop_string: str | None = None  # the stop string that ended generation (cut from ``text``)


@dataclass(frozen=True)
class BackendInfo:
    """What a loaded backend says it runs with: results.json's ``backend``; the engine's settings hash takes the
    dtype, the device type and the scan path from it (what really runs, whatever the flags asked)."""

    backend: str
    device: str
    dtype: str
    max_context: int | None = None
    model_class: str | None = None
    family: str | None = None  # the transformers family (harness.backends.families)
    scan: str | None = None  # the Mamba layers' scan path, where its kernels round apart from the reference
    decode: str | None = None  # eager, or the CUDA graphs' description
    fused: list[str] | None = None  # modules swapped for fused kernels (harness.backends.fused_activations)
    linear: str | None = None  # a CPU's float32 linear kernel where not PyTorch's own (harness.backends.onednn_linear)
    attention: str | None = None  # a CPU's attention kernel where not PyTorch's own (harness.ops.cpu_flash)
    parameters: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # what one backend alone reports (vLLM's engine settings)

    def to_json(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in ("backend", "device", "dtype", "model_class", "max_context", "family",
                                             "scan", "decode", "fused", "linear", "attention", "parameters")}
        return {**{k: v for k, v in out.items() if v is not None or k == "max_context"}, **self.extra}


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


def probe_ids(backend, rows: int, n: int) -> torch.Tensor:
    """[rows, n] throwaway token ids, varied and never 0 or the last id, on the backend's device: the prompts of
    a measurement or a check that is not the run's work."""
    vocab = max(3, len(backend.tokenizer) - 1)
    return (torch.arange(rows * n, device=backend.device) * 7919 % (vocab - 1) + 1).view(rows, n)


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
    batching: str | None = None  # continuous | static (step backends: harness.backends.planner.batching)
    batching_reason: str | None = None

    @property
    def mode(self) -> str:
        """The plan's family: ``tree`` for both of the tree's prefills."""
        return "tree" if self.ran.startswith("tree-") else self.ran

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prefix_reuse": self.mode, "prefix_reuse_asked": self.asked}
        optional = {"plan_reason": self.reason, "tree_prefill": self.ran[5:] if self.mode == "tree" else None,
                    "plan_estimates_s": {k: round(v, 4) for k, v in self.estimates_s.items()} if self.estimates_s else None,
                    "prefill_costs": self.costs, "prompt_tokens": self.prompt_tokens, "tree_tokens": self.tree_tokens,
                    "prefix_memory_bytes": self.prefix_memory_bytes, "prefill_tokens": self.prefill_tokens,
                    "batching": self.batching, "batching_reason": self.batching_reason}
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
    batches (vLLM) implements ``generate_all`` and ``describe``; ``harness.backends.step.StepBackend`` implements
    ``generate_all`` for a ``StepModel``."""

    name = "base"
    tokenizer: Any
    device: torch.device
    max_context: int | None = None
    # What a backend class can do, asked by generic code (never its name):
    float32_default = False  # ``--dtype auto`` is float32 on every device
    graph_decode_capable = False  # can decode from CUDA graphs (what ``--cuda-graphs`` turns on)
    own_checkpoints = False  # its checkpoints are no transformers models: only backends that say so run them
    runs_checkpoints_of: tuple[str, ...] = ()  # backends whose own checkpoints this one runs too
    takes_engine_args = False  # built with an engine's own settings (``--vllm-arg KEY=VALUE``)
    # the backend ``--audit`` regenerates rows with, in a child process, where this one cannot be its own reference
    # (an engine that caches and schedules across requests would regenerate through the very paths it audits)
    audit_reference: str | None = None

    @abstractmethod
    def describe(self) -> BackendInfo:
        """What this backend runs with (device, dtype, scan path, decode path, ...)."""

    @classmethod
    def parse_engine_args(cls, pairs: Sequence[str] | None) -> dict[str, Any]:
        """``--vllm-arg KEY=VALUE`` pairs as this backend's engine arguments; a backend that takes none (every
        one but an engine's: ``takes_engine_args``) refuses any."""
        if pairs:
            raise ValueError(f"--vllm-arg {' '.join(pairs)}: the {cls.name} backend takes no engine arguments")
        return {}

    @abstractmethod
    def generate_all(self, requests: Sequence[GenRequest], batch_size: int | str = "auto",
                     prefix_reuse: str = "auto", prefix_memory: str | int = "auto", batching: str = "auto"
                     ) -> Generation:
        """Greedy generations for every request. ``batch_size``: rows per batch, or ``auto`` (a token budget);
        ``prefix_reuse``: auto | tree | batch | none; ``batching``: auto | static | continuous (outputs are
        identical in all; where a mode is not exact or not possible for this backend it falls back, and ``plan``
        says why)."""

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


class StepModel(ABC):
    """The step contract: a model the harness steps itself. Prefill a left-padded batch, feed right-padded blocks,
    drop and copy rows; the decode loop (``harness.backends.generation``), the planner, the scorer and the memory
    probes need nothing else. What is exact for it are three questions the planner reads."""

    name: str
    tokenizer: Any
    device: torch.device

    @abstractmethod
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Run a left-padded batch; return last-position logits [B, V] and a decoding state."""

    @abstractmethod
    def step(self, state: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Feed a right-padded block per row ([B, L]; usually L = 1). ``attention_mask`` covers everything so
        far, its last L columns being the block's. Returns logits at each row's last real token, [B, V]."""

    @abstractmethod
    def select(self, state: Any, keep: torch.Tensor) -> Any:
        """Keep only the rows at indices ``keep`` (finished rows leave the batch)."""

    @abstractmethod
    def expand(self, state: Any, n: int) -> Any:
        """A fresh copy of a one-row state repeated ``n`` times (the shared prefix, copied into each row)."""

    def feeds_token_by_token(self, widths: Sequence[int]) -> bool:
        """Whether a step of blocks this wide (one width a row) costs a call per token anyway: a recurrent family
        that puts back the state of each row whose block has ended. The decode loop then feeds every row one
        token a step, so the rows not absorbing a tool result go on writing in those calls."""
        return False

    def extend(self, state: Any, ids: Sequence[int], past: int) -> torch.Tensor:
        """Feed the next run of a prompt's tokens to a one-row state of ``past`` tokens, in place (the prefix
        tree's prefill below a snapshot); logits [1, V] at the last token. A prefill, never a decode step:
        backends override it to skip every other position's logits and any CUDA graph."""
        t = torch.tensor([list(ids)], device=self.device)
        return self.step(state, t, torch.ones((1, past + len(ids)), dtype=torch.long, device=self.device))

    # -- what is exact here (the planner reads these; nothing else decides) ------------------------------
    def batches_exact(self) -> bool:
        """Whether prompts padded into one batch give what each gives alone (else every sample runs alone)."""
        return True

    def prefix_exact(self) -> bool:
        """Whether a right-padded block fed after a copied state is exact in one call: the shared prefix's
        reuse, and the prefix tree's batched prefill below its snapshots."""
        return True

    def tree_unsupported(self) -> str | None:
        """Why prompts may not be prefilled through a prefix tree here (None: they may). The tree needs rows
        prefilled apart to merge into a batch (``MergesRows``), and a prompt prefilled in segments (one-token
        segments and cuts at any depth included) to equal it prefilled whole."""
        if not isinstance(self, MergesRows):
            return f"the {self.name} backend cannot merge rows prefilled apart"
        return None

    def bytes_per_token(self) -> int:
        """Memory one cached token costs while decoding; a conservative default (backends say theirs)."""
        return 1 << 20


class MergesRows(ABC):
    """A step model whose rows, prefilled apart, merge into one batch: what the prefix tree needs."""

    @abstractmethod
    def merge(self, states: Sequence[Any], lengths: Sequence[int], shared: int = 0) -> Any:
        """One batch state from one-row, unpadded states of ``lengths`` tokens each (prompts prefilled through
        the prefix tree): attention keys and values left-padded to the longest (the mask hides the pads),
        recurrent state stacked. ``shared`` > 0 (only where ``merges_shared_front``): the rows' first ``shared``
        positions, the same tokens in every row, stay in front and the pads go after them
        (``generation.shared_front_mask``), so attention can read that part once for all rows."""

    def merges_shared_front(self) -> bool:
        """Whether ``merge`` takes ``shared`` (and its steps attend over the shared front once for all rows)."""
        return False

    def row_slots(self, rows: int, width: int) -> Any | None:
        """Room for a batch of ``rows`` rows of at most ``width`` tokens that each row's own prefill writes into
        (``place``), so that ``merge_slots`` copies nothing; None (the default): rows are merged by ``merge``."""
        return None

    def place(self, state: Any, slots: Any, row: int) -> None:
        """The one-row ``state`` writes its next positions into row ``row`` of ``slots`` (``row_slots``)."""
        raise NotImplementedError(f"{type(self).__name__} has no row slots")

    def merge_slots(self, states: Sequence[Any], seqs: Sequence[Sequence[int]], shared: int, slots: Any) -> Any:
        """``merge``'s batch laid out in ``slots``: each row's tokens (``seqs``: its prompt) first, its pads after
        them (a right-padded mask, ``generation.right_pad``), ``shared`` as in ``merge``; rows that share more
        than the front sit at the same positions, so the steps may read what they share once. A row that did not
        prefill into its slot is copied there."""
        raise NotImplementedError(f"{type(self).__name__} has no row slots")


class JoinsBatches(ABC):
    """A step model whose running batch takes new rows (continuous batching: ``generation.continuous_generate``)."""

    @abstractmethod
    def join(self, states: Sequence[Any], cuts: Sequence[tuple[int, int, int]]) -> Any:
        """One batch state from running batches' states (their rows in order), each's (width, cut, pad) from
        ``generation.join_masks``: of its ``width`` cached positions the first ``cut`` dropped (masked in all its
        rows) and ``pad`` masked ones put before the rest; recurrent state stacked. ``states`` are consumed."""

    def join_unsupported(self) -> str | None:
        """Why this model's batches cannot be joined here (None: they can)."""
        return None

    def key_share(self) -> float:
        """The share of its layers whose state is attention keys and values, which a join pads to the widest
        batch's span (a recurrent state is fixed-size: a join adds nothing any row computes over)."""
        return 1.0


def join_refusal(model) -> str | None:
    """Why ``model``'s running batch cannot take new rows (None: it can): its own reason, or that it does not
    join batches at all."""
    return model.join_unsupported() if isinstance(model, JoinsBatches) else \
        f"the {model.name} backend cannot join batches"


class ScoresText(ABC):
    """A step model that scores text (``loglikelihood``) from its logits."""

    @abstractmethod
    def sequence_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of a batch of right-padded sequences, computed from scratch (no state)."""


class ScoresBlocks(ABC):
    """A step model that gives every position's logits of a block fed after a state: continuations sharing a
    context are scored after one prefill (where ``prefix_exact`` also holds; else contexts are recomputed)."""

    @abstractmethod
    def block_logits(self, state: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Like ``step``, but logits at every position of the right-padded block, [B, L, V]."""
