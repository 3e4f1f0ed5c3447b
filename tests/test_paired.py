"""Paired differences (``harness.reports.paired``): McNemar's exact test against scipy and hand-computed
cases, unpaired rows dropped and counted, the question-clustered interval, and the report's section."""
import json

import numpy as np
import pytest
from scipy.stats import binomtest

from harness.reports.paired import cluster_bootstrap_ci, mcnemar, paired, seed_spread


def _rows(values, ids=None, skipped=()):
    ids = ids or [f"q{i}" for i in range(len(values))]
    return [{"id": i, "instance_sha256": i, "scores": {"em": float(v)},
             "skipped": "prompt_too_long" if i in skipped else None} for i, v in zip(ids, values)]


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
    d = paired(a, b, "em", key=lambda r: r["id"], cluster=lambda r: r["id"], a="A", b="B", condition="first",
               binary=True)
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


# ------------------------------------------------------------ pairs are the same prompt; replicates really differ
def _run_mqar(tiny_phi_dir, phi_backend, out, seed=1234, **task_args):
    from harness.engine import run_eval
    from tests.helpers import run_config

    return run_eval(run_config(tiny_phi_dir, out, task="mqar", data=None, limit=None, max_new_tokens=8, seed=seed,
                               task_args={"pairs": 4, "samples": 24, **task_args}), backend=phi_backend, progress=False)


def test_rows_of_other_held_out_sets_never_pair(tiny_phi_dir, phi_backend, tmp_path, capsys):
    """eval_seed 0 vs 1: the same ids, other questions. No paired difference, and a note that says why."""
    from harness.report import main as report_main

    a, b = tmp_path / "s0", tmp_path / "s1"
    _run_mqar(tiny_phi_dir, phi_backend, a, eval_seed=0)
    _run_mqar(tiny_phi_dir, phi_backend, b, eval_seed=1)
    rows = [[json.loads(x) for x in open(d / "samples.jsonl")] for d in (a, b)]
    assert {r["id"] for r in rows[0]} == {r["id"] for r in rows[1]}  # the ids repeat ...
    assert not {r["prompt_sha256"] for r in rows[0]} & {r["prompt_sha256"] for r in rows[1]}  # ... the prompts not
    assert report_main([str(a), str(b), "--out", str(tmp_path / "rep")]) == 0
    got = json.loads((tmp_path / "rep" / "comparisons.json").read_text())
    assert got["differences"] == []  # one condition (pairs=4): the only comparison would be between the runs
    assert "McNemar" not in (tmp_path / "rep" / "report.md").read_text()
    assert any("share an id but hold other questions" in n for n in got["notes"]), got["notes"]


def test_a_seed_that_does_not_reach_the_data_is_no_replicate_and_a_copy_is_one_run(tiny_phi_dir, phi_backend,
                                                                                   tmp_path):
    import shutil

    from harness.report import main as report_main

    a, b = tmp_path / "seed1", tmp_path / "seed2"
    for out, seed in ((a, 1), (b, 2)):
        _run_mqar(tiny_phi_dir, phi_backend, out, seed=seed)
    assert report_main([str(a), str(b), "--out", str(tmp_path / "rep")]) == 0
    got = json.loads((tmp_path / "rep" / "comparisons.json").read_text())
    assert got["seeds"] == [] and any("does not use" in n for n in got["notes"]), got
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "sd between seeds" not in text
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    assert report_main([str(a), str(copy), str(a), "--out", str(tmp_path / "rep2")]) == 0
    got = json.loads((tmp_path / "rep2" / "comparisons.json").read_text())
    assert sum("counted once" in n for n in got["notes"]) == 2
    assert len({d["condition"] for d in got["differences"]}) <= 1  # only the run's own first-vs-last


def test_hotpotqa_seeds_that_change_the_prompts_are_pooled(tiny_phi_dir, phi_backend, tmp_path):
    from harness.engine import run_eval
    from harness.report import main as report_main
    from tests.helpers import run_config

    runs = []
    for seed in (1, 2):
        out = tmp_path / f"seed{seed}"
        run_eval(run_config(tiny_phi_dir, out, limit=3, max_new_tokens=4, seed=seed), backend=phi_backend,
                 progress=False)
        runs.append(str(out))
    assert report_main([*runs, "--out", str(tmp_path / "rep")]) == 0
    got = json.loads((tmp_path / "rep" / "comparisons.json").read_text())
    assert got["seeds"] and all(s["seeds"] == 2 for s in got["seeds"])


def test_which_test_a_metric_gets_is_declared_not_read_from_its_values():
    """F1 values that happen to be 0 or 1 get no McNemar test; EM does."""
    a, b = _rows([1, 1, 0, 1, 0, 1]), _rows([0, 1, 0, 0, 1, 0])
    f1 = paired(a, b, "em", key=lambda r: r["id"], cluster=lambda r: r["id"], a="A", b="B", condition="c")
    em = paired(a, b, "em", key=lambda r: r["id"], cluster=lambda r: r["id"], a="A", b="B", condition="c",
                binary=True)
    assert f1.mcnemar_p is None and "McNemar" not in f1.line() and em.mcnemar_p is not None
    from evals import task_class

    assert task_class("hotpotqa").binary_metrics == ("em", "contains")
    assert "accuracy" not in task_class("mqar").binary_metrics  # a share of queries per row


def _legacy(run, edit=lambda r: None, data=None):
    """The run as one written before instance hashes: every row without ``instance_sha256``."""
    rows = [json.loads(x) for x in open(run / "samples.jsonl")]
    for r in rows:
        r.pop("instance_sha256", None)
        edit(r)
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if data is not None:
        res = json.loads((run / "results.json").read_text())
        res["resolved"]["data_sha256"] = data
        (run / "results.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_legacy_rows_pair_only_where_the_prompt_the_data_or_the_question_says_so(tiny_phi_dir, phi_backend,
                                                                                 tmp_path):
    """Rows without instance hashes: an id and a gold never pair them alone. Other held-out sets with the same ids
    and answers pair nothing; runs of the same data (other distractor counts: other prompts) pair, by the data's
    hash or, where the data hashes differ, by the question text in the prompts."""
    import shutil

    from harness.engine import run_eval
    from harness.report import main as report_main
    from tests.helpers import run_config

    def between(rep):
        got = json.loads((rep / "comparisons.json").read_text())
        return [d for d in got["differences"] if d["condition"] == "first"], got["notes"]

    # MQAR, eval_seed 0 and 1: the same ids; the golds made the same, as the two runs
    a, b = tmp_path / "s0", tmp_path / "s1"
    _run_mqar(tiny_phi_dir, phi_backend, a, eval_seed=0)
    _run_mqar(tiny_phi_dir, phi_backend, b, eval_seed=1)
    gold = {json.loads(x)["key"]: json.loads(x)["gold"] for x in open(a / "samples.jsonl")}
    _legacy(a)
    _legacy(b, lambda r: r.update(gold=gold[r["key"]]))
    assert report_main([str(a), str(b), "--out", str(tmp_path / "rep0")]) == 0
    got = json.loads((tmp_path / "rep0" / "comparisons.json").read_text())
    assert got["differences"] == [] and any("nothing shows they hold the same question" in n for n in got["notes"])

    # HotpotQA, 2 and 3 distractors: the same questions in other prompts
    k2, k3 = tmp_path / "k2", tmp_path / "k3"
    for out, k in ((k2, 2), (k3, 3)):
        run_eval(run_config(tiny_phi_dir, out, limit=5, max_new_tokens=6, distractors=k, positions=["first"]),
                 backend=phi_backend, progress=False)
    _legacy(k2)
    _legacy(k3)
    assert report_main([str(k2), str(k3), "--out", str(tmp_path / "rep1")]) == 0
    (d,), _ = between(tmp_path / "rep1")
    assert d["pairs"] == 5 and d["unverified"] == 0 and d["mismatched"] == 0  # by the data's hash
    _legacy(k3, data="another data file")  # now only the question text can say it
    assert report_main([str(k2), str(k3), "--out", str(tmp_path / "rep2")]) == 0
    (d,), _ = between(tmp_path / "rep2")
    assert d["pairs"] == 5
    other = tmp_path / "other"
    shutil.copytree(k3, other)

    def other_question(r):
        (s, e, _), = [x for x in r["evidence"] if x[2] == "question"]
        r["prompt"] = r["prompt"][:s] + "Q" * (e - s) + r["prompt"][e:]
        r["prompt_sha256"] = "changed"

    _legacy(other, other_question)
    assert report_main([str(k2), str(other), "--out", str(tmp_path / "rep3")]) == 0
    diffs, notes = between(tmp_path / "rep3")
    assert diffs == [] and any("hold other questions" in n for n in notes), notes
