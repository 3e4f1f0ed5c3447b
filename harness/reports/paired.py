"""Paired differences between two conditions of a run, or two runs on the same questions: the claims a paper
makes ("first − last", "Phi-1.5 − Phi-Mamba at slot 7") with a confidence interval and a test.

A difference is paired: only rows present, and scored, on both sides count (the rest are counted as dropped),
so the noise the two sides share cancels. Rows pair only where they are the same question: the same key *and*
the same content (``same``: the instance's hash where both rows carry it; for older rows the prompt, the data
file or the question text with the gold), never by id alone (a generated task's ids repeat across held-out sets). Its interval is a percentile bootstrap that resamples *questions*
(clusters), not rows: where one question yields several rows (every slot of a sweep, several needle depths) its
rows are correlated, and resampling rows would understate the spread. Metrics the task declares 0/1
(``Task.binary_metrics``) also get the exact McNemar test (``scipy.stats.binomtest`` on the discordant pairs). The bootstrap is seeded, so a report is reproducible.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np

BOOT = 2000
LEVEL = 0.95


@dataclass
class Difference:
    """``a`` minus ``b`` on ``metric``, over ``pairs`` paired rows from ``questions`` questions."""

    a: str
    b: str
    metric: str
    condition: str
    pairs: int
    questions: int
    dropped_a: int  # rows of a with no scored partner in b (skipped, missing)
    dropped_b: int
    mean_a: float
    mean_b: float
    diff: float
    ci_low: float
    ci_high: float
    mcnemar_p: float | None = None  # 0/1 metrics
    discordant: tuple[int, int] | None = None  # (a right and b wrong, a wrong and b right)
    concordant: tuple[int, int] | None = None  # (both right, both wrong): with ``discordant``, McNemar's 2x2
    mismatched: int = 0  # rows whose key both sides hold but whose content differs: not paired
    unverified: int = 0  # rows whose key both sides hold where nothing shows the same question: not paired
    task: str = ""  # the task whose runs these are (a report may hold several)

    @property
    def significant(self) -> bool:
        """The interval excludes 0 (and, for a 0/1 metric, McNemar's p < 0.05)."""
        excludes = self.ci_low > 0 or self.ci_high < 0
        return excludes and (self.mcnemar_p is None or self.mcnemar_p < 1 - LEVEL)

    def line(self) -> str:
        pts = 100.0
        test = f", McNemar p = {_p(self.mcnemar_p)}" if self.mcnemar_p is not None else ""
        extra = (f"; {self.mismatched} rows share a key but not the question: not paired" if self.mismatched else "") \
            + (f"; {self.unverified} rows share a key, but nothing shows the same question (rows without an "
               "instance hash, from other data or prompts): not paired" if self.unverified else "")
        return (f"{self.a} − {self.b} ({self.condition}): {pts * self.diff:+.1f} pts "
                f"[{pts * self.ci_low:+.1f}, {pts * self.ci_high:+.1f}] (paired, {self.pairs} rows of "
                f"{self.questions} questions{test}; dropped {self.dropped_a} + {self.dropped_b}{extra})")

    def table(self) -> str | None:
        """McNemar's 2x2 in words (None for a metric that is not 0/1)."""
        if self.discordant is None or self.concordant is None:
            return None
        return (f"both right {self.concordant[0]}, only {self.a} right {self.discordant[0]}, only {self.b} right "
                f"{self.discordant[1]}, both wrong {self.concordant[1]}")

    def to_dict(self) -> dict:
        return {**asdict(self), "significant": self.significant}


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else "< 1e-4"


def same_instance(ra: dict, rb: dict, data: tuple[str | None, str | None] = (None, None)) -> bool | None:
    """Whether two rows of one key hold the same instance: by its content hash where both carry one. Rows written
    before instance hashes are the same question where something says so: the same prompt (its hash), the same
    data file (``data``: each row's run's data hash) with the same gold, or the same question text in their
    prompts with the same gold. None: nothing says it (they are not paired, and counted as such); an id and a gold
    alone never pair rows, since a generated task's ids and short answers repeat across held-out sets."""
    ha, hb = ra.get("instance_sha256"), rb.get("instance_sha256")
    if ha is not None and hb is not None:
        return ha == hb
    if ra.get("gold") != rb.get("gold"):
        return False
    pa, pb = ra.get("prompt_sha256"), rb.get("prompt_sha256")
    if pa is not None and pa == pb:
        return True
    if data[0] is not None and data[0] == data[1]:
        return True
    qa, qb = question_text(ra), question_text(rb)
    if qa is not None and qb is not None:
        return qa == qb
    return None


def question_text(row: dict) -> str | None:
    """The question as the row's prompt holds it (its evidence span labelled "question"), where it is recorded."""
    prompt = row.get("prompt")
    for span in row.get("evidence") or []:
        if len(span) == 3 and span[2] == "question" and isinstance(prompt, str):
            return prompt[span[0]:span[1]]
    return None


def matcher(data_a: str | None, data_b: str | None):
    """``same_instance`` for rows of two runs whose data hashes are ``data_a`` and ``data_b``."""
    return lambda ra, rb: same_instance(ra, rb, (data_a, data_b))


def same_question(ra: dict, rb: dict) -> bool:
    """Two conditions of one question within a run (its instances differ by design): the same gold answer."""
    return ra.get("gold") == rb.get("gold")


@dataclass
class Pairing:
    """Which keys pair between two sets of rows, and why the others do not."""

    side_a: dict
    side_b: dict
    both: list
    mismatched: int
    unverified: int


def pairing(a_rows: Iterable[dict], b_rows: Iterable[dict], key, same=same_instance) -> Pairing:
    side_a = {key(r): r for r in a_rows if not r.get("skipped")}
    side_b = {key(r): r for r in b_rows if not r.get("skipped")}
    verdict = {k: same(side_a[k], side_b[k]) for k in side_a if k in side_b}
    both = [k for k, v in verdict.items() if v is True]
    return Pairing(side_a, side_b, both, mismatched=sum(v is False for v in verdict.values()),
                   unverified=sum(v is None for v in verdict.values()))


def paired(a_rows: Iterable[dict], b_rows: Iterable[dict], metric: str, key, cluster, *, a: str, b: str,
           condition: str, seed: int = 0, binary: bool = False, same=same_instance) -> Difference | None:
    """The paired difference of ``metric`` between two sets of rows matched by ``key(row)`` where ``same`` says
    they hold the same question, clustered by ``cluster(row)`` (the question); McNemar's test where ``binary``
    (the task declares the metric 0/1). None when no row pairs (``pairing`` says why)."""
    got = pairing(a_rows, b_rows, key, same)
    side_a, side_b, both = got.side_a, got.side_b, got.both
    if not both:
        return None
    x = np.array([float(side_a[k]["scores"][metric]) for k in both])
    y = np.array([float(side_b[k]["scores"][metric]) for k in both])
    groups = [cluster(side_a[k]) for k in both]
    low, high = cluster_bootstrap_ci(x - y, groups, seed=seed)
    out = Difference(a=a, b=b, metric=metric, condition=condition, pairs=len(both), questions=len(set(groups)),
                     dropped_a=len(side_a) - len(both), dropped_b=len(side_b) - len(both), mean_a=float(x.mean()),
                     mean_b=float(y.mean()), diff=float((x - y).mean()), ci_low=low, ci_high=high,
                     mismatched=got.mismatched, unverified=got.unverified)
    if binary and set(np.unique(np.concatenate([x, y]))) <= {0.0, 1.0}:
        out.mcnemar_p, out.discordant = mcnemar(x, y)
        out.concordant = (int(((x == 1) & (y == 1)).sum()), int(((x == 0) & (y == 0)).sum()))
    return out


def cluster_bootstrap_ci(values: np.ndarray, clusters: list, n_boot: int = BOOT, level: float = LEVEL,
                         seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean of ``values`` resampling whole clusters with replacement (each
    resample's mean over all rows of its clusters). Written here: scipy's bootstrap resamples rows only."""
    values = np.asarray(values, dtype=float)
    ids = {c: i for i, c in enumerate(dict.fromkeys(clusters))}
    which = np.array([ids[c] for c in clusters])
    sums = np.bincount(which, weights=values, minlength=len(ids))
    counts = np.bincount(which, minlength=len(ids)).astype(float)
    if len(ids) < 2:
        m = float(values.mean())
        return m, m
    rng = np.random.default_rng(seed)
    draw = rng.integers(0, len(ids), size=(n_boot, len(ids)))
    means = sums[draw].sum(axis=1) / counts[draw].sum(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def mcnemar(x: np.ndarray, y: np.ndarray) -> tuple[float, tuple[int, int]]:
    """Exact two-sided McNemar test of paired 0/1 outcomes: a binomial test of the discordant pairs at 1/2."""
    from scipy.stats import binomtest

    right_wrong = int(((x == 1) & (y == 0)).sum())
    wrong_right = int(((x == 0) & (y == 1)).sum())
    n = right_wrong + wrong_right
    p = 1.0 if n == 0 else float(binomtest(right_wrong, n, 0.5).pvalue)
    return p, (right_wrong, wrong_right)


def seed_spread(values: list[float]) -> dict:
    """Runs that differ only in ``--seed``, pooled: the mean over seeds and their spread (sample SD)."""
    v = np.asarray(values, dtype=float)
    return {"seeds": len(v), "mean": float(v.mean()), "sd_between_seeds": float(v.std(ddof=1)) if len(v) > 1 else None,
            "min": float(v.min()), "max": float(v.max())}
