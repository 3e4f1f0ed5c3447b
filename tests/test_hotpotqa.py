import copy
import json

import pytest

from evals.base import DataError
from evals.fixture import make_rows
from evals.hotpotqa import HotpotQA, load_rows, parse_positions


@pytest.fixture(scope="module")
def rows():
    return load_rows("fixture")


def _gold_slots(ins):
    return [i for i, p in enumerate(ins.paragraphs) if p["gold"]]


def test_fixture_follows_official_schema(rows):
    assert len(rows) >= 20
    for r in rows:
        assert set(r) == {"_id", "question", "answer", "supporting_facts", "context", "type", "level"}
        assert len(r["context"]) == 10
        assert all(isinstance(t, str) and isinstance(s, list) for t, s in r["context"])


@pytest.mark.parametrize("k", [3, 8, 10, 20])
@pytest.mark.parametrize("position,expected_start", [("first", 0), ("last", None), ("middle", "mid"), ("2", 2)])
def test_gold_placement(rows, k, position, expected_start):
    (ins,) = HotpotQA(distractors=k, positions=[position]).instances(rows[:1], seed=7, pool_rows=rows)
    start = {None: k, "mid": k // 2}.get(expected_start, expected_start)
    assert _gold_slots(ins) == [start, start + 1]
    assert len(ins.paragraphs) == k + 2
    gold_titles = {t for t, _ in rows[0]["supporting_facts"]}
    assert {p["title"] for p in ins.paragraphs if p["gold"]} == gold_titles
    assert len({p["title"] for p in ins.paragraphs}) == k + 2  # no paragraph twice


def test_oracle_mode_has_gold_only(rows):
    inst = HotpotQA(distractors=0, positions=["first", "last"]).instances(rows[:3], seed=0)
    assert [i.condition for i in inst] == ["oracle"] * 3
    assert all(len(i.paragraphs) == 2 and all(p["gold"] for p in i.paragraphs) for i in inst)


def test_distractors_fixed_across_positions_and_seeded(rows):
    a = HotpotQA(distractors=12, positions=["first", "middle", "last"]).instances(rows[:4], seed=3)
    for q in range(4):
        orders = [[p["title"] for p in i.paragraphs if not p["gold"]] for i in a[3 * q:3 * q + 3]]
        assert orders[0] == orders[1] == orders[2]
    b = HotpotQA(distractors=12, positions=["first"]).instances(rows[:4], seed=3)
    c = HotpotQA(distractors=12, positions=["first"]).instances(rows[:4], seed=4)
    assert [p["title"] for p in b[0].paragraphs] == [p["title"] for p in a[0].paragraphs]
    assert any([p["title"] for p in x.paragraphs] != [p["title"] for p in y.paragraphs] for x, y in zip(b, c))


def test_distractors_beyond_eight_come_from_other_questions(rows):
    (ins,) = HotpotQA(distractors=15, positions=["first"]).instances(rows[:1], seed=0, pool_rows=rows)
    own = {t for t, _ in rows[0]["context"]}
    titles = [p["title"] for p in ins.paragraphs]
    assert len(set(titles)) == 17
    assert own <= set(titles)  # all eight own distractors kept
    assert len(set(titles) - own) == 7


def test_too_many_distractors_is_a_clear_error(rows):
    with pytest.raises(DataError, match="fewer --distractors"):
        HotpotQA(distractors=500, positions=["first"]).instances(rows[:2], seed=0)


def test_random_position_is_seeded_and_in_range(rows):
    a = HotpotQA(distractors=10, positions=["random"]).instances(rows, seed=5)
    b = HotpotQA(distractors=10, positions=["random"]).instances(rows, seed=5)
    starts = [i.meta["gold_start"] for i in a]
    assert starts == [i.meta["gold_start"] for i in b]
    assert all(0 <= s <= 10 for s in starts) and len(set(starts)) > 1
    assert all(_gold_slots(i) == [i.meta["gold_start"], i.meta["gold_start"] + 1] for i in a)


def test_parse_positions():
    assert parse_positions("first, last,3,first") == ["first", "last", "3"]
    with pytest.raises(ValueError, match="unknown position 'top'"):
        parse_positions("first,top")
    with pytest.raises(ValueError, match="past the end"):
        HotpotQA(distractors=4, positions=["9"]).instances(make_rows(2), seed=0)


def test_missing_file_says_how_to_get_data(tmp_path):
    with pytest.raises(DataError, match="--data PATH.*--data fixture"):
        load_rows(str(tmp_path / "hotpot_dev_distractor_v1.json"))


def test_offline_hub_says_how_to_get_data():
    with pytest.raises(DataError, match="hotpot_dev_distractor_v1.json"):
        load_rows("hub")


@pytest.mark.parametrize("mutate,message", [
    (lambda r: r.pop("answer"), r"row 1 \(id 'fx0001'\): missing field 'answer'"),
    (lambda r: r.__setitem__("context", [["T", "not a list"]]), r"row 1 \(id 'fx0001'\): field 'context\[0\]'"),
    (lambda r: r.__setitem__("supporting_facts", [["Nowhere", 0]]), r"supporting_facts\[0\].*'Nowhere'"),
    (lambda r: r.__setitem__("question", 5), r"field 'question' must be a str"),
])
def test_malformed_row_names_row_and_field(tmp_path, mutate, message):
    data = make_rows(3)
    bad = copy.deepcopy(data)
    mutate(bad[1])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(DataError, match=message):
        load_rows(str(path))


def test_jsonl_and_invalid_json(tmp_path):
    rows = make_rows(3)
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    assert [r["_id"] for r in load_rows(str(p))] == [r["_id"] for r in rows]
    q = tmp_path / "broken.json"
    q.write_text("[{")
    with pytest.raises(DataError, match="not valid JSON"):
        load_rows(str(q))


def test_retrieval_units_are_the_test_context_only(rows):
    (ins,) = HotpotQA(distractors=4, positions=["first"]).instances(rows[:1], seed=0)
    units = ins.retrieval_units()
    assert len(units) == sum(len(p["sentences"]) for p in ins.paragraphs)
    assert all(":" in u for u in units)
    assert not any("Ida Korsgaard" in u for u in units)  # an exemplar's paragraph


def test_prediction_files_score_a_missing_answer_as_the_harness_does(tmp_path):
    """A generation without an answer scores 0; written as "" it would be EM 1 in the official script against a
    gold that normalises to "" ("A", "the"). The prediction files make the official script agree on every row."""
    from evals.hotpotqa import write_predictions
    from evals.metrics import exact_match, f1_score

    golds = ["A", "the", "no answer", "none", "unanswered no", "yes", "Ostland"]
    assert exact_match("", "A") == 1.0  # the trap
    recs = [{"id": f"q{i}", "condition": "first", "skipped": None, "prediction": "", "answer_found": False,
             "gold": g} for i, g in enumerate(golds)]
    recs.append({"id": "found", "condition": "first", "skipped": None, "prediction": "", "answer_found": True,
                 "gold": "A"})  # an answer phrase followed by nothing: "" is the harness's answer, EM 1 both ways
    write_predictions(recs, tmp_path, ["first"])
    pred = json.loads((tmp_path / "predictions" / "first.json").read_text())["answer"]
    for r in recs[:-1]:
        assert exact_match(pred[r["id"]], r["gold"]) == 0.0 and f1_score(pred[r["id"]], r["gold"]) == 0.0, r["gold"]
    assert pred["found"] == ""
