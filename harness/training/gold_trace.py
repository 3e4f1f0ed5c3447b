"""A model that writes the gold trace: a retrieval cell's live evaluation timed before anything is trained.

A live evaluation's cost is set by how long a trained model writes and how often it calls the tool, which an
untrained model does not show (a fresh 0.5M Mamba at n = 64 wrote to the 3,840-token limit and never called on a
CPU; ~1,500 tokens and ~190 calls on an H100). ``GoldTrace`` runs a fresh model's real forward passes (its
batch, cache and state, the engine's decode loop, the tool) with each row's choice set to the next token of its
sample's gold trace: the lengths and calls of a model that has learned the task. The tool still answers every
search, so a sample ends with its right verdict only if every answer was the gold one."""
from __future__ import annotations

from typing import Sequence

import torch

from harness.backends.base import BackendInfo, JoinsBatches, join_refusal
from harness.backends.step import StepBackend


def gold_continuations(task, tokenizer) -> dict[tuple[int, ...], list[int]]:
    """Each held-out sample's prompt ids -> the ids of what a model that solves it writes (trace, verdict), from
    a synthetic task's held-out set as the engine draws it."""
    rows = task.load()
    out = {}
    for instance, sequence in zip(task.instances(rows), task.heldout_sequences(rows)):
        prompt = instance.text.split()
        if sequence[:len(prompt)] != prompt:
            raise ValueError(f"sample {instance.id}: its held-out sequence does not start with its prompt")
        written = tokenizer(" ".join(sequence[len(prompt):]), add_special_tokens=False)["input_ids"]
        out[tuple(tokenizer(instance.text)["input_ids"])] = written  # the prompt's ids as the engine makes them
    return out


class GoldTrace(StepBackend, JoinsBatches):
    """``inner``'s forward passes (``None``: none at all, the decode loop's own cost), every row choosing the next
    token of its gold continuation. ``blocks_whole``: the decode loop is told the model takes every block in one
    call (how it fed a step's tool results to a recurrent model before it fed them one token a step)."""

    name = "gold-trace"

    def __init__(self, inner: StepBackend | None, continuations: dict[tuple[int, ...], list[int]], tokenizer=None,
                 blocks_whole: bool = False):
        self.inner, self.continuations, self.blocks_whole = inner, continuations, blocks_whole
        self.tokenizer = tokenizer if inner is None else inner.tokenizer
        self.device = torch.device("cpu") if inner is None else inner.device
        self.max_context = None if inner is None else inner.max_context

    def describe(self) -> BackendInfo:
        info = self.inner.describe() if self.inner else BackendInfo(backend=self.name, device="cpu", dtype="none")
        return BackendInfo(**{**info.__dict__, "backend": f"{info.backend} writing gold traces"})

    def token_budget(self) -> int:
        return self.inner.token_budget() if self.inner else 1 << 30

    def batches_exact(self) -> bool:
        return self.inner is None or self.inner.batches_exact()

    def prefix_exact(self) -> bool:
        return False

    def feeds_token_by_token(self, widths: Sequence[int]) -> bool:
        return not self.blocks_whole and (self.inner is None or self.inner.feeds_token_by_token(widths))

    def _choose(self, logits, rows: list[tuple[list[int] | None, int]]) -> torch.Tensor:
        """A row with no gold trace (a prompt of the engine's memory probe) keeps the model's own logits."""
        eos = self.tokenizer.eos_token_id
        gold = [b for b, (continuation, _) in enumerate(rows) if continuation is not None]
        chosen = [rows[b][0][rows[b][1]] if rows[b][1] < len(rows[b][0]) else eos for b in gold]
        out = logits.clone() if logits is not None else torch.full((len(rows), len(self.tokenizer)), -1e4)
        out = out.to(self.device)
        out[gold] = -1e4
        out[gold, chosen] = 0.0  # one indexed write a step, not one a row (this runs inside the timed loop)
        return out

    def prefill(self, input_ids, attention_mask):
        rows = [(self.continuations.get(tuple(t for t, m in zip(ids, mask) if m)), 0)
                for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())]
        logits, state = self.inner.prefill(input_ids, attention_mask) if self.inner else (None, None)
        return self._choose(logits, rows), (state, rows)

    def step(self, state, input_ids, attention_mask):
        inner, rows = state
        logits = self.inner.step(inner, input_ids, attention_mask) if self.inner else None
        fed = attention_mask[:, -input_ids.shape[1]:].sum(1).tolist()
        rows[:] = [(continuation, done + n) for (continuation, done), n in zip(rows, fed)]
        return self._choose(logits, rows)

    def select(self, state, keep):
        inner, rows = state
        return (self.inner.select(inner, keep) if self.inner else None), [rows[k] for k in keep.tolist()]

    def join_unsupported(self) -> str | None:
        return join_refusal(self.inner) if self.inner is not None else None

    def key_share(self) -> float:
        return self.inner.key_share() if self.inner is not None else 0.0

    def join(self, states, cuts):
        inner = self.inner.join([s[0] for s in states], cuts) if self.inner else None
        return inner, [row for s in states for row in s[1]]

    def expand(self, state, n):
        raise NotImplementedError("a gold trace is written per sample; no prefix is shared (prefix reuse: none)")
