"""HotpotQA answer scoring, normalised exactly as the official ``hotpot_evaluate_v1.py`` does,
plus the answer extractor for the chain-of-thought answer phrase and a bootstrap standard error."""
from __future__ import annotations

import collections
import re
import string

import numpy as np

ANSWER_PHRASE = "So the answer is:"
_ANSWER_RE = re.compile(re.escape(ANSWER_PHRASE) + r"[ \t]*(?P<answer>[^\n]*)")
_SPECIAL = ("yes", "no", "noanswer")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, strip punctuation, drop the articles a/an/the and fold white space (official order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token F1; a yes/no/noanswer prediction or gold scores 0 unless both normalise to the same string."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
        return 0.0
    pred_toks, ref_toks = pred.split(), ref.split()
    common = collections.Counter(pred_toks) & collections.Counter(ref_toks)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_toks), same / len(ref_toks)
    return 2 * precision * recall / (precision + recall)


def contains(prediction: str, gold: str) -> float:
    """1 when the normalised gold answer occurs in the normalised prediction (lenient for verbose answers)."""
    ref = normalize_answer(gold)
    return float(bool(ref) and ref in normalize_answer(prediction))


def extract_answer(generation: str) -> tuple[str, bool]:
    """Return (answer, found). The answer is what follows the first "So the answer is:" up to the end of
    its line, minus one trailing period. Without the phrase the first non-empty line is used and found=False,
    so a model that ignores the format is still scored, and the miss is counted."""
    m = _ANSWER_RE.search(generation)
    if m:
        ans = m.group("answer").strip()
        if ans.endswith("."):
            ans = ans[:-1].rstrip()
        return ans, True
    for line in generation.splitlines():
        if line.strip():
            return line.strip(), False
    return "", False


def score(prediction: str, gold: str) -> dict[str, float]:
    return {"em": exact_match(prediction, gold), "f1": f1_score(prediction, gold), "contains": contains(prediction, gold)}


def bootstrap_se(values, n_boot: int = 1000, seed: int = 0) -> float:
    """Standard error of the mean by the percentile-free bootstrap (std of resampled means)."""
    x = np.asarray(list(values), dtype=float)
    if len(x) < 2:
        return float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    return float(x[idx].mean(axis=1).std(ddof=1))
