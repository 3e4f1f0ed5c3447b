"""Multi-query associative recall (MQAR, as in zoology): key-value pairs, then several keys; the model must
recall each key's value, in order. The state a recurrent model carries must hold every pair at once.

    tokens (models trained here)  [BOS] k3 v7 k1 v2 ... [SEP] k1 k3 [EOS] v2 v7
    text (pretrained LMs)         Codes: QZRT 42, BDXA 17, ...
                                  Recall: BDXA QZRT
                                  Answer: 17 42

Results are grouped by the number of pairs; ``accuracy`` is the share of queries recalled, ``all_correct``
the share of samples with every query right."""
from __future__ import annotations

import random
import string
from dataclasses import dataclass, field

from evals.base import OptionError
from evals.registry import register_task
from evals.synthetic import SPECIAL, SyntheticOptions, SyntheticTask


@dataclass
class MQAROptions(SyntheticOptions):
    pairs: int = field(default=16, metadata={"help": "key-value pairs per sample (a comma list sweeps it)",
                                             "sweep": True})
    queries: int = field(default=4, metadata={"help": "keys asked per sample"})
    keys: int = field(default=64, metadata={"help": "key vocabulary size"})
    values: int = field(default=64, metadata={"help": "value vocabulary size"})
    shots: int = field(default=2, metadata={"help": "exemplars (text format)"})
    length: int | None = field(default=None, metadata={"help": "the trainer's --length: sets pairs"})

    def check(self) -> None:
        super().check()
        if self.length is not None:  # resolved into pairs: a run records (and a report labels) pairs alone
            self.pairs, self.length = self.length, None
        if not 1 <= self.queries <= self.pairs <= self.keys:
            raise OptionError(f"--task-arg: need 1 <= queries ({self.queries}) <= pairs ({self.pairs}) <= keys "
                              f"({self.keys})")
        if self.values < 2:
            raise OptionError("--task-arg values must be >= 2")


@register_task("mqar")
class MQAR(SyntheticTask):
    Options = MQAROptions
    metrics = ("accuracy", "all_correct")
    binary_metrics = ("all_correct",)  # accuracy: the share of a row's queries answered
    condition = "pairs"
    default_template = "mqar"

    @classmethod
    def check_given(cls, given: dict) -> None:
        if given.get("length") is not None and given.get("pairs") is not None \
                and str(given["length"]) != str(given["pairs"]):
            raise OptionError(f"--task-arg length={given['length']} and pairs={given['pairs']} disagree (length is "
                              "the trainer's name for pairs); give one")

    def __init__(self, data=None, split=None, **options):
        super().__init__(data, split, **options)
        names = random.Random(f"mqar-keys:{self.options.keys}")
        self.key_names = sorted({"".join(names.choices(string.ascii_uppercase, k=4))
                                 for _ in range(4 * self.options.keys)})[:self.options.keys]

    def max_new_tokens(self, as_tokens: bool) -> int:
        return self.options.queries + 1 if as_tokens else 4 * self.options.queries + 4

    def eval_namespace(self) -> str:
        o = self.options
        return f"mqar-eval:{o.pairs}:{o.queries}:{o.keys}:{o.values}:{o.eval_seed}"

    def draw(self, rng: random.Random) -> tuple[list[tuple[int, int]], list[int]]:
        """(key, value) pairs and the indices of the pairs asked, in the order asked."""
        o = self.options
        keys = rng.sample(range(o.keys), o.pairs)
        pairs = [(k, rng.randrange(o.values)) for k in keys]
        return pairs, rng.sample(range(o.pairs), o.queries)

    # tokens: the trainer's format --------------------------------------------------------------------
    def vocabulary(self) -> list[str]:
        return SPECIAL + [f"k{i}" for i in range(self.options.keys)] + [f"v{i}" for i in range(self.options.values)]

    def tokens(self, sample) -> tuple[list[str], list[str]]:
        pairs, asked = sample
        body = [t for k, v in pairs for t in (f"k{k}", f"v{v}")]
        return ["[BOS]", *body, "[SEP]", *[f"k{pairs[i][0]}" for i in asked], "[EOS]"], \
            [f"v{pairs[i][1]}" for i in asked]

    def max_tokens(self) -> int:
        return 2 * self.options.pairs + 2 * self.options.queries + 4

    # text: pretrained models -------------------------------------------------------------------------
    def text(self, sample) -> tuple[str, str]:
        pairs, asked = sample
        codes = ", ".join(f"{self.key_names[k]} {v}" for k, v in pairs)
        return (f"Codes: {codes}\nRecall: {' '.join(self.key_names[pairs[i][0]] for i in asked)}\nAnswer:",
                " ".join(str(pairs[i][1]) for i in asked))

    def evidence(self, instance) -> list[tuple[str, str]]:
        """Each queried key with its value, where the codes list it (the text format; the token format has none)."""
        text = getattr(instance, "text", "")
        if not text.startswith("Codes: ") or "\nRecall: " not in text:
            return []
        asked = text.split("\nRecall: ", 1)[1].split("\n", 1)[0].split()
        return [(f"{key} {value}", f"queried key {i} of {len(asked)}: {key}")
                for i, (key, value) in enumerate(zip(asked, instance.answer.split()), 1)]

    def score(self, instance, generation: str, answer_phrase: str | None = None) -> dict:
        gold = instance.answer.split()
        said = generation.replace(",", " ").split()[:len(gold)]
        hits = sum(a == b for a, b in zip(said, gold))
        return {"prediction": " ".join(said), "answer_found": bool(said), "accuracy": hits / len(gold),
                "all_correct": float(hits == len(gold))}
