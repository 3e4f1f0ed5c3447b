import math

import pytest

from evals.metrics import contains, exact_match, extract_answer, f1_score, normalize_answer
from harness.engine.stats import bootstrap_se


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


@pytest.mark.parametrize("pred,gold,expected", [
    ("It is Port Calder, I think", "Port Calder", 1.0),
    ("Calder", "Port Calder", 0.0),
    ("anything", "the", 0.0),  # gold normalising to empty never counts
    # whole normalised tokens, as a contiguous run (issue 9: raw substrings credited these)
    ("It is not in Ostland", "no", 0.0),
    ("Norland", "no", 0.0),
    ("I know", "no", 0.0),
    ("The eyes have it", "yes", 0.0),
    ("Ostlander", "Ostland", 0.0),
    ("no, it is not", "no", 1.0),
    ("Calder Port", "Port Calder", 0.0),  # order matters
    ("the city of Port-Calder!", "Port Calder", 0.0),  # the official normalisation glues "Port-Calder"
    ("Yes.", "yes", 1.0),
])
def test_contains_matches_whole_normalised_tokens(pred, gold, expected):
    assert contains(pred, gold) == expected


@pytest.mark.parametrize("gen,answer,found", [
    (" Harlan Mews is by Ida. So the answer is: Aarvik.", "Aarvik", True),
    (" So the answer is: St. Louis.\n\nQuestion", "St. Louis", True),
    (" So the answer is:yes", "yes", True),
    (" ...So the answer is: Grayholm Priory.", "Grayholm Priory", True),
    # the sentence ends the answer (issue 9's cases)
    ("So the answer is: Ostland. Ostland is a country in the north", "Ostland", True),
    ("So the answer is: yes, both are in Eskel.", "yes", True),
    ("So the answer is: No. They are not.", "No", True),
    ("So the answer is: Ostland. So the answer is: Ostland.", "Ostland", True),
    ("So the answer is: Ostland So the answer is: Ostland", "Ostland", True),  # the next phrase ends it
    ("So the answer is:\nOstland.", "Ostland", True),  # answer on the line after the phrase
    ("So the answer is: \n\n  Ostland\nmore", "Ostland", True),
    # periods that do not end a sentence
    ("So the answer is: U.S.", "U.S", True),
    ("So the answer is: the U.S. Army.\nQuestion", "the U.S. Army", True),
    ("So the answer is: 3.5.", "3.5", True),
    ("So the answer is: 3.5 million. That is many.", "3.5 million", True),
    ("So the answer is: Washington, D.C.", "Washington, D.C", True),
    ("So the answer is: J. R. R. Tolkien. He wrote it.", "J. R. R. Tolkien", True),
    ('So the answer is: "The Salt Road".', '"The Salt Road"', True),
    ("So the answer is: Yes", "Yes", True),
    ("So the answer is: Norway.", "Norway", True),  # "no" at the start of a word is not a bare no
    # no phrase, or nothing after it: no answer
    ("\n Port Calder\nmore", "", False),
    ("", "", False),
    ("So the answer is:", "", False),
    ("So the answer is:   \n", "", False),
])
def test_extract_answer(gen, answer, found):
    assert extract_answer(gen) == (answer, found)


def test_extracted_answers_score_as_the_official_script_would():
    # "U.S" and "U.S." normalise alike, so dropping the final period never changes EM or F1
    assert exact_match(extract_answer("So the answer is: U.S.")[0], "U.S.") == 1.0
    assert exact_match(extract_answer("So the answer is: Washington, D.C.")[0], "Washington, D.C.") == 1.0
    assert exact_match(extract_answer('So the answer is: "The Salt Road".')[0], "The Salt Road") == 1.0


def test_a_generation_without_the_phrase_scores_zero_everywhere():
    from evals.metrics import score

    answer, found = extract_answer("Ostland is where it is. I know it is Ostland")
    assert score(answer, "Ostland", found) == {"em": 0.0, "f1": 0.0, "contains": 0.0}
    assert score("Ostland", "Ostland", True) == {"em": 1.0, "f1": 1.0, "contains": 1.0}


def test_a_custom_answer_phrase_from_the_template_is_used_for_scoring(tmp_path):
    from evals.hotpotqa import HotpotQA
    from harness.engine.prompting import PromptTemplate

    path = tmp_path / "mine.j2"
    path.write_text('{%- set answer_phrase = "Final answer ->" -%}Q: {{ question }}\nA:')
    template = PromptTemplate(str(path))
    assert template.declared("answer_phrase") == "Final answer ->"
    assert PromptTemplate("hotpotqa_cot").declared("answer_phrase") == "So the answer is:"
    task = HotpotQA(data="fixture")
    ins = HotpotQA(distractors=2, positions=["first"]).instances(task.load()[:1], seed=0)[0]
    gen = f"It is here. Final answer -> {ins.answer}. So the answer is: nothing."
    assert task.score(ins, gen, answer_phrase="Final answer ->")["em"] == 1.0
    assert task.score(ins, gen)["prediction"] == "nothing"


def test_bootstrap_se_matches_binomial_se():
    vals = [1.0] * 30 + [0.0] * 70
    se = bootstrap_se(vals, n_boot=4000, seed=1)
    assert se == pytest.approx(math.sqrt(0.3 * 0.7 / 100), rel=0.1)
    assert bootstrap_se([1.0] * 10) == 0.0
    assert math.isnan(bootstrap_se([1.0]))
