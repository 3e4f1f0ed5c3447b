"""HotpotQA answer scoring, normalised exactly as the official ``hotpot_evaluate_v1.py`` does,
plus the answer extractor for the chain-of-thought answer phrase."""
from __future__ import annotations

import collections
import re
import string

ANSWER_PHRASE = "So the answer is:"
_SPECIAL = ("yes", "no", "noanswer")
_PUNCT = frozenset(string.punctuation)
# Words whose period never ends the answer ("St. Louis", "Dr. No"); initialisms (U.S., D.C., J. R. R.) are
# recognised by shape. Written by hand: sentence splitters (nltk, spaCy) are heavy and disagree on exactly these.
_TITLES = frozenset("st mt ft mr mrs ms dr jr sr prof gen col lt sgt capt rev vs".split())
_INITIAL = re.compile(r"(?:^|[\s(\"'])(?:[A-Za-z]\.)*[A-Za-z]$")  # "U.S" / "J" / "D.C" right before the period
_YES_NO = re.compile(r"(yes|no)\b(?=\s*(?:[,.;:!]|$))", re.IGNORECASE)


def normalize_answer(s: str) -> str:
    """Lower-case, strip punctuation, drop the articles a/an/the and fold white space (official order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


NO_ANSWER_TEXTS = ("[no answer]", "[none]", "[unanswered]")


def no_answer_text(gold: str) -> str:
    """What a prediction file says for a generation without an answer: a text whose EM and F1 against ``gold``
    are 0 under the official normalisation, as the harness scores it (an empty string would equal a gold that
    normalises to "")."""
    gold_tokens = set(normalize_answer(gold).split())
    return next(t for t in NO_ANSWER_TEXTS if not gold_tokens & set(normalize_answer(t).split()))


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
    """1 when the normalised gold tokens occur as a contiguous run of the normalised prediction's tokens
    (whole words: gold "no" is not in "Norland" or "I know", "Ostland" is not in "Ostlander")."""
    ref, pred = normalize_answer(gold).split(), normalize_answer(prediction).split()
    if not ref:
        return 0.0
    return float(any(pred[i:i + len(ref)] == ref for i in range(len(pred) - len(ref) + 1)))


def _sentence_end(text: str, i: int) -> bool:
    """Whether the period at ``text[i]`` ends a sentence: followed by white space or the end, and not the
    period of a title abbreviation ("St.") or of an initial or initialism ("J.", "U.S.", "D.C.")."""
    if i + 1 < len(text) and not text[i + 1].isspace():
        return False  # "3.5", "U.S" inside "U.S.", "example.com"
    before = text[:i]
    word = re.split(r"[\s(\"']", before)[-1].lower()
    if word in _TITLES:
        return False
    if _INITIAL.search(before) and i + 1 < len(text):  # an initial followed by more text on the line
        return False
    return True


def extract_answer(generation: str, phrase: str = ANSWER_PHRASE) -> tuple[str, bool]:
    """Return (answer, found) for a chain-of-thought generation.

    The answer is the span after the first ``phrase`` up to the end of its sentence (a period that ends a
    sentence, not the one in "U.S." or "3.5"), a newline, or the next ``phrase``; when the phrase ends its line
    the answer is on the next non-empty line. An answer that starts with a bare yes/no ("yes, both are in
    Eskel") is that word. Without the phrase, or with nothing after it, there is no answer: ("", False)."""
    at = generation.find(phrase)
    if at < 0:
        return "", False
    rest = generation[at + len(phrase):]
    nxt = rest.find(phrase)
    if nxt >= 0:
        rest = rest[:nxt]
    rest = rest.lstrip(" \t")
    if rest.startswith(("\n", "\r")):
        rest = rest.lstrip()
    line = rest.split("\n", 1)[0].rstrip("\r")
    end = next((i for i, ch in enumerate(line) if ch == "." and _sentence_end(line, i)), len(line))
    answer = line[:end].strip()
    m = _YES_NO.match(answer)
    if m:
        answer = m.group(1)
    return answer, bool(answer)


def score(prediction: str, gold: str, found: bool = True) -> dict[str, float]:
    """EM / F1 / contains; a generation whose answer was not found scores 0 on every metric."""
    if not found:
        return {"em": 0.0, "f1": 0.0, "contains": 0.0}
    return {"em": exact_match(prediction, gold), "f1": f1_score(prediction, gold), "contains": contains(prediction, gold)}
