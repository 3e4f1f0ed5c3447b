"""The step-level backend contract: a model the harness steps itself (prefill, step, select, expand, merge,
extend). Its ``generate_all`` is the planner's; what is exact for a backend are three questions the planner reads."""
from __future__ import annotations

import logging
from abc import abstractmethod
from typing import Any, Sequence

import torch

from harness.backends import planner
from harness.backends.base import Backend, Generation, count, state_nbytes
from harness.backends.generation import GenRequest, pad_batch
from harness.backends.scoring import scoring_window

log = logging.getLogger("harness")


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
        return planner.generate_all(self, requests, batch_size, prefix_reuse, prefix_memory)

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
        return scoring_window(context, continuation, self.max_context)

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
