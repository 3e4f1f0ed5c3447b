"""Scoring a continuation (``loglikelihood``): what every backend feeds (``scoring_window``, decided once so
backends agree), and the scorer of the backends the harness steps itself, over their ``StepModel`` methods."""
from __future__ import annotations

from typing import Sequence

import torch

from harness.backends.base import ScoresBlocks, StepModel, count
from harness.backends.generation import pad_batch


def scoring_window(context: Sequence[int], continuation: Sequence[int], max_tokens: int | None) -> list[int]:
    """The tokens fed to score ``continuation`` after ``context``: both joined, less the last token (it is only
    predicted), keeping the last ``max_tokens`` where the row is longer than the model can see."""
    if not continuation:
        raise ValueError("loglikelihood: an empty continuation has nothing to score")
    if not context:
        raise ValueError("loglikelihood: the first token has no context to be predicted from; start the "
                         "context with a BOS/EOS token")
    seq = [*context, *continuation][:-1]
    if max_tokens and len(seq) > max_tokens:
        if len(continuation) > max_tokens:
            raise ValueError(f"loglikelihood: a continuation of {len(continuation)} tokens does not fit the "
                             f"model's {max_tokens}-token context")
        seq = seq[-max_tokens:]
    return seq


@torch.inference_mode()
def loglikelihood(backend: StepModel, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8,
                  share_contexts: bool = True) -> list[tuple[float, bool]]:
    """For each (context ids, continuation ids): the continuation's summed log-probability after the context,
    and whether greedy decoding would have produced it token for token, through a step backend's
    ``sequence_logits`` (and ``block_logits``).

    Continuations that share a context (a multiple-choice question's choices) are scored after one prefill of
    it where a block after a copied state is exact (``block_logits``). Every other row is padded on the right,
    after its last token, where no causal model (attention, convolution or recurrence) can carry padding back
    into a row's earlier positions: every family batches exactly here, with no mask and no state surgery.
    Longest rows first, so a batch holds similar lengths; results in the input order. A row longer than the
    model's context keeps its last ``max_context`` tokens. ``share_contexts=False`` scores every row on its
    own (the reference the shared path is checked and benchmarked against)."""
    out: list[tuple[float, bool] | None] = [None] * len(pairs)
    rest = _score_shared_contexts(backend, pairs, out, batch_size) if share_contexts else range(len(pairs))
    order = sorted(rest, key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    pad = getattr(backend.tokenizer, "pad_token_id", None) or 0
    for start in range(0, len(order), max(1, batch_size)):
        rows = order[start:start + max(1, batch_size)]
        inputs = [scoring_window(*pairs[i], backend.max_context) for i in rows]
        ids, _ = pad_batch(inputs, pad, backend.device, side="right")
        logits = backend.sequence_logits(ids)
        for r, i in enumerate(rows):
            n = len(inputs[r])
            out[i] = _score(logits[r, n - len(pairs[i][1]):n], pairs[i][1])  # the positions predicting it
    return out  # type: ignore[return-value]


def _score_shared_contexts(backend: StepModel, pairs, out: list, batch_size: int) -> list[int]:
    """Score the pairs whose context another pair shares, one prefill per context; the indices left over."""
    if not backend.prefix_exact() or not isinstance(backend, ScoresBlocks):
        return list(range(len(pairs)))
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(pairs):
        groups.setdefault(tuple(ctx), []).append(i)
    pad = getattr(backend.tokenizer, "pad_token_id", None) or 0
    rest = []
    for ctx, members in groups.items():
        fits = not backend.max_context or len(ctx) + max(len(pairs[i][1]) for i in members) - 1 <= backend.max_context
        if len(members) < 2 or not fits:
            rest += members
            continue
        scoring_window(list(ctx), pairs[members[0]][1], backend.max_context)  # the checks of a row scored alone
        t = torch.tensor([list(ctx)], device=backend.device)
        first, state = backend.prefill(t, torch.ones_like(t))  # logits predicting each continuation's first token
        count(backend, "loglikelihood_shared_rows", len(members))
        for start in range(0, len(members), max(1, batch_size)):
            rows = members[start:start + max(1, batch_size)]
            conts = [list(pairs[i][1]) for i in rows]
            if max(map(len, conts)) == 1:
                for i in rows:
                    out[i] = _score(first[0][None], pairs[i][1])
                continue
            block, mask = pad_batch([c[:-1] or [pad] for c in conts], pad, backend.device, side="right")
            mask = torch.cat([mask.new_ones(len(rows), len(ctx)), mask], 1)
            logits = backend.block_logits(backend.expand(state, len(rows)), block, mask)
            for r, i in enumerate(rows):
                out[i] = _score(torch.cat([first[0][None], logits[r, :len(conts[r]) - 1].float()]), conts[r])
    return rest


def _score(logits: torch.Tensor, continuation: Sequence[int]) -> tuple[float, bool]:
    """Summed log-probability of ``continuation`` under the logits at the positions predicting it, and whether
    each of its tokens is the argmax."""
    cont = torch.tensor(list(continuation), device=logits.device)
    lp = logits.float().log_softmax(-1)
    return float(lp.gather(1, cont[:, None]).sum()), bool((lp.argmax(-1) == cont).all())
