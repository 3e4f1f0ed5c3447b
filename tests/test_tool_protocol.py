"""The tool protocol under a real GPT-2 byte-level BPE, driven by scripted model choices that imitate the
exemplars. GPT-2 has ``><`` as one token, so a model writing ``</search><result>`` completes its call with a
token that also opens the next tag; ``</search><search>`` likewise. Each call's pattern and inserted result
must be exactly as written, whatever the batch size and with or without prefix reuse."""
import json
import re

import pytest

from evals.hotpotqa import HotpotQA
from harness.backends.loading import load_backend
from harness.engine import run_eval
from harness.engine.config import RunConfig
from tests.helpers import assert_varied, ScriptedBackend, tool_scenario

N_QUESTIONS = 8


def _expected_result(pattern: str | None, units: list[str]) -> str:
    if pattern is None:
        return "<result>[error: </search> without an opening <search>]</result>"
    hits = [u for u in units if re.search(pattern, u)][:3]
    body = " | ".join(hits) if hits else "[no match]"
    body = body if len(body) <= 300 else body[:297].rstrip() + "..."
    return f"<result>{body}</result>"


@pytest.fixture(scope="module")
def scripts():
    task = HotpotQA(data="fixture")
    rows = task.load()[:N_QUESTIONS]
    by_question = {}
    for i, r in enumerate(rows):
        gold = list(dict.fromkeys(t for t, _ in r["supporting_facts"]))
        by_question[r["question"]] = (r["_id"], *tool_scenario(i, gold[0], gold[-1], r["answer"]))
    return by_question


def _script_for(scripts):
    def script_for(prompt: str) -> list[str]:
        question = prompt[prompt.rfind("Question: ") + len("Question: "):].split("\n")[0]
        return scripts[question][1] if question in scripts and prompt.endswith("Answer:") else None
    return script_for


@pytest.fixture(scope="module")
def scripted(gpt2_phi_dir, scripts):
    return ScriptedBackend(load_backend(gpt2_phi_dir, device="cpu", dtype="float32"), _script_for(scripts))


def test_the_bpe_really_merges_across_the_tags(gpt2_tokenizer):
    toks = gpt2_tokenizer.convert_ids_to_tokens(gpt2_tokenizer("</search><result>")["input_ids"])
    assert "><" in toks
    toks = gpt2_tokenizer.convert_ids_to_tokens(gpt2_tokenizer("</search><search>")["input_ids"])
    assert "><" in toks


@pytest.mark.parametrize("batch_size,prefix_reuse", [("1", True), ("4", True), ("auto", True),
                                                      ("1", False), ("4", False), ("auto", False)])
def test_tool_calls_are_exact_under_gpt2_bpe(scripted, gpt2_phi_dir, scripts, batch_size, prefix_reuse, tmp_path):
    cfg = RunConfig(task="hotpotqa", model=gpt2_phi_dir, data="fixture", task_args={"distractors": 4, "positions": ["first", "last"]},
                    limit=N_QUESTIONS, max_new_tokens=200, device="cpu", dtype="float32", retrieval=True,
                    output=str(tmp_path), batch_size=batch_size, prefix_reuse=prefix_reuse)
    res = run_eval(cfg, backend=scripted, progress=False)
    assert res["counts"]["generated"] == 2 * N_QUESTIONS
    task = HotpotQA(data="fixture")
    task = HotpotQA(data="fixture", distractors=4, positions=["first", "last"])
    instances = {i.key: i for i in task.instances(task.load()[:N_QUESTIONS], seed=cfg.seed, pool_rows=task.load())}
    by_id = {v[0]: v[1:] for v in scripts.values()}
    recs = [json.loads(l) for l in open(tmp_path / "samples.jsonl")]
    assert_varied([r["generation"] for r in recs])
    for rec in recs:
        segments, patterns = by_id[rec["id"]]
        units = instances[rec["key"]].retrieval_units()
        expected = ""
        for seg, pattern in zip(segments, patterns):
            expected += seg[:seg.index("</search>") + len("</search>")] + _expected_result(pattern, units)
        expected += segments[-1]
        assert rec["generation"] == expected, rec["key"]
        assert [c["pattern"] for c in rec["tool_calls"]] == patterns
        assert [f"<result>{c['result']}</result>" for c in rec["tool_calls"]] == \
            [_expected_result(p, units) for p in patterns]
        assert "</search><<result>" not in rec["generation"] and rec["prediction"] == rec["gold"]
        assert rec["finish_reason"] == "eos"
    assert res["metrics"]["first"]["em"] == 1.0 and res["metrics"]["last"]["em"] == 1.0
    # the table says what the tool did: calls per scored row and the rows with at least one
    calls = {c: [len(r["tool_calls"]) for r in recs if r["condition"] == c] for c in ("first", "last")}
    assert sum(calls["first"]) > 0
    header, _, *lines = res["table"].splitlines()
    assert "tool calls/row" in header and "rows with a call" in header
    for c, n in calls.items():
        assert res["metrics"][c]["tool_calls_per_row"] == pytest.approx(sum(n) / len(n))
        assert res["metrics"][c]["rows_with_tool_calls"] == sum(1 for k in n if k)
