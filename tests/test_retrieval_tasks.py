import random

import pytest

from evals.retrieval_tasks import RETRIEVAL_TASKS, TASK_NAMES, WORDS


@pytest.mark.parametrize("name", TASK_NAMES)
def test_generated_answers_are_right(name):
    task = RETRIEVAL_TASKS[name](length=24, symbols=12)
    rng = random.Random(0)
    for _ in range(300):
        d = task.draw(rng)
        if name == "index":
            assert d.answer == d.seq[d.query[0]]
        elif name == "ar":
            keys = d.seq[0::2]
            assert len(set(keys)) == len(keys) and d.seq[keys.index(d.query[0]) * 2 + 1] == d.answer
        elif name == "cgram":
            grams = [d.seq[t:t + 2] for t in range(len(d.seq) - 1)]
            assert grams.count(d.query) == 1
            at = grams.index(d.query)
            assert at + 2 < len(d.seq) + 1 and d.seq[at + 2] == d.answer
        else:
            assert d.answer == d.seq.count(d.query[0]) >= 1


def test_token_and_text_formats():
    task = RETRIEVAL_TASKS["ar"](length=8, symbols=6)
    d = task.draw(random.Random(1))
    prompt, answer = task.tokens(d)
    assert prompt[0] == "[BOS]" and prompt[-1] == "[EOS]" and "[SEP]" in prompt and answer[0] in task.vocabulary()
    text, word = task.text(d)
    assert text.startswith("Pairs: ") and text.endswith("Answer:") and word in WORDS
    samples = next(task.stream(0))
    assert samples[-1] in task.vocabulary()


@pytest.mark.parametrize("name", TASK_NAMES)
def test_text_tasks_run_through_the_eval_engine(name, tiny_phi_dir, phi_backend, tmp_path):
    import json

    from harness.engine import run_eval
    from harness.engine.config import RunConfig

    cfg = RunConfig(model=tiny_phi_dir, task=name, task_args={"samples": 6, "length": 12, "shots": 2},
                    device="cpu", dtype="float32", output=str(tmp_path), batch_size="6")
    res = run_eval(cfg, backend=phi_backend, progress=False)
    assert res["metrics"]["L=12"]["n"] == 6
    rec = json.loads(open(tmp_path / "samples.jsonl").readline())
    assert rec["prompt"].count("Answer:") == 3  # two exemplars with answers, then the question
    assert rec["scores"]["accuracy"] in (0.0, 1.0)
