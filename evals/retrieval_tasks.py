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

from evals.base import Instance, OptionError, SyntheticOptions, Task
from evals.registry import register_task

TASK_NAMES = ("index", "ar", "cgram", "counting")
SPECIAL = ["[PAD]", "[BOS]", "[EOS]", "[SEP]", "[UNK]"]
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


class RetrievalTask(Task):
    """One of TASK_NAMES (its registered ``name``); ``length`` symbols per sequence over an alphabet of ``symbols``."""

    Options = RetrievalOptions
    metrics = ("accuracy",)
    default_template = "retrieval_tasks"
    condition = "length"

    def __init__(self, data=None, split=None, **options):
        super().__init__(data, split, **options)
        o = self.options
        self.length, self.symbols, self.c = o.length, o.symbols, o.c
        self.format, self.shots, self.samples, self.eval_seed = o.format, o.shots, o.samples, o.eval_seed
        self.stop = ["\n"] if o.format == "text" else ["[PAD]"]
        self.default_max_new_tokens = 4 if o.format == "text" else 2

    # ------------------------------------------------------------------------------------ drawing
    def draw(self, rng: random.Random) -> Draw:
        n, k = self.length, self.symbols
        if self.name == "index":
            seq = [rng.randrange(k) for _ in range(n)]
            i = rng.randrange(n)
            return Draw(seq, [i], seq[i])
        if self.name == "ar":
            keys = rng.sample(range(k), min(k, n // 2))
            pairs = [(key, rng.randrange(k)) for key in keys]
            j = rng.randrange(len(pairs))
            return Draw([t for p in pairs for t in p], [pairs[j][0]], pairs[j][1])
        if self.name == "cgram":
            while True:
                seq = [rng.randrange(k) for _ in range(n)]
                starts = list(range(n - self.c + 1))
                rng.shuffle(starts)
                for s in starts:
                    gram = seq[s:s + self.c - 1]
                    hits = [t for t in range(n - self.c + 2) if seq[t:t + self.c - 1] == gram]
                    if hits == [s]:  # the (c-1)-gram occurs once, so its next token is well defined
                        return Draw(seq, gram, seq[s + self.c - 1])
        seq = [rng.randrange(k) for _ in range(n)]
        x = rng.choice(seq)
        return Draw(seq, [x], seq.count(x))

    # ------------------------------------------------------------------------------------ tokens
    def vocabulary(self) -> list[str]:
        return SPECIAL + [f"a{i}" for i in range(self.symbols)] + [str(i) for i in range(self.length + 1)]

    def tokens(self, d: Draw) -> tuple[list[str], str]:
        sym = lambda i: f"a{i}"  # noqa: E731
        seq = [sym(i) for i in d.seq]
        query = [str(d.query[0])] if self.name == "index" else [sym(i) for i in d.query]
        answer = str(d.answer) if self.name == "counting" else sym(d.answer)
        return ["[BOS]", *seq, "[SEP]", *query, "[EOS]"], answer

    def max_tokens(self) -> int:
        return 2 * self.length + 6

    def stream(self, seed: int):
        rng = random.Random(seed)
        while True:
            prompt, answer = self.tokens(self.draw(rng))
            yield prompt + [answer]

    # -------------------------------------------------------------------------------------- text
    def text(self, d: Draw) -> tuple[str, str]:
        w = lambda i: WORDS[i]  # noqa: E731
        if self.name == "ar":
            pairs = ", ".join(f"{w(d.seq[i])}: {w(d.seq[i + 1])}" for i in range(0, len(d.seq), 2))
            return f"Pairs: {pairs}\nQuestion: What goes with {w(d.query[0])}?\nAnswer:", w(d.answer)
        words = " ".join(w(i) for i in d.seq)
        if self.name == "index":
            q = f"What is word number {d.query[0] + 1}?"
        elif self.name == "cgram":
            q = f"Which word comes right after \"{' '.join(w(i) for i in d.query)}\"?"
        else:
            q = f"How many times does \"{w(d.query[0])}\" occur?"
        answer = str(d.answer) if self.name == "counting" else w(d.answer)
        return f"Words: {words}\nQuestion: {q}\nAnswer:", answer

    # ------------------------------------------------------------------------------- engine task
    def load(self) -> list[dict]:
        rng = random.Random(f"retrieval-eval:{self.name}:{self.length}:{self.symbols}:{self.eval_seed}")
        rows = []
        for i in range(self.samples):
            d = self.draw(rng)
            shots = [self.text(self.draw(rng)) for _ in range(self.shots)] if self.format == "text" else []
            prompt, answer = self.text(d) if self.format == "text" else (" ".join(self.tokens(d)[0]), self.tokens(d)[1])
            rows.append({"_id": f"{self.name}{i:05d}", "prompt": prompt, "answer": answer,
                         "shots": [{"prompt": p, "answer": a} for p, a in shots]})
        return rows

    def instances(self, rows, *, seed=0, pool_rows=None) -> list[Instance]:
        return [Instance(id=r["_id"], condition=f"L={self.length}", question=r["prompt"], answer=r["answer"],
                         meta={"shots": r["shots"]}) for r in rows]

    def score(self, instance: Instance, generation: str, answer_phrase: str | None = None) -> dict:
        words = generation.replace(".", " ").split()
        pred = words[0] if words else ""
        return {"prediction": pred, "answer_found": bool(words), "accuracy": float(pred == instance.answer)}


# One registered task per kind: --task index, ar, cgram, counting.
RETRIEVAL_TASKS = {name: register_task(name)(type(f"RetrievalTask[{name}]", (RetrievalTask,), {}))
                   for name in TASK_NAMES}
