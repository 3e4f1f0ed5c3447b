"""Phonebook needle-in-a-haystack: lengths in the model's tokens, needle depth, the engine and the CLI."""
import json

from evals import get_task
from harness.engine import run_eval
from harness.eval import main as eval_main
from tests.helpers import run_config


def _instances(tok, **opts):
    task = get_task("needle", tokenizer=tok, **opts)
    return task, task.instances(task.load(), seed=0)


def test_books_fill_each_length_in_tokens_with_the_needle_at_its_depth(tiny_tokenizer):
    """The entry asked for sits at its depth; a sample's book is one text at every depth and a prefix of its
    longer books (what lets the prefix tree read each book once)."""
    task, inst = _instances(tiny_tokenizer, lengths=[64, 256], depths=[0, 0.5, 1], samples=3)
    assert len(inst) == 3 * 2 * 3
    for ins in inst:
        length = int(ins.condition.split("@")[0])
        n_tokens = len(tiny_tokenizer(ins.text, add_special_tokens=False)["input_ids"])
        assert n_tokens == ins.meta["context_tokens"] and length - 20 <= n_tokens <= length + 1
        lines = ins.text.split("\n")
        hit = [i for i, l in enumerate(lines) if l == f"{ins.meta['name']}: {ins.answer}"]
        depth = float(ins.condition.split("@")[1])
        assert hit == [round(depth * (len(lines) - 1))]  # once, where the depth says
        assert ins.text.count(f"{ins.meta['name']}:") == 1
        ((needle, label),) = task.evidence(ins)  # what the HTML report marks: the needle's own entry
        assert lines[hit[0]] == needle and label == f"needle: entry {hit[0] + 1} of {len(lines)}"
    by = {(i.id, i.condition): i for i in inst}
    short, long = by[("needle0000", "64@1")], by[("needle0000", "256@1")]
    assert long.text.startswith(short.text + "\n")  # the same entries, a longer book
    assert by[("needle0000", "64@0")].text == short.text  # one book at every depth
    assert len({(i.id, i.answer) for i in inst if i.condition.startswith("256@")}) == 3 * 3  # the depths ask apart


def test_scores_the_number_only():
    task = get_task("needle")
    from evals.base import TextInstance

    ins = TextInstance(id="x", condition="64@0", text="book", answer="512-0042")
    assert task.score(ins, " 512-0042.")["accuracy"] == 1.0
    assert task.score(ins, " call 512-0043")["accuracy"] == 0.0
    assert task.score(ins, " nobody")["answer_found"] is False


def test_sweep_through_the_engine_and_the_cli(tiny_phi_dir, phi_backend, tmp_path):
    cfg = run_config(tiny_phi_dir, tmp_path / "a", task="needle",
                     task_args={"lengths": [48, 96], "depths": [0.0, 1.0], "samples": 3}, data=None, limit=None,
                     max_new_tokens=None)
    res = run_eval(cfg, backend=phi_backend, progress=False)
    assert list(res["metrics"]) == ["48@0", "48@1", "96@0", "96@1"]
    assert all(m["n"] == 3 for m in res["metrics"].values())
    recs = [json.loads(l) for l in open(tmp_path / "a" / "samples.jsonl")]
    assert all(r["context_tokens"] <= int(r["condition"].split("@")[0]) + 1 for r in recs)
    rc = eval_main(["--model", tiny_phi_dir, "--task", "needle", "--task-arg", "lengths=48", "--task-arg",
                    "depths=0.5", "--task-arg", "samples=2", "--device", "cpu", "--output", str(tmp_path / "b"),
                    "--no-progress"])
    assert rc == 0
    assert list(json.loads((tmp_path / "b" / "results.json").read_text())["metrics"]) == ["48@0.5"]


def test_hotpotqa_flags_are_refused_for_other_tasks(tiny_phi_dir, tmp_path, capsys):
    rc = eval_main(["--model", tiny_phi_dir, "--task", "needle", "--distractors", "3", "--output", str(tmp_path)])
    assert rc == 2 and "--distractors is an option of hotpotqa, not of task 'needle'" in capsys.readouterr().err


def test_a_length_too_short_for_one_entry_is_refused(tiny_tokenizer):
    import pytest

    from evals.base import OptionError

    with pytest.raises(OptionError, match="lengths=16: a phone-book entry takes .* give longer lengths"):
        _instances(tiny_tokenizer, lengths=[16, 64], samples=1)


def test_long_context_books_are_drawn_in_bounded_time_and_too_long_ones_refused(tiny_tokenizer):
    """Past the 8,800 "First I. Last" names a book draws names with a second initial: a 36,000-token book (it
    once spun forever) and longer are built, every name distinct; beyond the names there are, one error line."""
    import pytest

    from evals.base import OptionError
    from evals.needle import PLAIN_NAMES, Needle

    task, inst = _instances(tiny_tokenizer, lengths=[2000, 36000], depths=[0.0, 1.0], samples=1)
    long = next(i for i in inst if i.condition == "36000@1")
    names = [line.split(":")[0] for line in long.text.split("\n")]
    assert len(set(names)) == len(names)  # (the book drawn held 36000 // 4 + 16 > 8,800 entries: it once spun)
    assert 36000 - 20 <= long.meta["context_tokens"] <= 36001
    assert long.text.startswith(next(i for i in inst if i.condition == "2000@0").text)  # still a prefix
    book = Needle._book("needle-eval:x", 130_000 // 4)  # a 128k-token book's entries
    assert len({n for n, _ in book}) == len(book) > PLAIN_NAMES
    assert book[:100] == Needle._book("needle-eval:x", 100)  # the same first entries for any length
    with pytest.raises(OptionError, match="lengths=1000000: the phone book has .* give shorter lengths"):
        get_task("needle", lengths=[1_000_000])
