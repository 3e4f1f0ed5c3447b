"""Run directories never lose, mix or silently keep stale work (one test per case of issue 10)."""
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from evals.fixture import FIXTURE_PATH
from harness.engine import run_eval
from harness.engine.runlog import ResumeMismatchError, RunLock, RunLockedError
from harness.eval import main as eval_main
from retrieval.search import RegexSearcher
from tests.helpers import alive as _alive
from tests.helpers import run_config

REPO = Path(__file__).resolve().parent.parent


def _cfg(model_dir, out, **kw):
    return run_config(model_dir, out, **{"limit": 4, "max_new_tokens": 8, **kw})


def _lines(out):
    return (out / "samples.jsonl").read_bytes().split(b"\n")


# ------------------------------------------------------------------------------------------------ the lock
def test_a_second_run_into_a_locked_directory_is_refused_naming_the_holder(tiny_phi_dir, tmp_path, capsys):
    with RunLock(tmp_path):
        rc = eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--data", "fixture", "--limit", "2", "--output", str(tmp_path),
                        "--no-progress"])
        assert rc == 2
        err = capsys.readouterr().err
        assert "in use by another run" in err and f"pid {os.getpid()}" in err
    assert not (tmp_path / "samples.jsonl").exists()  # the refused run wrote nothing


@pytest.mark.slow
def test_two_concurrent_processes_lose_no_row(tiny_phi_dir, tmp_path):
    """A long and a short run started together into one directory: one runs, the other is refused; the
    finished run holds every one of its rows."""
    cmd = [sys.executable, "-m", "harness.eval", "--model", tiny_phi_dir, "--task", "hotpotqa", "--data", "fixture", "--distractors", "4",
           "--max-new-tokens", "96", "--device", "cpu", "--no-progress", "--batch-size", "2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        # batch 1 without prefix reuse (neither is part of the run's settings): a long run
        long = subprocess.Popen(cmd + ["--output", str(out), "--limit", "12", "--batch-size", "1", "--no-prefix-reuse"],
                                cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while not (out / ".lock.json").exists() and long.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        # frozen while it holds the lock, so the short run's start-up cannot outlast it on a busy machine (the
        # lock names a live process: a stopped one is alive)
        long.send_signal(signal.SIGSTOP)
        holding = (out / ".lock.json").exists() and not (out / "results.json").exists()
        if holding:
            short = subprocess.run(cmd + ["--output", str(out), "--limit", "4"], cwd=REPO, env=env,
                                   capture_output=True, text=True, timeout=120)
        long.send_signal(signal.SIGCONT)
        assert long.wait(timeout=300) == 0, long.stderr.read()
        if holding:
            break
    else:
        pytest.fail("the long run finished before it could be frozen holding its lock, three times")
    assert short.returncode == 2 and "in use by another run" in short.stderr
    recs = [json.loads(l) for l in _lines(out) if l]
    assert len({r["key"] for r in recs}) == len(recs) == 36
    assert json.loads((out / "results.json").read_text())["counts"]["instances"] == 36


def test_a_lock_left_by_a_killed_run_is_taken_over(tiny_phi_dir, phi_backend, tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from harness.engine.runlog import RunLock
        lock = RunLock({str(tmp_path)!r}).acquire()
        print("locked", flush=True)
        time.sleep(60)""")], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
        run_eval(_cfg(tiny_phi_dir, tmp_path), backend=phi_backend, progress=False)
    holder.kill()
    holder.wait()
    res = run_eval(_cfg(tiny_phi_dir, tmp_path), backend=phi_backend, progress=False)
    assert res["counts"]["generated"] == 8
    assert "took over the lock" in caplog.text
    assert not (tmp_path / ".lock.json").exists()  # released at the end


# ---------------------------------------------------------------------------------------- the resume log
def test_garbage_and_blank_lines_mid_file_delete_no_finished_row(tiny_phi_dir, phi_backend, tmp_path, caplog):
    run_eval(_cfg(tiny_phi_dir, tmp_path), backend=phi_backend, progress=False)
    lines = _lines(tmp_path)
    assert len(lines) == 9 and lines[-1] == b""
    lines[2:2] = [b"{not json at all"]
    lines[5:5] = [b""]
    lines[7:7] = [b'["a", "list"]', b'{"no_key": 1}']
    (tmp_path / "samples.jsonl").write_bytes(b"\n".join(lines))
    res = run_eval(_cfg(tiny_phi_dir, tmp_path), backend=phi_backend, progress=False)
    assert res["counts"]["generated"] == 0 and res["counts"]["resumed"] == 8
    assert "4 unreadable line(s) skipped (line 3, 6, 8, 9)" in caplog.text
    rejected = (tmp_path / "samples.rejected.txt").read_text().splitlines()
    assert rejected == ["samples.jsonl:3: {not json at all", "samples.jsonl:6: ",
                        'samples.jsonl:8: ["a", "list"]', 'samples.jsonl:9: {"no_key": 1}']
    assert len([l for l in _lines(tmp_path) if l]) == 8


def test_a_last_line_cut_inside_a_utf8_character_is_redone(tiny_phi_dir, phi_backend, tmp_path):
    run_eval(_cfg(tiny_phi_dir, tmp_path), backend=phi_backend, progress=False)
    lines = [l for l in _lines(tmp_path) if l]
    last = json.loads(lines[-1])
    last["generation"] = "Fjörðr — 東京"
    cut = json.dumps(last, ensure_ascii=False).encode()
    cut = cut[:cut.index("東".encode()) + 1]  # inside a three-byte character
    with pytest.raises(UnicodeDecodeError):
        cut.decode()
    (tmp_path / "samples.jsonl").write_bytes(b"\n".join(lines[:-1]) + b"\n" + cut)
    res = run_eval(_cfg(tiny_phi_dir, tmp_path), backend=phi_backend, progress=False)
    assert res["counts"]["generated"] == 1 and res["counts"]["resumed"] == 7


def test_an_edited_data_file_is_refused_by_name(tiny_phi_dir, phi_backend, tmp_path):
    data = tmp_path / "data.json"
    rows = json.loads(FIXTURE_PATH.read_text())
    data.write_text(json.dumps(rows))
    out = tmp_path / "run"
    run_eval(_cfg(tiny_phi_dir, out, data=str(data)), backend=phi_backend, progress=False)
    rows[1]["question"] = rows[1]["question"].replace("?", " exactly?")
    data.write_text(json.dumps(rows))
    with pytest.raises(ResumeMismatchError, match="data file changed since this run started"):
        run_eval(_cfg(tiny_phi_dir, out, data=str(data)), backend=phi_backend, progress=False)


def test_a_row_whose_prompt_would_render_differently_is_regenerated(tiny_phi_dir, phi_backend, tmp_path, caplog):
    run_eval(_cfg(tiny_phi_dir, tmp_path), backend=phi_backend, progress=False)
    recs = [json.loads(l) for l in _lines(tmp_path) if l]
    recs[3]["prompt_sha256"] = "0" * 64
    recs[5]["gold"] = "something else"
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = run_eval(_cfg(tiny_phi_dir, tmp_path), backend=phi_backend, progress=False)
    assert res["counts"]["stale_regenerated"] == 2 and res["counts"]["generated"] == 2
    assert "2 finished row(s) were made from a prompt or gold answer that differs" in caplog.text
    fresh = {json.loads(l)["key"]: json.loads(l) for l in _lines(tmp_path) if l}
    assert fresh[recs[3]["key"]]["prompt_sha256"] != "0" * 64 and fresh[recs[5]["key"]]["gold"] != "something else"


def test_rows_of_other_settings_never_mix_even_without_run_json(tiny_phi_dir, phi_backend, tmp_path):
    run_eval(_cfg(tiny_phi_dir, tmp_path, max_new_tokens=8), backend=phi_backend, progress=False)
    (tmp_path / "run.json").unlink()
    with pytest.raises(ResumeMismatchError, match="8 row"):
        run_eval(_cfg(tiny_phi_dir, tmp_path, max_new_tokens=16), backend=phi_backend, progress=False)


def test_two_spellings_of_one_run_are_one_run(tiny_phi_dir, tmp_path, monkeypatch):
    rel = os.path.relpath(tiny_phi_dir, tmp_path)
    out = tmp_path / "run"
    common = ["--data", "fixture", "--limit", "2", "--max-new-tokens", "4", "--output", str(out), "--no-progress"]
    assert eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--dtype", "float32", "--device", "cpu", *common]) == 0
    monkeypatch.chdir(tmp_path)
    assert eval_main(["--model", rel, "--task", "hotpotqa", "--dtype", "auto", "--device", "auto", *common]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["counts"]["resumed"] == 6 and res["counts"]["generated"] == 0
    assert res["resolved"]["dtype"] == "float32" and res["resolved"]["device_type"] == "cpu"
    assert res["resolved"]["model"] == "local folder" and len(res["resolved"]["model_weights"]) == 16


def test_a_failed_first_attempt_does_not_lock_the_directory(tiny_phi_dir, tmp_path, capsys):
    out = str(tmp_path / "run")
    base = ["--data", "fixture", "--limit", "2", "--max-new-tokens", "4", "--output", out, "--no-progress"]
    assert eval_main(["--model", tiny_phi_dir + "-typo", "--task", "hotpotqa", *base]) == 2
    assert eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--template", "no_such_template", *base]) == 2
    assert eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--shots", "10", *base]) == 2
    assert "--shots 10 asks for more" in capsys.readouterr().err
    assert not (tmp_path / "run" / "run.json").exists()
    assert eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", *base]) == 0


def test_duplicate_ids_are_rejected_by_name(tiny_phi_dir, tmp_path, capsys):
    rows = json.loads(FIXTURE_PATH.read_text())[:4]
    rows[2]["_id"] = rows[0]["_id"]
    data = tmp_path / "dup.json"
    data.write_text(json.dumps(rows))
    assert eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--data", str(data), "--distractors", "2", "--output",
                      str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and rows[0]["_id"] in err and "more than once" in err


# ------------------------------------------------------------------------------------------- bad flags
@pytest.mark.parametrize("flags,needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["--max-new-tokens", "-5"], "--max-new-tokens -5"),
    (["--limit", "-1"], "--limit -1"),
    (["--shots", "-1"], "--shots -1"),
    (["--tool-timeout", "0"], "--tool-timeout 0"),
    (["--tool-timeout", "inf"], "--tool-timeout inf"),
    (["--tool-timeout", "nan"], "--tool-timeout nan"),
    (["--max-tool-calls", "-1"], "--max-tool-calls -1"),
    (["--task-arg", "lenght=64"], "has no option 'lenght'"),
    (["--distractors", "0", "--positions", "first"], "--positions first has no effect with --distractors 0"),
    (["--device", "cuda"], "--device 'cuda': no CUDA GPU"),
    (["--device", "tpu9"], "--device 'tpu9'"),
    (["--batch-size", "0"], "--batch-size '0'"),
    (["--cuda-graphs", "on"], "--cuda-graphs 'on': CUDA graphs need a CUDA device"),
    (["--cuda-graphs", "compiled"], "--cuda-graphs 'compiled': CUDA graphs need a CUDA device"),
])
def test_each_bad_flag_is_named_before_anything_is_written(tiny_phi_dir, tmp_path, capsys, flags, needle):
    out = tmp_path / "o"
    rc = eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--data", "fixture", "--limit", "2", "--output", str(out), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and needle in err, err
    assert "Traceback" not in err and not (out / "run.json").exists()


def test_broken_checkpoints_data_and_selections_are_error_lines(tiny_phi_dir, tmp_path, capsys):
    import shutil

    def run(model, *flags):
        rc = eval_main(["--model", str(model), "--task", "hotpotqa", "--limit", "2", "--output", str(tmp_path / "o"), *flags])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and "Traceback" not in err, err
        return err

    bad_cfg = tmp_path / "bad_cfg"
    shutil.copytree(tiny_phi_dir, bad_cfg)
    (bad_cfg / "config.json").write_text('{"model_type": "phi", ')
    assert "config.json is not valid JSON" in run(bad_cfg, "--data", "fixture")
    cut = tmp_path / "cut_weights"
    shutil.copytree(tiny_phi_dir, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    assert str(cut) in run(cut, "--data", "fixture") and "model.safetensors" in run(cut, "--data", "fixture")
    rows = json.loads(FIXTURE_PATH.read_text())[:3]
    rows[1]["question"] = "Where is \ud800 the town?"
    data = tmp_path / "surrogate.json"
    data.write_text(json.dumps(rows))  # json escapes the lone surrogate as \\ud800
    err = run(tiny_phi_dir, "--data", str(data), "--distractors", "2")
    assert "row 1" in err and "'question'" in err and "invalid character" in err
    empty = tmp_path / "ids.txt"
    empty.write_text("")
    assert "selection is empty" in run(tiny_phi_dir, "--data", "fixture", "--ids", str(empty))


# ----------------------------------------------------------------------------------- outputs and reruns
def test_a_narrower_rerun_drops_stale_prediction_files_and_reports_its_own_selection(tiny_phi_dir, phi_backend,
                                                                                       tmp_path):
    from harness.reports.runs import merge

    run_eval(_cfg(tiny_phi_dir, tmp_path, limit=6), backend=phi_backend, progress=False)
    assert sorted(p.name for p in (tmp_path / "predictions").iterdir()) == ["first.json", "last.json"]
    res = run_eval(_cfg(tiny_phi_dir, tmp_path, limit=4, positions=["first"]), backend=phi_backend, progress=False)
    assert sorted(p.name for p in (tmp_path / "predictions").iterdir()) == ["first.json"]
    assert res["metrics"]["first"]["n"] == 4
    df = merge([str(tmp_path)])
    assert list(df["condition"]) == ["first"] and list(df["n"]) == [4]  # not the 12 rows samples.jsonl holds


def test_every_position_gets_a_prediction_file_even_when_all_are_skipped(tiny_tokenizer, tmp_path):
    from harness.backends.loading import load_backend
    from harness.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "short", "phi", tokenizer=tiny_tokenizer, max_positions=512)
    res = run_eval(_cfg(str(model), tmp_path / "o", distractors=8, positions=["first", "last"], max_new_tokens=8),
                   backend=load_backend(str(model), device="cpu", dtype="float32"), progress=False)
    assert res["metrics"]["first"]["n"] == 0 and res["metrics"]["first"]["skipped"] == 4
    pred = json.loads((tmp_path / "o" / "predictions" / "first.json").read_text())
    assert pred == {"answer": {}, "sp": {}}
    assert math.isnan(res["metrics"]["first"]["em"]) and res["metrics"]["first"]["em_skipped_as_0"] == 0.0


# ------------------------------------------------------------------------------------------ regex workers
_WORKER_SCRIPT = textwrap.dedent("""
    import sys, time
    from retrieval.search import RegexSearcher
    s = RegexSearcher(timeout=30)
    assert s.search("a", ["a"]).status == "ok"
    print(s.worker_pids()[0], flush=True)
    if sys.argv[1] == "busy":
        s.search("(a+)+$", ["a" * 64 + "!"])  # stuck in a catastrophic backtrack in the worker
    time.sleep(60)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig,state", [(signal.SIGKILL, "idle"), (signal.SIGKILL, "busy"), (signal.SIGTERM, "busy")])
def test_the_regex_worker_dies_with_the_eval(sig, state):
    parent = subprocess.Popen([sys.executable, "-c", _WORKER_SCRIPT, state], cwd=REPO, stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    time.sleep(0.3)
    assert _alive(worker)
    parent.send_signal(sig)
    parent.wait(timeout=10)
    deadline = time.time() + 5
    while _alive(worker) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), f"worker {worker} outlived its parent"


def test_a_worker_killed_mid_search_gives_an_error_result_and_a_fresh_worker():
    searcher = RegexSearcher(timeout=600)  # a result other than "timeout" proves the death was seen, not waited out
    assert searcher.search("a", ["a"]).status == "ok"
    pid = searcher.worker_pids()[0]
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    out = searcher.search("(a+)+$", ["a" * 64 + "!"])
    assert out.status == "error" and "died mid-search" in out.error
    assert searcher.search("a+!", ["aa!"]).status == "ok" and searcher.worker_pids()[0] != pid
    searcher.close()


def test_eight_rows_timing_out_in_one_step_search_side_by_side(phi_backend):
    """The eight searches of one decoding step run in eight workers at once (what makes eight timeouts cost one
    timeout of wall time; benchmarks/retrieval_resume.py times it): each is cut by the timeout, each in a worker
    of its own, and every row reads the timeout and goes on."""
    from harness.backends.base import GenRequest
    from retrieval import RetrievalTool
    from tests.helpers import ScriptedBackend

    prompts = [f"Question {i}: where is it?" for i in range(8)]
    script = {p: ["<search>(a+)+$</search>", " done"] for p in prompts}
    backend = ScriptedBackend(phi_backend, lambda prompt: script.get(prompt))
    searcher = RegexSearcher(timeout=2.0)
    busy, seen = set(), []
    real_search = searcher.search

    def watched(pattern, units, *args, **kw):  # the workers busy while this search starts
        busy.add(threading.get_ident())
        seen.append(len(busy))
        try:
            return real_search(pattern, units, *args, **kw)
        finally:
            busy.discard(threading.get_ident())

    searcher.search = watched
    tools = [RetrievalTool(["a" * 64 + "!"], searcher=searcher) for _ in prompts]
    results = backend.generate([GenRequest(p, 40, tool=t) for p, t in zip(prompts, tools)])
    assert [t.log[0]["status"] for t in tools] == ["timeout"] * 8
    assert all(r.text.endswith("<result>[timeout]</result> done") for r in results)
    assert max(seen) == 8, f"at most {max(seen)} searches ran at once: they ran one after another"
    searcher.close()
