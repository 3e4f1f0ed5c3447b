"""What every task provides to the engine: instances to prompt, and a scorer for what came back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DataError(ValueError):
    """A dataset is missing or a row is malformed; the message names the row, the field and the fix."""


@dataclass
class Instance:
    """One prompt to run: a question with its context in a fixed order, tagged with the condition (position)."""

    id: str
    position: str
    question: str
    answer: str
    paragraphs: list[dict[str, Any]]  # [{"title", "sentences", "text", "gold"}] in prompt order
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.id}@{self.position}"

    def template_vars(self) -> dict[str, Any]:
        return {"question": self.question, "paragraphs": self.paragraphs, "meta": self.meta}

    def retrieval_units(self) -> list[str]:
        """The texts the retrieval tool searches: the test context's sentences, never the exemplars'."""
        return [f"{p['title']}: {s.strip()}" for p in self.paragraphs for s in p["sentences"] if s.strip()]


def word_level_tokenizer(vocab: list[str], pad: str = "[PAD]", bos: str = "[BOS]", unk: str = "[UNK]"):
    """A whitespace-separated, one-id-per-word tokenizer for the synthetic tasks' vocabularies. Its eos is the
    pad token: "[EOS]" separates the sections of a sample and must not end generation."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token=pad, bos_token=bos, unk_token=unk,
                                   clean_up_tokenization_spaces=False)
    fast.padding_side = "left"
    return fast
