"""The shared few-shot prefix, prefilled once and copied into each row, must change nothing."""
import json

import pytest

from harness.backends.base import GenRequest
from harness.backends.generation import common_prefix
from harness.engine import run_eval
from harness.engine.config import RunConfig
from retrieval import RetrievalTool
from tests.helpers import assert_varied
from tests.helpers import UNITS


def test_common_prefix_leaves_every_row_a_suffix():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4, 6]]) == [1, 2, 3]
    assert common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == [1, 2]  # the shorter prompt keeps one token
    assert common_prefix([[1, 2], [3, 4]]) == []


@pytest.mark.parametrize("which", ["phi", "llama", "phi_mamba", "hybrid"])
def test_prefix_reuse_gives_identical_outputs(which, request, tiny_tokenizer):
    backend = request.getfixturevalue(f"{which}_backend")
    from evals.hotpotqa import HotpotQA, load_rows
    from harness.engine.prompting import PromptTemplate
    from tests.helpers import diverse_prompts

    rows = load_rows("fixture")
    (inst,) = HotpotQA(distractors=3, positions=["first"]).instances(rows[:1], seed=0, pool_rows=rows)
    exemplars = PromptTemplate("hotpotqa_cot").render(**inst.template_vars(), shots=4).split("Paragraph: ")
    shots = "Paragraph: ".join(exemplars[:9])  # instruction + the four 2-paragraph exemplars
    prompts = [shots + tail for tail in diverse_prompts(12, seed=2)]  # endings differ, so outputs do
    ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
    shared = common_prefix(ids)
    assert len(shared) > 200  # the four exemplars
    reqs = [GenRequest(p, 12, prompt_ids=i) for p, i in zip(prompts, ids)]
    plain = backend.generate_all(reqs, batch_size=4, prefix_reuse="none")
    plain_results = plain.results(len(reqs))
    reused = backend.generate_all(reqs, batch_size=4, prefix_reuse="batch")
    reused_results = reused.results(len(reqs))
    assert reused.plan.ran == "batch"
    assert_varied([r.token_ids for r in plain_results])
    assert [r.token_ids for r in reused_results] == [r.token_ids for r in plain_results]
    # the prefix was not recomputed per batch
    assert reused.plan.prefill_tokens < plain.plan.prefill_tokens - 2 * len(shared)


def test_prefix_reuse_with_tool_calls(phi_backend):
    from tests.helpers import diverse_prompts

    base = diverse_prompts(1, seed=21)[0]
    prompts = [base + s for s in ("alpha", "beta gamma", "delta")]
    free = phi_backend.generate([GenRequest(p, 20) for p in prompts])

    def reqs():
        return [GenRequest(p, 20, tool=RetrievalTool(UNITS, call_open=f.text[0:2], call_close=f.text[5:8]))
                for p, f in zip(prompts, free)]

    a = phi_backend.generate(reqs())
    b = phi_backend.generate(reqs(), prefix_reuse="batch")
    assert_varied([r.token_ids for r in a])
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert sum(len(r.tool_spans) for r in a) >= 2


def test_engine_run_identical_with_and_without_prefix_reuse(tiny_phi_dir, phi_backend, tmp_path):
    def run(out, reuse):
        cfg = RunConfig(task="hotpotqa", model=tiny_phi_dir, data="fixture", task_args={"distractors": 4, "positions": ["first", "middle"]}, limit=5,
                        max_new_tokens=10, device="cpu", dtype="float32", output=str(out), batch_size="3",
                        prefix_reuse=reuse)
        run_eval(cfg, backend=phi_backend, progress=False)
        return {json.loads(l)["key"]: json.loads(l)["generation"] for l in open(out / "samples.jsonl")}

    a = run(tmp_path / "a", True)
    assert_varied(a.values())
    assert a == run(tmp_path / "b", False)
