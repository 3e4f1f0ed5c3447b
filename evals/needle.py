"""Phonebook needle-in-a-haystack: a phone book filled to a chosen context length in tokens of the model's own
tokenizer; the question asks for the number of the entry at a chosen depth (the needle).

A sweep over ``lengths`` x ``depths`` in one run: each (length, depth) is a condition of the results table.
One sample's book is the same text at every depth (only the name asked for moves) and a shorter book is a
prefix of a longer one, so depth and length effects are not confounded with the text read, and a sweep's
prompts share everything up to the question: the prefix tree (``--prefix-reuse tree``) reads each book once.
``context_tokens`` in each sample records the book's exact token count.

    tokens (models trained here)  [BOS] n12 p3 n7 p9 ... [SEP] n7 [EOS] p9      (--length entries)
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from evals.base import Instance, OptionError, TextInstance
from evals.registry import register_task
from evals.synthetic import SPECIAL, SyntheticOptions, SyntheticTask

FIRST = ("Ada Bruno Clara Dmitri Elena Farid Greta Hugo Ines Jonas Kira Luca Mina Nils Olga Pavel Quinn Rosa Sami "
         "Tova").split()
LAST = ("Abbott Berg Costa Dahl Eriksen Fischer Garcia Holm Ito Jensen Kowal Lund Moreau Novak Okafor Petrov Quist "
        "Rossi Sato Varga").split()
INITIALS = "ABCDEFGHIJKLMNOPRSTUVW"
NUMBER = re.compile(r"\d{3}-\d{4}")
PLAIN_NAMES = 6000  # entries drawn as "First I. Last" (of 8,800) before a second initial is added
MAX_ENTRIES = 100_000  # half the names with two initials: drawing stays fast


@dataclass
class NeedleOptions(SyntheticOptions):
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024], metadata={
        "help": "phone-book lengths in tokens of the model's tokenizer (comma list)"})
    depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0], metadata={
        "help": "where the needle sits: 0 = first entry, 1 = last (comma list)"})
    samples: int = field(default=20, metadata={"help": "needles (each run at every length and depth)"})
    length: int = field(default=32, metadata={"help": "tokens format: entries per book"})
    names: int = field(default=64, metadata={"help": "tokens format: name vocabulary"})
    numbers: int = field(default=64, metadata={"help": "tokens format: number vocabulary"})

    def check(self) -> None:
        super().check()
        if not self.lengths or min(self.lengths) < 16:
            raise OptionError(f"--task-arg lengths={self.lengths}: give lengths of 16 tokens or more")
        if max(self.lengths) // 4 + 16 > MAX_ENTRIES:
            raise OptionError(f"--task-arg lengths={max(self.lengths)}: the phone book has {MAX_ENTRIES} distinct "
                              f"names, enough for {4 * (MAX_ENTRIES - 16)} tokens; give shorter lengths")
        if not self.depths or not all(0.0 <= d <= 1.0 for d in self.depths):
            raise OptionError(f"--task-arg depths={self.depths}: give depths between 0 and 1")
        if not 2 <= self.length <= self.names:
            raise OptionError("--task-arg length must be between 2 and names")


@register_task("needle")
class Needle(SyntheticTask):
    Options = NeedleOptions
    metrics = ("accuracy",)
    condition = "length@depth"
    axis_label = "context length (model tokens)"
    series_label = "needle depth (0 = start)"
    default_template = "needle"
    needs_tokenizer = True  # text contexts are measured in the model's tokens

    def max_new_tokens(self, as_tokens: bool) -> int:
        return 2 if as_tokens else 8

    def load(self) -> list[dict]:
        o = self.options
        return [{"_id": f"needle{i:04d}", "seed": f"needle-eval:{o.eval_seed}:{i}"} for i in range(o.samples)]

    # text: pretrained models -------------------------------------------------------------------------
    @staticmethod
    def _book(seed: str, count: int) -> list[tuple[str, str]]:
        """``count`` distinct (name, number) entries, the same first ones for any ``count``. The first
        ``PLAIN_NAMES`` names are "First I. Last" (8,800 exist); later ones carry a second initial (193,600
        more), so a book of any length a model can read (128k tokens: about 32,000 entries) is drawn in bounded
        time, and every book up to ``PLAIN_NAMES`` entries is what it always was."""
        rng = random.Random(seed)
        seen, out = set(), []
        while len(out) < count:
            first, initial, last = rng.choice(FIRST), rng.choice(INITIALS), rng.choice(LAST)
            name = f"{first} {initial}. {last}" if len(out) < PLAIN_NAMES else \
                f"{first} {initial}. {rng.choice(INITIALS)}. {last}"
            if name not in seen:
                seen.add(name)
                out.append((name, f"{rng.randrange(200, 1000)}-{rng.randrange(10000):04d}"))
        return out

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def instances(self, rows, *, seed=0, pool_rows=None) -> list[Instance]:
        o = self.options
        if o.format == "tokens":
            return self._token_instances(rows)
        if self.tokenizer is None:
            raise OptionError("task 'needle' measures lengths in the model's tokens; construct it with the model's "
                              "tokenizer")
        out = []
        for r in rows:
            book = self._book(r["seed"], 16 + max(o.lengths) // 4)  # >= 4 tokens per entry
            lines = [f"{name}: {number}" for name, number in book]
            per_line = [self._count(line + "\n") for line in lines]
            for length in o.lengths:
                n, total = 0, 0
                while n < len(lines) and total + per_line[n] <= length:
                    total += per_line[n]
                    n += 1
                if n == 0:
                    raise OptionError(f"--task-arg lengths={length}: a phone-book entry takes {per_line[0]} tokens "
                                      "of this tokenizer; give longer lengths")
                text = "\n".join(lines[:n])
                tokens = self._count(text)
                for depth in o.depths:
                    at = round(depth * (n - 1))
                    out.append(TextInstance(id=r["_id"], condition=f"{length}@{depth:g}", text=text,
                                            answer=book[at][1], meta={"name": book[at][0], "entries": n,
                                                                      "needle_index": at, "context_tokens": tokens}))
        return out

    def evidence(self, instance: Instance) -> list[tuple[str, str]]:
        m = instance.meta
        if "name" not in m:  # the token format: no text to mark
            return []
        return [(f"{m['name']}: {instance.answer}", f"needle: entry {m['needle_index'] + 1} of {m['entries']}")]

    @classmethod
    def axis_position(cls, condition: str, statistic=None) -> tuple[float | None, float | None]:
        """``length@depth``: the length on the x axis, one heatmap row per depth."""
        length, depth = condition.split("@", 1)
        return float(length), float(depth)

    def record_fields(self, instance: Instance) -> dict:
        return {k: instance.meta[k] for k in ("entries", "needle_index", "context_tokens") if k in instance.meta}

    # tokens: the trainer's format --------------------------------------------------------------------
    def vocabulary(self) -> list[str]:
        o = self.options
        return SPECIAL + [f"n{i}" for i in range(o.names)] + [f"p{i}" for i in range(o.numbers)]

    def draw(self, rng: random.Random, depth: float | None = None) -> tuple[list[int], list[int], int]:
        """A token-format book: distinct names, their numbers, and the needle's index (at ``depth``, else
        drawn)."""
        o = self.options
        names = rng.sample(range(o.names), o.length)
        numbers = [rng.randrange(o.numbers) for _ in names]
        at = rng.randrange(o.length) if depth is None else round(depth * (o.length - 1))
        return names, numbers, at

    def tokens(self, sample) -> tuple[list[str], list[str]]:
        names, numbers, at = sample
        body = [t for n, p in zip(names, numbers) for t in (f"n{n}", f"p{p}")]
        return ["[BOS]", *body, "[SEP]", f"n{names[at]}", "[EOS]"], [f"p{numbers[at]}"]

    def max_tokens(self) -> int:
        return 2 * self.options.length + 6

    def heldout_sequences(self, rows: list[dict]) -> list[list[str]]:
        return [ins.text.split() + [ins.answer] for ins in self._token_instances(rows)]

    def _token_instances(self, rows) -> list[TextInstance]:
        out = []
        for r in rows:
            for depth in self.options.depths:
                prompt, answer = self.tokens(self.draw(random.Random(r["seed"]), depth))
                out.append(TextInstance(id=r["_id"], condition=f"{self.options.length}@{depth:g}",
                                        text=" ".join(prompt), answer=answer[0]))
        return out

    def score(self, instance: Instance, generation: str, answer_phrase: str | None = None) -> dict:
        if self.options.format == "tokens":
            words = generation.split()
            pred = words[0] if words else ""
        else:
            m = NUMBER.search(generation)
            pred = m.group(0) if m else ""
        return {"prediction": pred, "answer_found": bool(pred), "accuracy": float(pred == instance.answer)}
