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
