"""The edges a demanding user meets: reports that never merge two runs under one label or crash on legitimate
runs, files that are strict JSON and never left half-written, options refused with the flag named, data
errors that name the line, and generators that finish. One test per class."""
import json
import logging
import os
import subprocess
import sys

import pytest

from evals import get_task
from evals.base import DataError, OptionError
from harness.engine import run_eval
from harness.engine.runlog import RunLock, SampleLog
from harness.files import write_atomic
from harness.eval import main as eval_main
from harness.report import main as report_main
from harness.reports.runs import merge
from tests.helpers import run_config


def _run(model_dir, backend, out, **kw):
    kw = {"limit": 3, "max_new_tokens": 6, "batch_size": "8", **kw}
    return run_eval(run_config(model_dir, out, **kw), backend=backend, progress=False)


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def test_runs_that_differ_in_any_result_deciding_setting_never_share_a_label(tiny_phi_dir, phi_backend, tmp_path):
    """Two folders of one name (a/run, b/run) whose runs differ only in --limit and --tool-max-chars."""
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    _run(tiny_phi_dir, phi_backend, a, limit=2)
    _run(tiny_phi_dir, phi_backend, b, limit=3, tool_max_chars=100)
    df = merge([str(a), str(b)])
    labels = df.groupby("dir")["run"].first()
    assert labels[str(a)] != labels[str(b)] and "limit=2" in labels[str(a)] and "tool_max_chars=100" in labels[str(b)]
    same = merge([str(a), str(a)])  # even one folder given twice is two lines, not one
    assert same["run"].nunique() == 2


def test_results_files_are_strict_json_where_a_standard_error_is_undefined(tiny_phi_dir, phi_backend, tmp_path):
    out = tmp_path / "mqar"
    res = run_eval(run_config(tiny_phi_dir, out, task="mqar", data=None, task_args={"pairs": [4, 6], "samples": 1},
                              limit=None, max_new_tokens=6), backend=phi_backend, progress=False)
    assert all(m["n"] == 1 for m in res["metrics"].values())  # one row per condition: no standard error
    saved = _strict((out / "results.json").read_text())
    assert all(m["accuracy_se"] is None for m in saved["metrics"].values())
    for f in (out / "lm_eval").rglob("results_*.json"):
        _strict(f.read_text())


def test_reports_of_legitimate_runs_never_crash_and_replace_their_own_files(tiny_phi_dir, phi_backend, tmp_path,
                                                                             capsys):
    mqar, hot = tmp_path / "mqar", tmp_path / "hot"
    run_eval(run_config(tiny_phi_dir, mqar, task="mqar", data=None, task_args={"pairs": [4], "samples": 1},
                        limit=None, max_new_tokens=6), backend=phi_backend, progress=False)
    _run(tiny_phi_dir, phi_backend, hot)
    rep = tmp_path / "rep"
    assert report_main([str(hot), "--out", str(rep)]) == 0
    first = {p.name for p in rep.glob("*.png")}
    (rep / "notes.txt").write_text("mine")
    assert report_main([str(mqar), "--metric", "accuracy", "--out", str(rep)]) == 0  # one row per condition
    now = {p.name for p in rep.glob("*.png")}
    assert first and now and not first & now  # the first report's figures are gone, the new ones there
    assert (rep / "notes.txt").read_text() == "mine"  # what the user keeps there stays
    (tmp_path / "afile").write_text("x")
    capsys.readouterr()
    for bad in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert report_main([str(hot), "--out", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --out {bad}") and "Traceback" not in err


def test_a_subset_whose_oracle_rows_were_all_skipped_is_an_error_line(tiny_phi_dir, phi_backend, tmp_path, capsys):
    oracle, run = tmp_path / "oracle", tmp_path / "run"
    _run(tiny_phi_dir, phi_backend, oracle, distractors=0, max_new_tokens=100_000)  # nothing fits the context
    _run(tiny_phi_dir, phi_backend, run)
    assert report_main([str(run), "--subset", str(oracle), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --subset: every row of") and "Traceback" not in err


def test_paths_a_run_records_resolve_from_any_folder(tiny_phi_dir, phi_backend, tmp_path, monkeypatch):
    from evals.hotpotqa import load_rows

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "dev.json").write_text(json.dumps(load_rows("fixture")))
    monkeypatch.chdir(work)
    _run(tiny_phi_dir, phi_backend, "run", data="dev.json")  # relative --data and --output
    saved = json.loads((work / "run" / "results.json").read_text())["config"]
    assert saved["data"] == str(work / "dev.json") and saved["output"] == str(work / "run")
    monkeypatch.chdir(elsewhere)
    assert report_main([str(work / "run"), "--official-gold", "gold", "--out", "rep"]) == 0
    assert list((elsewhere / "gold").rglob("*.json"))


def test_an_atomic_write_that_fails_leaves_no_temp_file_and_dead_writers_temps_are_cleared(tmp_path):
    with pytest.raises(UnicodeEncodeError):
        write_atomic(tmp_path / "results.json", "\ud800")  # fails inside the write, as a full disk would
    assert list(tmp_path.iterdir()) == []
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f".samples.jsonl.{dead.pid}.tmp"
    mine = tmp_path / f".table.md.{os.getpid()}.tmp"
    left.write_text("half")
    mine.write_text("being written")
    with RunLock(tmp_path):
        pass
    assert not left.exists() and mine.exists()  # a live writer's temp file is never touched


def test_a_rejected_line_is_recorded_once_and_a_conflicting_duplicate_row_is_named(tmp_path, caplog):
    row = {"key": "q1@first", "config_hash": "h", "prompt_sha256": "p", "gold": "x", "scores": {"em": 0.0}}
    other = dict(row, scores={"em": 1.0})
    (tmp_path / "samples.jsonl").write_text(json.dumps(row) + "\n{not json\n")
    for _ in range(3):  # a merge whose rewrite failed leaves the bad line in place: it is tried again
        SampleLog(tmp_path).merge(["q1@first"], "h")
        with open(tmp_path / "samples.jsonl", "a") as fh:
            fh.write("{not json\n")
    assert (tmp_path / "samples.rejected.txt").read_text().count("{not json") == 1
    (tmp_path / "samples.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(other) + "\n")
    with caplog.at_level(logging.WARNING, logger="harness"):
        log = SampleLog(tmp_path, read_only=True)
    assert log.records["q1@first"]["scores"] == {"em": 1.0}
    assert "'q1@first' appears again at line 2" in caplog.text
    caplog.clear()
    stale = dict(other, prompt_sha256="new")  # a stale row regenerated: expected, no warning
    (tmp_path / "samples.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(stale) + "\n")
    with caplog.at_level(logging.WARNING, logger="harness"):
        SampleLog(tmp_path, read_only=True)
    assert "appears again" not in caplog.text


@pytest.mark.parametrize("task,args,flag", [
    ("mqar", {"shots": -1}, "shots=-1"), ("index", {"shots": "-1"}, "shots=-1"), ("counting", {"samples": 0}, "samples"),
    ("needle", {"lengths": "64,64"}, "lengths=64,64"), ("mqar", {"pairs": "4,4"}, "pairs=4,4"),
    ("needle", {"depths": "-0.5"}, "depths"),
])
def test_task_options_out_of_range_or_repeated_are_refused_naming_the_flag(task, args, flag):
    with pytest.raises(OptionError, match=f"--task-arg {flag}"):
        get_task(task, **args)


def test_task_arg_given_twice_or_in_conflict_is_an_error_line(tiny_phi_dir, tmp_path, capsys):
    base = ["--model", tiny_phi_dir, "--task", "mqar", "--output", str(tmp_path / "r"), "--device", "cpu"]
    assert eval_main(base + ["--task-arg", "pairs=4", "--task-arg", "pairs=8"]) == 2
    assert "--task-arg pairs is given twice (4 and 8)" in capsys.readouterr().err
    assert eval_main(base + ["--task-arg", "length=8", "--task-arg", "pairs=16"]) == 2
    assert "length=8 and pairs=16 disagree" in capsys.readouterr().err
    assert get_task("mqar", length=8).options.pairs == 8 and get_task("mqar", length=8).options.length is None


def test_data_errors_name_the_line_and_the_cause(tiny_phi_dir, phi_backend, tmp_path, caplog):
    from evals.hotpotqa import load_rows

    rows = load_rows("fixture")[:5]
    bad = tmp_path / "dev.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + '{"_id": "x", oops}\n')
    with pytest.raises(DataError, match=r"dev.jsonl, line 4: not valid JSON"):
        load_rows(str(bad))
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(DataError, match="the data holds no rows"):
        _run(tiny_phi_dir, phi_backend, tmp_path / "e", data=str(empty))
    rows[1]["supporting_facts"] = []  # no gold paragraph: no position to place it at
    with caplog.at_level(logging.WARNING, logger="harness"):
        inst = get_task("hotpotqa", distractors=2, positions=["first", "last"]).instances(rows, seed=0)
    assert {i.id for i in inst} == {r["_id"] for r in rows} - {rows[1]["_id"]}
    assert "no supporting facts" in caplog.text and rows[1]["_id"] in caplog.text


def test_a_grid_report_leaves_out_a_cut_result_and_names_it(tmp_path, caplog):
    from harness.training.grid import write_grid_report

    (tmp_path / "cell").mkdir()
    (tmp_path / "cell" / "result.json").write_text('{"task": "istree", "arch": "mam')
    with caplog.at_level(logging.WARNING, logger="harness"):
        assert write_grid_report(tmp_path) == ""
    assert "cell/result.json is not a readable result" in caplog.text


def test_the_demo_refuses_repeated_lengths(tmp_path, capsys):
    from harness.demo import main as demo_main

    assert demo_main(["--lengths", "4,4", "--out", str(tmp_path / "d")]) == 2
    assert "distinct lengths" in capsys.readouterr().err and not (tmp_path / "d").exists()
