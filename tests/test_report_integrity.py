"""A report replaces the previous one only once it is whole: a damaged row, an odd name, a full disk or Ctrl-C ends
in one `error:` or `interrupted:` line with the old report's files byte for byte as they were (real processes,
real write limits and signals)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.engine import run_eval
from harness.report import main as report_main
from tests.helpers import ctrl_c_reaches, run_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def made(tiny_phi_dir, phi_backend, tmp_path_factory):
    """One real run and a report of it, made once; tests copy them."""
    base = tmp_path_factory.mktemp("integrity")
    run = base / "run"
    run_eval(run_config(tiny_phi_dir, run, limit=4, max_new_tokens=6, distractors=2, positions=["first", "last"]),
             backend=phi_backend, progress=False)
    assert report_main([str(run), "--out", str(base / "report")]) == 0
    return base


def _copy(made, tmp_path):
    import shutil

    shutil.copytree(made / "run", tmp_path / "run")
    shutil.copytree(made / "report", tmp_path / "report")
    return tmp_path / "run", tmp_path / "report"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _edit_row(run: Path, line: int, edit) -> None:
    lines = (run / "samples.jsonl").read_text().splitlines()
    rec = json.loads(lines[line - 1])
    edit(rec)
    lines[line - 1] = json.dumps(rec)  # json.dumps writes NaN as the bare NaN json.loads accepts
    (run / "samples.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("field,value,says", [
    ("tool_calls", None, "tool_calls null"),
    ("generation", None, "generation null"),
    ("prompt", None, "prompt null"),
    ("scores.em", float("nan"), "non-finite number at scores.em"),
    ("prompt_tokens", float("inf"), "non-finite number at prompt_tokens"),
    ("evidence", [[5, 2, "gold"]], "evidence[0]"),
    ("evidence", "0-10", "evidence of type str"),
    ("tool_calls", [["re", "ok"]], "tool_calls[0]"),
    ("scores.em", "1", "scores.em = '1'"),
])
def test_a_malformed_row_is_named_by_file_and_line_and_the_old_report_stays(made, tmp_path, capsys, field, value,
                                                                             says):
    run, report = _copy(made, tmp_path)
    before = _files(report)

    def edit(rec):
        if "." in field:
            top, sub = field.split(".")
            rec[top][sub] = value
        else:
            rec[field] = value

    _edit_row(run, 3, edit)
    assert report_main([str(run), "--out", str(report)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / 'samples.jsonl'}:3: row ") and says in err, err
    assert "previous report" in err and "rerun the evaluation" in err
    assert _files(report) == before


def test_odd_text_is_written_as_text_never_parsed(made, tmp_path, capsys):
    """A lone surrogate in a generation (valid JSON) and a folder named with two `$` (matplotlib's mathtext)."""
    import gzip
    import base64
    import re

    import harness.reports.plotting as plotting

    run, _ = _copy(made, tmp_path)
    odd = tmp_path / "a$x$b run"
    run.rename(odd)
    _edit_row(odd, 1, lambda rec: rec.update(generation=rec["generation"] + "\ud800 end"))
    legends = []
    real = plotting.save

    def grab(fig, path, dpi, tight=True):
        legends.extend(t for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts())
        return real(fig, path, dpi, tight)

    import harness.reports.figures as figures

    mp = pytest.MonkeyPatch()
    mp.setattr(figures, "save", grab)
    try:
        assert report_main([str(odd), "--out", str(tmp_path / "rep")]) == 0, capsys.readouterr().err
    finally:
        mp.undo()
    page = (tmp_path / "rep" / "report.html").read_text(encoding="utf-8")
    data = re.search(r'id="data"[^>]*>([^<]+)<', page)
    raw = gzip.decompress(base64.b64decode(data.group(1))).decode("utf-8")
    assert "\\ud800 end" in raw  # the escape of the surrogate, which JSON.parse reads back
    assert json.loads(raw)  # still JSON
    assert legends and all(not t.get_parse_math() for t in legends)
    assert (tmp_path / "rep" / "report.md").exists()


def _child_report(args: list[str], preexec=None, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "harness.report", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=preexec, **kw)


@pytest.mark.slow
def test_a_disk_that_fills_mid_report_leaves_the_old_report(made, tmp_path):
    """A real write failure: the child may write no file past 60 KB (RLIMIT_FSIZE: EFBIG, as a full disk's ENOSPC),
    so the page (larger) fails after the figures and tables were written to the staging folder."""
    import resource

    run, report = _copy(made, tmp_path)
    before = _files(report)
    assert len(before["report.html"]) > 60_000 and max(len(v) for k, v in before.items() if k != "report.html") < 60_000

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))

    proc = _child_report([str(run), "--out", str(report)], preexec=limit)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    assert err.strip().startswith("error: ") and "File too large" in err and "unchanged" in err, err[-3000:]
    assert "Traceback" not in err
    assert _files(report) == before  # nothing staged is left behind either


@pytest.mark.slow
def test_ctrl_c_during_a_report_leaves_the_old_report(made, tmp_path):
    """Ctrl-C while the report is staged. The child is frozen (SIGSTOP) once its staging folder appears, and the
    signal sent only if, frozen, it has not begun to move files into place: on two busy cores the test's own
    polling can wake after the child reached its commit (a CI run saw the report finish first). Otherwise the run
    is tried again on a fresh copy."""
    for attempt in range(3):
        run, report = _copy(made, tmp_path / str(attempt))
        before = _files(report)
        proc = _child_report([str(run), "--out", str(report)], preexec=ctrl_c_reaches)
        deadline = time.time() + 120
        while not list(report.glob(".staging-*")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the report ended before its staging folder was seen"
        proc.send_signal(signal.SIGSTOP)
        staged = bool(list(report.glob(".staging-*"))) and {
            p.name: p.read_bytes() for p in report.iterdir() if p.is_file()} == before
        if staged:
            proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
        if staged:
            break
    else:
        pytest.fail("three runs reached their commit before the test could freeze them")
    assert proc.returncode == 130 and err.strip().startswith("interrupted: ") and "Traceback" not in err, err
    assert _files(report) == before


def test_a_new_report_replaces_only_the_old_reports_files(made, tmp_path):
    run, report = _copy(made, tmp_path)
    (report / "notes.txt").write_text("mine")
    (report / "old-figure.png").write_bytes(b"x")
    listed = (report / ".report-files").read_text().split()
    (report / ".report-files").write_text("\n".join([*listed, "old-figure.png"]) + "\n")
    assert report_main([str(run), "--out", str(report), "--metric", "f1"]) == 0
    names = {p.name for p in report.iterdir()}
    assert "notes.txt" in names and "old-figure.png" not in names and "f1_by_position.png" in names
    assert "em_by_position.png" not in names and not [n for n in names if n.startswith(".staging")]


def test_labels_compare_settings_with_defaults_filled_in(made):
    """A run recorded before a flag existed (no ``vllm_arg``, no ``shots``) ran with its default: no label says
    ``vllm_arg=None`` against ``vllm_arg=[]``; a real difference still shows."""
    from evals import task_class
    from harness.reports.runs import run_labels, run_settings

    cfg = json.loads((made / "run" / "results.json").read_text())["config"]
    old = {k: v for k, v in cfg.items() if k != "vllm_arg"}
    old["task_args"] = {k: v for k, v in cfg["task_args"].items() if k != "shots"}
    same = run_labels([run_settings(old), run_settings(cfg)], task=task_class("hotpotqa"))
    assert all(label.startswith("ckpt [") and "vllm_arg" not in label and "shots" not in label for label in same)
    other = {**cfg, "max_new_tokens": 99}
    labels = run_labels([run_settings(old), run_settings(other)], task=task_class("hotpotqa"))
    assert labels == ["ckpt max_new_tokens=6", "ckpt max_new_tokens=99"], labels
