"""Paired differences (``harness.reports.paired``): McNemar's exact test against scipy and hand-computed
cases, unpaired rows dropped and counted, the question-clustered interval, and the report's section."""
import json

import numpy as np
import pytest
from scipy.stats import binomtest

from harness.reports.paired import cluster_bootstrap_ci, mcnemar, paired, seed_spread


def _rows(values, ids=None, skipped=()):
    ids = ids or [f"q{i}" for i in range(len(values))]
    return [{"id": i, "scores": {"em": float(v)}, "skipped": "prompt_too_long" if i in skipped else None}
            for i, v in zip(ids, values)]


@pytest.mark.parametrize("right_wrong,wrong_right,agree", [(10, 2, 30), (5, 0, 3), (7, 7, 10), (0, 0, 4), (1, 12, 0)])
def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_pairs(right_wrong, wrong_right, agree):
    x = np.array([1] * right_wrong + [0] * wrong_right + [1] * agree)
    y = np.array([0] * right_wrong + [1] * wrong_right + [1] * agree)
    p, counts = mcnemar(x, y)
    assert counts == (right_wrong, wrong_right)
    n = right_wrong + wrong_right
    assert p == (1.0 if n == 0 else pytest.approx(binomtest(right_wrong, n, 0.5).pvalue))
    if (right_wrong, wrong_right) == (5, 0):
        assert p == pytest.approx(2 * 0.5 ** 5)  # by hand: both tails of 5 of 5


def test_only_rows_scored_on_both_sides_pair_and_the_rest_are_counted():
    a = _rows([1, 1, 0, 1, 1], skipped={"q4"})
    b = _rows([0, 1, 0, 0], ids=["q0", "q1", "q2", "q9"])
    d = paired(a, b, "em", key=lambda r: r["id"], cluster=lambda r: r["id"], a="A", b="B", condition="first")
    assert d.pairs == 3 and d.questions == 3  # q0, q1, q2
    assert (d.dropped_a, d.dropped_b) == (1, 1)  # q3 has no partner (q4 was skipped); q9 has none in A
    assert d.diff == pytest.approx(1 / 3) and d.discordant == (1, 0)
    assert d.mean_a == pytest.approx(2 / 3) and d.mean_b == pytest.approx(1 / 3)
    assert d.mcnemar_p == pytest.approx(1.0)
    assert paired(a, _rows([1], ids=["zz"]), "em", key=lambda r: r["id"], cluster=lambda r: r["id"], a="A", b="B",
                  condition="c") is None


def test_clustering_by_question_widens_the_interval_when_a_questions_rows_move_together():
    rng = np.random.default_rng(0)
    per_question = rng.normal(0, 1, size=30)
    values = np.repeat(per_question, 10) + rng.normal(0, 0.1, size=300)  # ten correlated rows per question
    questions = np.repeat(np.arange(30), 10).tolist()
    lo_c, hi_c = cluster_bootstrap_ci(values, questions, seed=1)
    lo_r, hi_r = cluster_bootstrap_ci(values, list(range(300)), seed=1)  # every row its own cluster
    assert hi_c - lo_c > 2 * (hi_r - lo_r)
    assert lo_c < values.mean() < hi_c
    assert cluster_bootstrap_ci(values, questions, seed=1) == (lo_c, hi_c)  # seeded: reproducible


def test_seed_spread():
    s = seed_spread([0.5, 0.7, 0.6])
    assert s["seeds"] == 3 and s["mean"] == pytest.approx(0.6) and s["sd_between_seeds"] == pytest.approx(0.1)


def test_the_report_states_paired_differences_with_counts_intervals_and_tests(tiny_phi_dir, phi_backend, tmp_path,
                                                                             capsys):
    from harness.engine import run_eval
    from harness.report import main as report_main
    from tests.helpers import run_config

    plain, tool = tmp_path / "plain", tmp_path / "tool"
    for out, retrieval in ((plain, False), (tool, True)):
        run_eval(run_config(tiny_phi_dir, out, limit=6, max_new_tokens=8, retrieval=retrieval,
                            positions=["first", "middle", "last"]), backend=phi_backend, progress=False)
    rep = tmp_path / "rep"
    assert report_main([str(plain), str(tool), "--out", str(rep)]) == 0
    text = (rep / "report.md").read_text()
    assert "## Paired differences" in text and "McNemar p =" in text and "paired, 6 rows of 6 questions" in text
    got = json.loads((rep / "comparisons.json").read_text())["differences"]
    within = [d for d in got if d["a"] == "first" and d["b"] == "last"]
    between = {d["condition"]: d for d in got if d["a"] != "first"}
    assert len(within) == 2  # first vs last in each run
    assert set(between) == {"first", "middle", "last", "all"}
    pooled = between["all"]
    assert pooled["pairs"] == 18 and pooled["questions"] == 6  # three rows of each question, one cluster
    for d in got:
        assert d["ci_low"] <= d["diff"] <= d["ci_high"] and 0 <= d["mcnemar_p"] <= 1
