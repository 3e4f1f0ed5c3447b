"""The backend interface, and the device/dtype choices every backend makes the same way."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Iterator, Sequence

import torch

from harness.backends.generation import GenRequest, GenResult, pad_batch

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


# Families whose ``--dtype auto`` is float32 everywhere: the paper's Phi-Mamba numbers (and the official
# Phi-Mamba evaluation) were run in float32; bf16 moved logits by up to 2e-2 and flipped 0-2% of argmaxes on CPU.
FLOAT32_FAMILIES = ("phi-mamba",)


def resolve_dtype(dtype: str, device: torch.device, family: str | None = None) -> torch.dtype:
    """``auto`` is bfloat16 on a GPU that supports it, else float32 (CPU half precision is slow and lossy);
    always float32 for the families in FLOAT32_FAMILIES."""
    if dtype == "auto":
        if device.type == "cuda" and family not in FLOAT32_FAMILIES:
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
    """Bytes of a decoding state: what its ``nbytes()`` says (Phi-Mamba: the filled part of its KV buffers),
    else every distinct tensor reachable from it (a transformers cache's keys, values, conv and SSM states)."""
    if hasattr(state, "nbytes") and callable(state.nbytes):
        return state.nbytes()
    seen, total, todo = set(), 0, [state]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.nn.Module)):
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return total


class Generation:
    """What ``Backend.generate_all`` returns: iterate it for (request indices, their results), batch by batch, in
    the order the backend computes them; ``info`` says what was chosen (the prefill plan, and why) and, once the
    iteration has ended, what prefill cost (``results.json``'s timings)."""

    def __init__(self, info: dict[str, Any], batches: Iterator[tuple[list[int], list[GenResult]]]):
        self.info, self._batches = info, batches

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

    def state_bytes(self, tokens: int) -> int | None:
        """Bytes of decoding state a sequence of ``tokens`` tokens holds; None where the backend keeps none of
        its own (vLLM)."""
        return None



class StepBackend(Backend):
    """A model the harness steps itself: prefill a batch, feed blocks, drop, copy and merge rows. Batching,
    prefix reuse and the prefix tree are chosen for it in one place (``harness.backends.planner``); the decode
    loop (stop strings, tools, limits) is ``greedy_generate``'s."""

    @abstractmethod
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    @abstractmethod
    def step(self, state: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def select(self, state: Any, keep: torch.Tensor) -> Any: ...

    @abstractmethod
    def expand(self, state: Any, n: int) -> Any: ...

    def merge(self, states: Sequence[Any], lengths: Sequence[int]) -> Any:
        raise NotImplementedError(f"the {self.name} backend cannot merge prefilled rows into a batch")

    def extend(self, state: Any, ids: Sequence[int], past: int) -> torch.Tensor:
        """Feed the next run of a prompt's tokens to a one-row state of ``past`` tokens, in place (the prefix
        tree's prefill below a snapshot); logits [1, V] at the last token. A prefill, never a decode step:
        backends override it to skip every other position's logits and any CUDA graph."""
        t = torch.tensor([list(ids)], device=self.device)
        return self.step(state, t, torch.ones((1, past + len(ids)), dtype=torch.long, device=self.device))

    def generate_all(self, requests: Sequence[GenRequest], batch_size: int | str = "auto",
                     prefix_reuse: str = "auto", prefix_memory: str | int = "auto") -> Generation:
        from harness.backends.planner import generate_all

        return generate_all(self, requests, batch_size, prefix_reuse, prefix_memory)

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
        prefilled apart to merge into a batch, and a prompt prefilled in segments (one-token segments and cuts
        at any depth included) to equal it prefilled whole."""
        if type(self).merge is StepBackend.merge:
            return f"the {self.name} backend cannot merge rows prefilled apart"
        return None

    # -- scoring -----------------------------------------------------------------------------------
    def sequence_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of a batch of right-padded sequences, computed from scratch (no state)."""
        raise NotImplementedError(f"the {self.name} backend does not score text (loglikelihood); use the "
                                  "transformers or phi-mamba backend")

    def block_logits(self, state: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Like ``step``, but logits at every position of the right-padded block, [B, L, V]: scoring several
        continuations after one prefilled context. Backends where a block after a copied state is not exact
        leave it unimplemented, and their contexts are recomputed per row."""
        raise NotImplementedError

    @torch.inference_mode()
    def loglikelihood(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8,
                      share_contexts: bool = True) -> list[tuple[float, bool]]:
        """For each (context ids, continuation ids): the continuation's summed log-probability after the context,
        and whether greedy decoding would have produced it token for token.

        Continuations that share a context (a multiple-choice question's choices) are scored after one prefill of
        it where a block after a copied state is exact (``block_logits``). Every other row is padded on the right,
        after its last token, where no causal model (attention, convolution or recurrence) can carry padding back
        into a row's earlier positions: every family batches exactly here, with no mask and no state surgery.
        Longest rows first, so a batch holds similar lengths; results in the input order. A row longer than the
        model's context keeps its last ``max_context`` tokens. ``share_contexts=False`` scores every row on its
        own (the reference the shared path is checked and benchmarked against)."""
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        rest = self._score_shared_contexts(pairs, out, batch_size) if share_contexts else range(len(pairs))
        order = sorted(rest, key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        for start in range(0, len(order), max(1, batch_size)):
            rows = order[start:start + max(1, batch_size)]
            inputs = [self._scoring_input(*pairs[i]) for i in rows]
            ids, _ = pad_batch(inputs, pad, self.device, side="right")
            logits = self.sequence_logits(ids)
            for r, i in enumerate(rows):
                n = len(inputs[r])
                out[i] = _score(logits[r, n - len(pairs[i][1]):n], pairs[i][1])  # the positions predicting it
        return out  # type: ignore[return-value]

    def _score_shared_contexts(self, pairs, out: list, batch_size: int) -> list[int]:
        """Score the pairs whose context another pair shares, one prefill per context; the indices left over."""
        if not self.prefix_exact() or type(self).block_logits is StepBackend.block_logits:
            return list(range(len(pairs)))
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (ctx, _) in enumerate(pairs):
            groups.setdefault(tuple(ctx), []).append(i)
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        rest = []
        for ctx, members in groups.items():
            fits = not self.max_context or len(ctx) + max(len(pairs[i][1]) for i in members) - 1 <= self.max_context
            if len(members) < 2 or not fits:
                rest += members
                continue
            self._scoring_input(list(ctx), pairs[members[0]][1])  # the same checks as a row scored alone
            t = torch.tensor([list(ctx)], device=self.device)
            first, state = self.prefill(t, torch.ones_like(t))  # logits predicting each continuation's first token
            count(self, "loglikelihood_shared_rows", len(members))
            for start in range(0, len(members), max(1, batch_size)):
                rows = members[start:start + max(1, batch_size)]
                conts = [list(pairs[i][1]) for i in rows]
                if max(map(len, conts)) == 1:
                    for i in rows:
                        out[i] = _score(first[0][None], pairs[i][1])
                    continue
                block, mask = pad_batch([c[:-1] or [pad] for c in conts], pad, self.device, side="right")
                mask = torch.cat([mask.new_ones(len(rows), len(ctx)), mask], 1)
                logits = self.block_logits(self.expand(state, len(rows)), block, mask)
                for r, i in enumerate(rows):
                    out[i] = _score(torch.cat([first[0][None], logits[r, :len(conts[r]) - 1].float()]), conts[r])
        return rest

    def _scoring_input(self, context: Sequence[int], continuation: Sequence[int]) -> list[int]:
        if not continuation:
            raise ValueError("loglikelihood: an empty continuation has nothing to score")
        if not context:
            raise ValueError("loglikelihood: the first token has no context to be predicted from; start the "
                             "context with a BOS/EOS token")
        seq = [*context, *continuation][:-1]  # the last token is only predicted
        if self.max_context and len(seq) > self.max_context:
            if len(continuation) > self.max_context:
                raise ValueError(f"loglikelihood: a continuation of {len(continuation)} tokens does not fit the "
                                 f"model's {self.max_context}-token context")
            seq = seq[-self.max_context:]
        return seq

    @torch.inference_mode()
    def state_bytes(self, tokens: int) -> int | None:
        """Bytes of decoding state one sequence of ``tokens`` tokens holds (KV cache at its length, conv and SSM
        state, both for hybrids): fitted once from two real prefills as a constant plus a per-token part (exact
        for both kinds of state). None where the backend keeps no state of its own (vLLM)."""
        fit = getattr(self, "_state_fit", False)
        if fit is False:
            try:
                sizes = []
                for n in (8, 24):
                    ids = (torch.arange(n, device=self.device) % max(2, len(self.tokenizer) - 1) + 1)[None]
                    sizes.append(state_nbytes(self.prefill(ids, torch.ones_like(ids))[1]))
                per_token = (sizes[1] - sizes[0]) / 16
                fit = (sizes[0] - 8 * per_token, per_token)
            except NotImplementedError:
                fit = None
            self._state_fit = fit
        return None if fit is None else int(round(fit[0] + fit[1] * tokens))

    def token_budget(self) -> int:
        """Tokens (batch x sequence length) one batch may hold; used by ``--batch-size auto``. A token costs the
        larger of what its cache holds while decoding and what a prefill needs per token, measured."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            per_token = max(self.bytes_per_token(), self.prefill_bytes_per_token())
            return max(2048, int(free * 0.5 / max(1, per_token)))
        return 16384

    @torch.inference_mode()
    def prefill_bytes_per_token(self, length: int = 2048) -> int:
        """Peak CUDA memory one prefilled token takes (activations, the kernels' scratch, its cache), measured once
        on one prompt of ``length`` tokens. A recurrent model's cache is small but its prefill is not: on an H100 a
        Phi-Mamba batch sized by its cache alone ran out of memory."""
        if getattr(self, "_prefill_cost", None) is None:
            n = min(length, self.max_context or length)
            ids = torch.full((1, n), self.tokenizer.eos_token_id or 0, device=self.device)
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            out = self.prefill(ids, torch.ones_like(ids))
            torch.cuda.synchronize(self.device)
            self._prefill_cost = -(-(torch.cuda.max_memory_allocated(self.device) - base) // n)
            del out
            torch.cuda.empty_cache()
        return self._prefill_cost

    def bytes_per_token(self) -> int:
        """Memory one cached token costs while decoding; a conservative default."""
        return 1 << 20



def _score(logits: torch.Tensor, continuation: Sequence[int]) -> tuple[float, bool]:
    """Summed log-probability of ``continuation`` under the logits at the positions predicting it, and whether
    each of its tokens is the argmax."""
    cont = torch.tensor(list(continuation), device=logits.device)
    lp = logits.float().log_softmax(-1)
    return float(lp.gather(1, cont[:, None]).sum()), bool((lp.argmax(-1) == cont).all())
