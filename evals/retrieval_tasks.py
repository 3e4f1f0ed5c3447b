"""The paper's four in-context retrieval tasks, as training streams and as eval-engine tasks.

    index             the sequence, then a position i            → the token at position i
    associative recall key-value pairs, then a key                → its value
    c-gram retrieval  the sequence, then c-1 consecutive tokens   → the token that followed them
    counting          the sequence, then a token                  → how many times it occurs

One generator draws each sample; it is written either as tokens for the small trained models
(``[BOS] a3 a7 … [SEP] query [EOS] answer``, ``format=tokens``) or as English for pretrained LMs
(``format=text``: words from a fixed list, a question, k-shot exemplars of the same kind), so
``python -m harness.eval --model phi-1.5 --task ar`` and a checkpoint trained with ``--task ar`` run through
the same engine and scorer.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from evals.base import OptionError
from evals.registry import register_task
from evals.synthetic import SPECIAL, SyntheticOptions, SyntheticTask

WORDS = ("apple river stone cloud tiger lamp paper honey violin garden rocket bridge candle mirror forest "
         "pencil window dragon silver meadow castle button orange planet ladder kettle harbor feather").split()


@dataclass
class Draw:
    seq: list[int]  # symbol indices (for ar: k1 v1 k2 v2 ...)
    query: list[int]  # symbol indices, or [position] for index
    answer: int  # symbol index, position-free count, ...


@dataclass
class RetrievalOptions(SyntheticOptions):
    length: int = field(default=32, metadata={"help": "symbols per sequence (a comma list sweeps it)",
                                              "sweep": True})
    symbols: int = field(default=16, metadata={"help": "alphabet size"})
    c: int = field(default=3, metadata={"help": "c-gram length (cgram)"})
    shots: int = field(default=2, metadata={"help": "exemplars (text format)"})
    samples: int = field(default=500, metadata={"help": "held-out samples"})

    def check(self) -> None:
        super().check()
        if self.symbols > len(WORDS) and self.format == "text":
            raise OptionError(f"--task-arg symbols={self.symbols}: format=text has {len(WORDS)} words")
        if self.length < 2:
            raise OptionError("--task-arg length must be >= 2")


class RetrievalTask(SyntheticTask):
    """What the four tasks share: ``length`` symbols over an alphabet of ``symbols``, one query, one answer.
    A subclass draws its sample and says its question."""

    Options = RetrievalOptions
    metrics = ("accuracy",)
    default_template = "retrieval_tasks"
    condition = "length"

    def __init__(self, data=None, split=None, **options):
        super().__init__(data, split, **options)
        o = self.options
        self.length, self.symbols, self.c = o.length, o.symbols, o.c

    def eval_namespace(self) -> str:
        o = self.options
        return f"retrieval-eval:{self.name}:{o.length}:{o.symbols}:{o.eval_seed}"

    def condition_value(self) -> str:
        return f"L={self.length}"

    def random_sequence(self, rng: random.Random) -> list[int]:
        return [rng.randrange(self.symbols) for _ in range(self.length)]

    # -- tokens -----------------------------------------------------------------------------------------
    def vocabulary(self) -> list[str]:
        return SPECIAL + [f"a{i}" for i in range(self.symbols)] + [str(i) for i in range(self.length + 1)]

    def query_tokens(self, d: Draw) -> list[str]:
        return [f"a{i}" for i in d.query]

    def answer_word(self, d: Draw, word) -> str:
        """The answer, written with ``word`` (a symbol's token or English word)."""
        return word(d.answer)

    def tokens(self, d: Draw) -> tuple[list[str], list[str]]:
        seq = [f"a{i}" for i in d.seq]
        return ["[BOS]", *seq, "[SEP]", *self.query_tokens(d), "[EOS]"], [self.answer_word(d, lambda i: f"a{i}")]

    def max_tokens(self) -> int:
        return 2 * self.length + 6

    # -- text -------------------------------------------------------------------------------------------
    def question(self, d: Draw) -> str:
        """The question about the sequence, in English."""
        raise NotImplementedError

    def text(self, d: Draw) -> tuple[str, str]:
        words = " ".join(WORDS[i] for i in d.seq)
        return f"Words: {words}\nQuestion: {self.question(d)}\nAnswer:", self.answer_word(d, WORDS.__getitem__)

    def score(self, instance, generation: str, answer_phrase: str | None = None) -> dict:
        words = generation.replace(".", " ").split()
        pred = words[0] if words else ""
        return {"prediction": pred, "answer_found": bool(words), "accuracy": float(pred == instance.answer)}


@register_task("index")
class Index(RetrievalTask):
    """The sequence, then a position i → the token at position i."""

    def draw(self, rng: random.Random) -> Draw:
        seq = self.random_sequence(rng)
        i = rng.randrange(self.length)
        return Draw(seq, [i], seq[i])

    def query_tokens(self, d: Draw) -> list[str]:
        return [str(d.query[0])]

    def question(self, d: Draw) -> str:
        return f"What is word number {d.query[0] + 1}?"


@register_task("ar")
class AssociativeRecall(RetrievalTask):
    """Key-value pairs, then a key → its value."""

    def draw(self, rng: random.Random) -> Draw:
        keys = rng.sample(range(self.symbols), min(self.symbols, self.length // 2))
        pairs = [(key, rng.randrange(self.symbols)) for key in keys]
        j = rng.randrange(len(pairs))
        return Draw([t for p in pairs for t in p], [pairs[j][0]], pairs[j][1])

    def text(self, d: Draw) -> tuple[str, str]:
        w = WORDS.__getitem__
        pairs = ", ".join(f"{w(d.seq[i])}: {w(d.seq[i + 1])}" for i in range(0, len(d.seq), 2))
        return f"Pairs: {pairs}\nQuestion: What goes with {w(d.query[0])}?\nAnswer:", w(d.answer)


@register_task("cgram")
class CGram(RetrievalTask):
    """The sequence, then c-1 consecutive tokens → the token that followed them."""

    def draw(self, rng: random.Random) -> Draw:
        n, c = self.length, self.c
        while True:
            seq = self.random_sequence(rng)
            starts = list(range(n - c + 1))
            rng.shuffle(starts)
            for s in starts:
                gram = seq[s:s + c - 1]
                hits = [t for t in range(n - c + 2) if seq[t:t + c - 1] == gram]
                if hits == [s]:  # the (c-1)-gram occurs once, so its next token is well defined
                    return Draw(seq, gram, seq[s + c - 1])

    def question(self, d: Draw) -> str:
        return f"Which word comes right after \"{' '.join(WORDS[i] for i in d.query)}\"?"


@register_task("counting")
class Counting(RetrievalTask):
    """The sequence, then a token → how many times it occurs."""

    def draw(self, rng: random.Random) -> Draw:
        seq = self.random_sequence(rng)
        x = rng.choice(seq)
        return Draw(seq, [x], seq.count(x))

    def answer_word(self, d: Draw, word) -> str:
        return str(d.answer)

    def question(self, d: Draw) -> str:
        return f"How many times does \"{WORDS[d.query[0]]}\" occur?"


RETRIEVAL_TASKS = {cls.name: cls for cls in (Index, AssociativeRecall, CGram, Counting)}
TASK_NAMES = tuple(RETRIEVAL_TASKS)
