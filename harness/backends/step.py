"""The step-level backend contract: a model the harness steps itself (prefill, step, select, expand, merge,
extend). Its ``generate_all`` is the planner's; what is exact for a backend are three questions the planner reads."""
from __future__ import annotations

import logging
from abc import abstractmethod
from typing import Any, Sequence

import torch

from harness.backends import memory, planner, scoring
from harness.backends.base import Backend, Generation
from harness.backends.generation import GenRequest

log = logging.getLogger("harness")


class StepBackend(Backend):
    """A model the harness steps itself: prefill a batch, feed blocks, drop, copy and merge rows. Batching,
    prefix reuse and the prefix tree are chosen for it in one place (``harness.backends.planner``); the decode
    loop (stop strings, tools, limits) is ``greedy_generate``'s."""

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

    def merge(self, states: Sequence[Any], lengths: Sequence[int]) -> Any:
        """One batch state from one-row, unpadded states of ``lengths`` tokens each (prompts prefilled through
        the prefix tree): attention keys and values left-padded to the longest (the mask hides the pads),
        recurrent state stacked. Optional: only the prefix tree needs it."""
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

    def scores_blocks(self) -> bool:
        """Whether ``block_logits`` is implemented: continuations sharing a context are scored after one prefill."""
        return type(self).block_logits is not StepBackend.block_logits

    def loglikelihood(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8,
                      share_contexts: bool = True) -> list[tuple[float, bool]]:
        """``harness.backends.scoring.loglikelihood`` over this backend's methods."""
        return scoring.loglikelihood(self, pairs, batch_size, share_contexts)

    # -- memory (``harness.backends.memory`` measures it) ------------------------------------------------------
    def state_bytes(self, tokens: int) -> int | None:
        return memory.state_bytes(self, tokens)

    def token_budget(self) -> int:
        return memory.token_budget(self)

    def prefill_bytes_per_token(self) -> int:
        return memory.prefill_bytes_per_token(self)

    def bytes_per_token(self) -> int:
        """Memory one cached token costs while decoding; a conservative default (backends say theirs)."""
        return 1 << 20
