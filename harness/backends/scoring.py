"""What every backend feeds to score a continuation (``loglikelihood``), decided once so backends agree."""
from __future__ import annotations

from typing import Sequence


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
