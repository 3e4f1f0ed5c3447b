"""The first-hour demo (``python -m harness.demo``), run as a user runs it: a real process that trains real
cells in child processes, evaluates them through the engine, and draws the report; a second run reuses them."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness.demo import collect, demo_cells, findings, gaps, main
from harness.training.trainer import finished_result

ROOT = Path(__file__).resolve().parents[1]


def demo(warm_python, out: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m harness.demo``: a process of its own (forked from the warm interpreter, tests/helpers.py)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return warm_python.run(["-m", "harness.demo", "--out", str(out), "--no-progress", *args], env=env, cwd=ROOT,
                           timeout=900)


@pytest.mark.slow
def test_demo_trains_evaluates_reports_and_reuses_its_cells(tmp_path, capsys, warm_python):
    out = tmp_path / "demo"
    first = demo(warm_python, out, "--lengths", "4,6", "--steps", "25", "--jobs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "training 6 of 6 cells" in first.stdout
    # what it will take here, from a measurement made as it starts (not a constant fitted to a quiet machine)
    assert "on this machine (measured just now on one thread: a transformer step at L=6 takes" in first.stdout
    cells = sorted(p.parent.name for p in out.glob("*/result.json"))
    assert cells == sorted(f"{a}-smoke-index-L{n}-seed42-steps25" for a in ("transformer", "hybrid", "mamba")
                           for n in (4, 6))
    results = {c: json.loads((out / c / "result.json").read_text()) for c in cells}
    # every cell was evaluated live through the engine, at its own length, on the same held-out set size
    for c, r in results.items():
        rows = (out / c / "eval" / "samples.jsonl").read_text().splitlines()
        assert len(rows) == 500 and r["samples"] == 25 * 32 and 0 <= r["accuracy"] <= 1
    # each live evaluation is also in lm-eval's output format, with the same numbers (which differ between cells)
    lm_eval_acc = {}
    for c, r in results.items():
        (res_file,) = (out / c / "eval" / "lm_eval").glob("results_*.json")
        (task_row,) = json.loads(res_file.read_text())["results"].values()
        lm_eval_acc[c] = task_row["accuracy,none"]
        assert task_row["accuracy,none"] == r["accuracy"]
    assert len(set(lm_eval_acc.values())) > 1
    # the table is built from those results: one row per architecture, one column per length
    table = (out / "demo.md").read_text()
    for arch in ("transformer", "hybrid", "mamba"):
        line = next(ln for ln in table.splitlines() if ln.startswith(f"| {arch} "))
        acc4 = round(100 * results[f"{arch}-smoke-index-L4-seed42-steps25"]["accuracy"])
        assert f"| {acc4} ± " in line
    # the words under the table are this run's numbers (25 steps: whichever way they came out)
    rows = collect(demo_cells(out, (4, 6), steps=25))
    assert " ".join(findings(rows).split()) in " ".join(first.stdout.split())
    assert "What it does not show" in first.stdout
    # the gaps at the longest length, paired on the same sequences, "significant" only where the test says so
    assert "Transformer − Mamba at L=6" in first.stdout and "paired sequences, McNemar p =" in first.stdout
    assert " ".join(gaps(demo_cells(out, (4, 6), steps=25)).split()) in " ".join(first.stdout.split())
    # state bytes: attention's cache grows with the context, Mamba's state does not
    sb = {(r["arch"], r["length"]): r["state_bytes"] for r in rows}
    assert sb["transformer", 6] > sb["transformer", 4] and sb["mamba", 6] == sb["mamba", 4]
    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    # the second run (in this process: nothing to train, so no process of its own is needed to show it)
    stamps = {c: (out / c / "result.json").stat().st_mtime_ns for c in cells}
    capsys.readouterr()
    assert main(["--out", str(out), "--no-progress", "--lengths", "4,6", "--steps", "25"]) == 0
    second = capsys.readouterr().out
    assert "index task, accuracy" in second
    assert not any(ln.startswith("training ") for ln in second.splitlines())  # all cached
    assert {c: (out / c / "result.json").stat().st_mtime_ns for c in cells} == stamps
    assert (out / "demo.md").read_text() == table

    # deterministic: the same cells trained again elsewhere give the same models and numbers (which differ
    # between architectures, so the comparison can fail)
    again = demo(warm_python, tmp_path / "again", "--lengths", "4", "--steps", "25", "--jobs", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    for arch in ("transformer", "hybrid", "mamba"):
        cell = f"{arch}-smoke-index-L4-seed42-steps25"
        a, b = (json.loads((d / cell / "result.json").read_text()) for d in (out, tmp_path / "again"))
        assert (a["curve"], a["accuracy"]) == (b["curve"], b["accuracy"])
    assert len({results[f"{a}-smoke-index-L4-seed42-steps25"]["final_loss"] for a in ("transformer", "mamba")}) == 2

    # another seed is other cells, none of them finished here (the trainer trains them next to these, as the
    # seed-42 cells above were trained); a cell directory holding other settings is refused
    other = demo_cells(out, (4,), steps=25, seed=7)
    assert {c.output for c in other}.isdisjoint(c.output for c in demo_cells(out, (4, 6), steps=25))
    assert [finished_result(c) for c in other] == [None] * 3
    assert all(finished_result(c) is not None for c in demo_cells(out, (4, 6), steps=25))
    bad = out / "mamba-smoke-index-L4-seed42-steps25" / "result.json"
    bad.write_text(json.dumps({**json.loads(bad.read_text()), "lr": 0.1}))
    assert main(["--out", str(out), "--no-progress", "--lengths", "4", "--steps", "25"]) == 2
    refused = capsys.readouterr().err
    assert refused.startswith("error: ") and "other settings" in refused


def test_demo_bad_flags_are_one_error_line(tmp_path, capsys):
    """Checked by the command line's own main before anything is trained or written."""
    assert main(["--out", str(tmp_path / "d"), "--lengths", "4,x", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith("error: --lengths")
    assert main(["--out", str(tmp_path / "d"), "--jobs", "0", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith("error: --jobs 0")
    assert not (tmp_path / "d").exists()


def _rows(acc: dict) -> list[dict]:
    kib = {"transformer": (4, 10), "hybrid": (12, 15), "mamba": (15, 15)}
    return [{"arch": a, "length": n, "accuracy": acc[a][i], "state_bytes": 1024 * kib[a][i]}
            for a in acc for i, n in enumerate((4, 16))]


def test_findings_say_what_the_numbers_say():
    shows = findings(_rows({"transformer": (1.0, 0.99), "hybrid": (1.0, 1.0), "mamba": (1.0, 0.39)}))
    assert shows.startswith("What this shows") and "(100% -> 39%)" in shows
    assert "15.0 KiB of state, more than the Transformer's whole KV cache (10.0 KiB)" in shows
    # a Transformer that never made its jump: said plainly, with the numbers, not dressed up as the effect
    failed = findings(_rows({"transformer": (1.0, 0.14), "hybrid": (1.0, 1.0), "mamba": (1.0, 0.39)}))
    assert failed.startswith("This run does not show the expected pattern") and "Transformer 100% -> 14%" in failed
    flat = findings(_rows({"transformer": (1.0, 1.0), "hybrid": (1.0, 1.0), "mamba": (1.0, 0.97)}))
    assert flat.startswith("This run does not show")


def test_the_first_eta_is_the_estimate_and_gives_way_to_the_rate():
    """A demo's first ETA read 33 hours: a rate extrapolated from seconds of process start-ups. With an estimate
    up front, the first ETA is the estimate; the measured rate takes over as the work progresses."""
    from harness.training.grid import eta_seconds

    assert eta_seconds(0.0, 5.0, expected=300.0) == 295.0
    assert eta_seconds(0.001, 10.0, expected=300.0) == pytest.approx(290.0 * 0.996 + 0.004 * 9990.0)
    assert eta_seconds(0.5, 100.0, expected=300.0) == 100.0  # the rate alone past a quarter
    assert eta_seconds(0.001, 10.0) is None and eta_seconds(0.1, 10.0) == pytest.approx(90.0)
