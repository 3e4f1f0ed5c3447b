import re

import pytest
import torch

from evals.base import ToolSpec
from harness.backends.base import GenRequest
from harness.engine.prompting import PromptTemplate
from retrieval import RegexSearcher, RetrievalTool, parse_call
from tests.helpers import UNITS, assert_varied


@pytest.mark.parametrize("segment,pattern,error", [
    ("think <search>Karvell</search>", "Karvell", None),
    ("<search>a<search>b</search>", "b", None),  # nested: the innermost (last) opening wins
    ("<search>first</search> then <search>second</search>", "second", None),
    ("<search></search>", None, "empty pattern"),
    ("<search>   </search>", None, "empty pattern"),
    ("no call </search>", None, "without an opening"),
    ("<search>unclosed", None, "no </search>"),
])
def test_parse_call(segment, pattern, error):
    p, e = parse_call(segment)
    assert p == pattern
    assert (e is None) if error is None else (error in e)


def test_matching_uses_re_search_semantics_and_order():
    tool = RetrievalTool(UNITS, max_matches=3)
    assert tool("<search>town in the north</search>") == f"<result>{UNITS[1]} | {UNITS[3]}</result>"
    assert tool(r"<search>founded in \d{4}</search>") == f"<result>{UNITS[2]}</result>"
    assert tool("<search>^Pellin</search>") == f"<result>{UNITS[3]}</result>"  # anchored at a unit's start
    assert tool("<search>(?i)OSTLAND</search>") == f"<result>{UNITS[0]}</result>"
    assert tool("<search>Zanzibar</search>") == "<result>[no match]</result>"
    assert [c["status"] for c in tool.log] == ["ok", "ok", "ok", "ok", "no_match"]
    expected = [u for u in UNITS if re.search("n", u)][:2]
    assert RetrievalTool(UNITS, max_matches=2)("<search>n</search>") == f"<result>{' | '.join(expected)}</result>"


def test_the_in_process_searcher_answers_as_the_workers_do():
    """IsTree's tool searches in its own process (its patterns come from a closed grammar); every outcome there
    equals the killable workers' one: statuses, matching units, captured groups, refusals."""
    from retrieval.search import CAPTURE, InProcessSearcher

    here, workers = InProcessSearcher(), RegexSearcher(timeout=5)
    edges = ["0 - 1 2 - 0 1 - 3 3 - 4"]
    cases = [("town in the north", UNITS, 3), ("n", UNITS, 2), ("^Pellin", UNITS, 0), ("Zanzibar", UNITS, 0),
             (r"(?:^| )(?:1 - (\d+)|(\d+) - 1)(?= |$)", edges, CAPTURE), (r"(?:^| )3 - (\d+)(?= |$)", edges, CAPTURE),
             (r"9 - (\d+)", edges, CAPTURE), ("[z-a]", UNITS, 0), ("", UNITS, 0), ("x" * 600, UNITS, 0)]
    seen = []
    for pattern, units, k in cases:
        a, b = here.search(pattern, units, k), workers.search(pattern, units, k)
        assert (a.status, a.matches, a.error) == (b.status, b.matches, b.error), pattern
        seen.append((a.status, tuple(a.matches), a.error))
    assert len(set(seen)) >= 8 and {s for s, _, _ in seen} == {"ok", "no_match", "error"}  # outcomes that vary
    workers.close()


def test_result_is_capped():
    tool = RetrievalTool(UNITS, max_chars=40)
    out = tool("<search>.</search>")
    body = out[len("<result>"):-len("</result>")]
    assert len(body) == 40 and body.endswith("...")


def test_invalid_and_empty_patterns_return_readable_errors():
    tool = RetrievalTool(UNITS)
    assert tool("<search>(unclosed</search>").startswith("<result>[error: invalid pattern: missing )")
    assert tool("<search>[z-a]</search>").startswith("<result>[error: invalid pattern")
    assert tool("<search></search>") == "<result>[error: empty pattern]</result>"
    assert [c["status"] for c in tool.log] == ["error", "error", "error"]


def test_catastrophic_backtracking_is_stopped_by_the_timeout():
    searcher = RegexSearcher(timeout=0.5)
    units = ["a" * 40 + "!"]
    out = searcher.search("(a+)+$", units)
    assert out.status == "timeout"  # cut by the limit (40 a's backtrack for minutes)
    pid = searcher.worker_pids()
    # the stuck worker was replaced: the next search works in a fresh one
    assert searcher.search("a+!", units).status == "ok"
    assert searcher.worker_pids() != pid or not pid
    tool = RetrievalTool(units, searcher=searcher)
    assert tool("<search>(a+)+$</search>") == "<result>[timeout]</result>"
    searcher.close()


def test_worker_never_uses_another_tools_units():
    a = RetrievalTool(["alpha one"])
    b = RetrievalTool(["beta two"])
    assert a("<search>one|two</search>") == "<result>alpha one</result>"
    assert b("<search>one|two</search>") == "<result>beta two</result>"
    assert a("<search>one|two</search>") == "<result>alpha one</result>"


def test_retrieval_template_exemplar_results_are_what_the_tool_returns():
    tpl = PromptTemplate("hotpotqa_cot_retrieval")
    text = tpl.render(shots=4, paragraphs=[], question="", tool=ToolSpec(enabled=True).template_vars())
    assert "_hotpotqa_exemplars.j2" in tpl.includes  # the exemplars both HotpotQA templates share
    checked = 0
    for ex in tpl._env.get_template("_hotpotqa_exemplars.j2").module.exemplars:
        units = [f"{title}: {s.strip()}" for title, sents in ex["paragraphs"] for s in sents]
        tool = RetrievalTool(units)
        for pattern, result, _ in ex["steps"]:
            call = f"<search>{pattern}</search>"
            assert tool(call) == f"<result>{result}</result>"
            assert call + f"<result>{result}</result>" in text  # the rendered prompt shows exactly that
            checked += 1
    assert checked >= 6


# ------------------------------------------------------------------------ integration with a real model
def _free_text(backend, prompt, n=24):
    return backend.generate([GenRequest(prompt, n)])[0]


def _last_logits(model, ids):
    out = model(input_ids=torch.tensor([ids]))
    return (out.logits if hasattr(out, "logits") else out[0])[0, -1]  # transformers, or Phi-Mamba's (logits, state)


@pytest.mark.parametrize("which", ["phi", "llama", "phi_mamba", "hybrid"])
def test_tool_loop_resumes_from_cache_exactly(which, request):
    """A random model never writes <search>, so the call tags are taken from text it does write; the search,
    insertion and resume are all real. The continuation after each inserted result must equal greedy decoding
    by full forward passes over prompt + everything so far (no cache)."""
    backend = request.getfixturevalue(f"{which}_backend")
    from tests.helpers import diverse_prompts

    prompts = diverse_prompts(4, seed=11)
    reqs, tools = [], []
    for i, p in enumerate(prompts):
        text = _free_text(backend, p).text
        tool = None
        if i != 2:  # row 2 never calls: it must not be disturbed by the others' insertions
            tool = RetrievalTool(UNITS, max_calls=2, call_open=text[0:2], call_close=text[5:8])
        tools.append(tool)
        reqs.append(GenRequest(p, 24, tool=tool))
    results = backend.generate(reqs)
    assert_varied([r.text for r in results])
    called = 0
    with torch.inference_mode():
        for p, r, tool in zip(prompts, results, tools):
            prompt_ids = backend.tokenizer(p)["input_ids"]
            forced = {j for a, b in r.tool_spans + r.retokenized_spans for j in range(a, b)}
            for j, tok in enumerate(r.token_ids):
                if j in forced:
                    continue
                logits = _last_logits(backend.model, prompt_ids + r.token_ids[:j])
                assert tok == int(logits.argmax()), f"token {j} differs from an uncached greedy pass"
            if tool is not None:
                assert len(tool.log) == len(r.tool_spans) >= 1
                called += len(tool.log)
            else:
                assert r.tool_spans == []
    assert called >= 3


def test_engine_counts_tool_calls_per_position(tiny_phi_dir, phi_backend, tmp_path):
    import json

    from harness.engine import run_eval
    from harness.engine.config import RunConfig

    cfg = RunConfig(task="hotpotqa", model=tiny_phi_dir, data="fixture", task_args={"distractors": 3, "positions": ["first", "last"]}, limit=3,
                    max_new_tokens=8, device="cpu", dtype="float32", output=str(tmp_path), retrieval=True,
                    stop=[])
    res = run_eval(cfg, backend=phi_backend, progress=False)
    assert res["config"]["template"] == "hotpotqa_cot_retrieval"
    recs = [json.loads(l) for l in open(tmp_path / "samples.jsonl")]
    assert all("tool_calls" in r for r in recs)
    for pos in ("first", "last"):
        m = res["metrics"][pos]
        calls = [c for r in recs if r["condition"] == pos for c in r["tool_calls"]]
        assert m["tool_calls"] == len(calls)
        assert m["tool_ok"] + m["tool_no_match"] + m["tool_error"] + m["tool_timeout"] == len(calls)


class _EveryToken:
    """A tool 'called' after every model token (empty closing tag), that records what it was given."""

    call_end = ""
    max_calls = 10_000

    def __init__(self):
        self.seen = []

    def __call__(self, generated: str, start: int = 0) -> str:
        self.seen.append(generated)
        return "!"


def test_tool_gets_the_whole_generation_and_length_still_bounds_a_tool_happy_model(phi_backend):
    from tests.helpers import diverse_prompts

    tool = _EveryToken()
    (r,) = phi_backend.generate([GenRequest(diverse_prompts(1, seed=4)[0], 7, tool=tool)])
    assert r.finish_reason == "length" and r.new_tokens == 7
    assert len(tool.seen) == 6  # a call after each model token but the last
    for a, b in zip(tool.seen, tool.seen[1:]):
        assert b.startswith(a) and b.endswith("!") and len(b) > len(a)  # everything so far, results included
    assert tool.seen[-1].count("!") == 5
    assert r.text.count("!") == 6


def test_a_call_is_parsed_only_from_text_written_since_the_previous_result():
    tool = RetrievalTool(UNITS)
    text = "<search>Karvell</search><result>Karvell: x</result> then ^Pellin</search>"
    start = text.index("</result>") + len("</result>")
    assert tool(text, start) == "<result>[error: </search> without an opening <search>]</result>"
    assert tool(text) != tool(text, start)  # parsed across the result, the pattern would swallow it
    assert tool.log[0]["pattern"] is None and "</result>" in tool.log[1]["pattern"]
