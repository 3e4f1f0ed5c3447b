import math

import pytest

from evals.metrics import bootstrap_se, contains, exact_match, extract_answer, f1_score, normalize_answer


def test_normalize_follows_official_order():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an Apple a day") == "apple day"
    assert normalize_answer("  A.B.C.  ") == "abc"  # punctuation first, then articles: 'a' in 'abc' survives


def test_exact_match():
    assert exact_match("the Port Calder.", "Port Calder") == 1.0
    assert exact_match("Port Calder city", "Port Calder") == 0.0


@pytest.mark.parametrize("pred,gold,expected", [
    ("Port Calder", "Port Calder", 1.0),
    # pred tokens {port, calder, harbour}, gold {port, calder}: p=2/3, r=1 → F1 = 0.8
    ("Port Calder harbour", "Port Calder", 0.8),
    # one common token of 2 pred / 3 gold: p=1/2, r=1/3 → 0.4
    ("north Ostland", "the Ostland republic federal", 2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3)),
    ("Veloria", "Ostland", 0.0),
])
def test_f1_hand_computed(pred, gold, expected):
    assert f1_score(pred, gold) == pytest.approx(expected)


def test_f1_official_yes_no_rule():
    assert f1_score("yes", "yes") == 1.0
    assert f1_score("yes", "no") == 0.0
    # 'no' shares no token with gold but the rule fires before counting anyway
    assert f1_score("yes it is", "yes") == 0.0  # gold is 'yes', prediction normalises to something else
    assert f1_score("no", "no way out") == 0.0  # prediction is special and differs from gold
    assert f1_score("noanswer", "noanswer") == 1.0


def test_contains():
    assert contains("It is Port Calder, I think", "Port Calder") == 1.0
    assert contains("Calder", "Port Calder") == 0.0
    assert contains("anything", "the") == 0.0  # gold normalising to empty never counts


@pytest.mark.parametrize("gen,answer,found", [
    (" Harlan Mews is by Ida. So the answer is: Aarvik.", "Aarvik", True),
    (" So the answer is: St. Louis.\n\nQuestion", "St. Louis", True),
    (" So the answer is:yes", "yes", True),
    (" ...So the answer is: Grayholm Priory.", "Grayholm Priory", True),
    ("\n Port Calder\nmore", "Port Calder", False),
    ("", "", False),
])
def test_extract_answer(gen, answer, found):
    assert extract_answer(gen) == (answer, found)


def test_bootstrap_se_matches_binomial_se():
    vals = [1.0] * 30 + [0.0] * 70
    se = bootstrap_se(vals, n_boot=4000, seed=1)
    assert se == pytest.approx(math.sqrt(0.3 * 0.7 / 100), rel=0.1)
    assert bootstrap_se([1.0] * 10) == 0.0
    assert math.isnan(bootstrap_se([1.0]))
