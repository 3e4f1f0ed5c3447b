"""The base of every generated task (MQAR, needle, the four retrieval tasks, IsTree): one sample drawn from a
seeded stream serves both the small models trained here (``format=tokens``) and pretrained LMs
(``format=text``), so a trained checkpoint and a hub model run through the same engine and scorer.

The token format every synthetic task writes (``[BOS] context [SEP] query [EOS] answer``; IsTree puts its
trace between ``[EOS]`` and the verdict) and what the trainer learns from it (``loss_mask``) are defined here,
once. A task subclass draws samples and writes them; the trainer asks nothing else of it (``training_options``,
``vocabulary``, ``stream``, ``training_max_len``, ``heldout_sequences``)."""
from __future__ import annotations

import random
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator

from evals.base import Instance, OptionError, Task, TextInstance

PAD, BOS, EOS, SEP, UNK = "[PAD]", "[BOS]", "[EOS]", "[SEP]", "[UNK]"
SPECIAL = [PAD, BOS, EOS, SEP, UNK]
TOOL_RESULT_END = "[ENDSEARCH]"  # a retrieval call's closing token: the result after it is given, not learned


def loss_mask(tokens: list[str]) -> list[int]:
    """1 where a token is a training target: after the first [EOS], not a tool result, not padding."""
    mask, seen_eos, after_end = [], False, False
    for t in tokens:
        mask.append(int(seen_eos and not after_end and t != PAD))
        after_end = t == TOOL_RESULT_END
        seen_eos = seen_eos or t == EOS
    return mask


@dataclass
class SyntheticOptions:
    """Options every generated task shares: the format its samples are written in, and its held-out set."""

    format: str = field(default="text", metadata={"help": "text (pretrained LMs) or tokens (models trained here)"})
    samples: int = field(default=200, metadata={"help": "held-out samples"})
    eval_seed: int = field(default=0, metadata={"help": "which held-out set"})

    def check(self) -> None:
        if self.format not in ("text", "tokens"):
            raise OptionError("--task-arg format: 'text' (pretrained LMs) or 'tokens' (models trained here)")
        if self.samples < 1:
            raise OptionError(f"--task-arg samples={self.samples}: use 1 or more")


class SyntheticTask(Task):
    """A generated task. Subclasses implement ``draw`` (one sample from an rng), ``tokens`` and ``text`` (that
    sample written for a trained model or a pretrained LM), ``vocabulary``, ``max_tokens`` and ``score``;
    held-out rows, instances, the token stream and the trainer's protocol follow from those."""

    Options = SyntheticOptions

    def __init__(self, data: str | None = None, split: str | None = None, **options):
        super().__init__(data, split, **options)
        as_tokens = getattr(self.options, "format", "tokens") == "tokens"
        self.stop = [PAD] if as_tokens else ["\n"]
        self.default_max_new_tokens = self.max_new_tokens(as_tokens)

    def max_new_tokens(self, as_tokens: bool) -> int:
        """The generation budget: one answer token (and its stop), or a few words of text."""
        return 2 if as_tokens else 4

    # -- one sample ---------------------------------------------------------------------------------------
    @abstractmethod
    def draw(self, rng: random.Random) -> Any:
        """One sample's content, drawn from ``rng`` (the same draws in training and in the held-out set)."""

    @abstractmethod
    def tokens(self, sample) -> tuple[list[str], list[str]]:
        """The sample as the trained models see it: prompt tokens, answer tokens."""

    def text(self, sample) -> tuple[str, str]:
        """The sample in English for pretrained LMs: prompt, answer."""
        raise OptionError(f"task {self.name!r} has no text format; use --task-arg format=tokens")

    @abstractmethod
    def vocabulary(self) -> list[str]:
        """Every token of the token format (the trained model's vocabulary, specials first)."""

    @abstractmethod
    def max_tokens(self) -> int:
        """The longest token-format sequence, prompt and answer."""

    # -- the held-out set, as the engine runs it --------------------------------------------------------
    def eval_namespace(self) -> str:
        """The held-out rng's seed: every option that changes a sample, so no two sets share a sequence."""
        return f"{self.name}-eval:{self.options}"

    def condition_value(self) -> str:
        """This task's condition (e.g. ``L=32``): one value, since a sweep is one task per value."""
        return f"{self.condition}={getattr(self.options, self.condition)}"

    def load(self) -> list[dict]:
        o = self.options
        rng = random.Random(self.eval_namespace())
        as_text = getattr(o, "format", "tokens") == "text"
        rows = []
        for i in range(o.samples):
            sample = self.draw(rng)
            shots = [self.text(self.draw(rng)) for _ in range(getattr(o, "shots", 0))] if as_text else []
            if as_text:
                prompt, answer = self.text(sample)
            else:
                p, a = self.tokens(sample)
                prompt, answer = " ".join(p), " ".join(a)
            rows.append({"_id": f"{self.name}{i:05d}", "prompt": prompt, "answer": answer,
                         "shots": [{"prompt": p, "answer": a} for p, a in shots]})
        return rows

    def instances(self, rows, *, seed=0, pool_rows=None) -> list[Instance]:
        return [TextInstance(id=r["_id"], condition=self.condition_value(), text=r["prompt"], answer=r["answer"],
                             meta={"shots": r["shots"]}) for r in rows]

    # -- the trainer's protocol ---------------------------------------------------------------------------
    @classmethod
    def training_options(cls, cfg) -> dict:
        """The task options a training run's flags (a ``TrainConfig``: ``--length``, ``--task-arg``) select."""
        return {"length": cfg.length, "format": "tokens", **cfg.task_args}

    @classmethod
    def training_tag(cls, cfg) -> str:
        """The task's part of a training run's name."""
        return f"{cls.name}-L{cfg.length}"

    def stream(self, seed: int) -> Iterator[list[str]]:
        """Fresh token-format samples forever (prompt and answer, one sequence each)."""
        rng = random.Random(seed)
        while True:
            prompt, answer = self.tokens(self.draw(rng))
            yield prompt + answer

    def training_max_len(self) -> int:
        """The longest training sequence, with room for a trailing pad (the model's position budget)."""
        return self.max_tokens() + 2

    def heldout_sequences(self, rows: list[dict]) -> list[list[str]]:
        """Held-out rows as whole training sequences: what teacher-forced exact match is computed on."""
        return [r["prompt"].split() + r["answer"].split() for r in rows]
