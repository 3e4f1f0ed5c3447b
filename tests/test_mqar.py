"""Multi-query associative recall: samples, scoring, the eval engine and the trainer."""
import json
import random

import pytest

from evals import get_task
from evals.base import OptionError
from harness.engine import run_eval
from tests.helpers import assert_varied, run_config


def test_answers_are_the_queried_values_in_order():
    task = get_task("mqar", pairs=8, queries=3, keys=20, values=10)
    rng = random.Random(0)
    for _ in range(200):
        pairs, asked = task.draw(rng)
        assert len({k for k, _ in pairs}) == 8 and len(set(asked)) == 3  # distinct keys, distinct queries
        prompt, answer = task.tokens((pairs, asked))
        table = dict(zip(prompt[1:17:2], prompt[2:17:2]))
        queried = prompt[prompt.index("[SEP]") + 1:prompt.index("[EOS]")]
        assert answer == [table[k] for k in queried]
        text, text_answer = task.text((pairs, asked))
        assert text_answer.split() == [a[1:] for a in answer]
        assert set(prompt + answer) <= set(task.vocabulary())


def test_partial_credit_and_all_correct():
    task = get_task("mqar")
    from evals.base import TextInstance

    ins = TextInstance(id="x", condition="pairs=16", text="q", answer="17 42 3")
    assert task.score(ins, " 17 42 3\nmore")["all_correct"] == 1.0
    got = task.score(ins, " 17, 40, 3")
    assert got["accuracy"] == pytest.approx(2 / 3) and got["all_correct"] == 0.0
    assert task.score(ins, "")["answer_found"] is False


def test_bad_options_name_the_option():
    with pytest.raises(OptionError, match="queries"):
        get_task("mqar", pairs=4, queries=5)
    with pytest.raises(OptionError, match="no option 'depth'"):
        get_task("mqar", depth=3)


def test_runs_through_the_engine_grouped_by_pairs(tiny_phi_dir, phi_backend, tmp_path):
    cfg = run_config(tiny_phi_dir, tmp_path, task="mqar", task_args={"pairs": 6, "queries": 2, "samples": 8},
                     data=None, limit=None, max_new_tokens=None)
    res = run_eval(cfg, backend=phi_backend, progress=False)
    assert list(res["metrics"]) == ["pairs=6"] and res["metrics"]["pairs=6"]["n"] == 8
    recs = [json.loads(l) for l in open(tmp_path / "samples.jsonl")]
    assert_varied([r["prompt"] for r in recs], "prompts")
    assert all(r["prompt"].count("Answer:") == 3 for r in recs)  # two exemplars, then the question
    assert not (tmp_path / "predictions").exists()  # HotpotQA's files belong to HotpotQA


def test_trains_and_evaluates_as_a_trainer_task(tmp_path):
    from harness.training.config import TrainConfig
    from harness.training.data import TrainTask
    from harness.training.trainer import train_one

    cfg = TrainConfig(task="mqar", length=4, arch="transformer", size="smoke", samples=64, batch_size=16, lr=3e-3,
                      warmup=16, eval_samples=8, eval_batch_size=8, report_to="none",
                      output=str(tmp_path / "run")).resolved()
    sample = next(TrainTask(cfg).stream(0))
    assert sample[0] == "[BOS]" and "[EOS]" in sample
    res = train_one(cfg, progress=False)
    assert res["steps"] == 4 and 0.0 <= res["accuracy"] <= 1.0
    saved = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    assert saved["config"]["task"] == "mqar" and saved["config"]["task_args"]["format"] == "tokens"


def test_trainer_task_args_reach_the_task_the_name_and_the_evaluation(tmp_path, capsys):
    """``--task-arg`` sets the task's own options for training: its vocabulary, the run's name and settings, and
    the options the saved checkpoint is evaluated with; "8" from the command line and 8 are one setting."""
    from harness.train import main
    from harness.training.config import TrainConfig
    from harness.training.data import TrainTask

    small = TrainConfig(task="mqar", length=4, size="smoke", task_args={"keys": "8", "values": 8}).resolved()
    default = TrainConfig(task="mqar", length=4, size="smoke").resolved()
    assert small.task_args == {"keys": 8, "values": 8} and small.name == "transformer-smoke-mqar-L4-keys8-values8"
    assert len(TrainTask(small).vocab) < len(TrainTask(default).vocab)  # 5 specials + 8 + 8 against 5 + 64 + 64
    out = tmp_path / "run"
    args = ["--task", "mqar", "--length", "4", "--task-arg", "keys=8", "values=8", "--size", "smoke", "--samples", "32",
            "--batch-size", "16", "--eval-every", "32", "--eval-samples", "8", "--eval-batch-size", "8",
            "--report-to", "none", "--no-progress", "--output", str(out)]
    assert main(args) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["task_args"] == {"keys": 8, "values": 8}
    assert json.loads((out / "icr_task.json").read_text())["args"]["keys"] == 8  # harness.eval --model out uses it
    saved = json.loads((out / "eval" / "results.json").read_text())
    assert saved["config"]["task_args"]["keys"] == 8 and saved["config"]["task_args"]["values"] == 8
    capsys.readouterr()
    assert main([*args[:5], "keys=2", *args[6:-1], str(tmp_path / "bad")]) == 2  # 2 keys cannot hold 4 pairs
    assert "error: --task-arg: need 1 <= queries (4) <= pairs (4) <= keys (2)" in capsys.readouterr().err
    assert main([*args[:5], "keys", *args[6:]]) == 2
    assert "error: --task-arg expects KEY=VALUE, got 'keys'" in capsys.readouterr().err
