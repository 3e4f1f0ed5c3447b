"""The trainer gets the evaluation's guarantees (issue 20): one process a directory, a killed run continues
exactly, nothing of a killed attempt mixes into the rerun's curves or evaluation, grid cells die with the grid,
a diverged loss stops with an error line, a failed write keeps the previous checkpoint. Process faults are real
processes and signals."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.engine.runlog import RunLock, RunLockedError
from harness.train import main
from harness.training.config import TrainConfig
from harness.training.trainer import train_one
from tests.helpers import alive as _alive

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
# 100 steps of 32 with a teacher-forced evaluation (and a saved state) every 10: seconds on one thread
SMALL = ["--size", "smoke", "--nodes", "4", "--setup", "direct", "--samples", "3200", "--batch-size", "32",
         "--warmup", "64", "--lr", "3e-3", "--eval-every", "320", "--eval-samples", "20", "--eval-batch-size", "20",
         "--no-live-eval", "--threads", "1", "--no-progress"]


def _train(out: Path, *extra: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "harness.train", *SMALL, "--output", str(out), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)


def _wait_for(path: Path, proc=None, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        assert proc is None or proc.poll() is None, f"the run ended first: {proc.communicate()[1][-2000:]}"
        time.sleep(0.02)


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "model.safetensors")


def _scalars(run: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for events in (run / "tracker").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            steps += [e.step for e in acc.Scalars(tag)]
    return sorted(steps)


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_weights_and_curve_of_one_never_killed(tmp_path):
    pytest.importorskip("tensorboard")
    whole = _train(tmp_path / "whole", "--report-to", "tensorboard")
    assert whole.wait(timeout=600) == 0, whole.stderr.read()[-2000:]

    out = tmp_path / "killed"
    first = _train(out, "--report-to", "tensorboard")
    _wait_for(out / ".training_state.pt", first)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert not (out / "result.json").exists()
    state = torch.load(out / ".training_state.pt", weights_only=False)
    assert 0 < state["progress"]["step"] < 100  # killed mid-run
    again = _train(out, "--report-to", "tensorboard")
    assert again.wait(timeout=600) == 0, again.stderr.read()[-2000:]

    a, b = _weights(tmp_path / "whole"), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.loads((d / "result.json").read_text()) for d in (tmp_path / "whole", out))
    assert rb["attempts"] == 2 and ra["attempts"] == 1
    assert ra["curve"] == rb["curve"] and len({r["loss"] for r in ra["curve"]}) > 5  # the curve varies
    assert (out / "train_log.jsonl").read_text() == (tmp_path / "whole" / "train_log.jsonl").read_text()
    # the tracker holds each point of the curve once; the killed attempt's files are kept apart
    assert _scalars(out, "train/loss") == [r["samples"] for r in rb["curve"]]
    assert list((out / ".killed").glob("tracker-*"))
    assert not (out / ".training_state.pt").exists()  # finished: the mid-run state is no longer needed


@pytest.mark.slow
def test_a_killed_packed_run_resumes_to_the_weights_of_one_never_killed(tmp_path):
    """Packed rows (a batch's samples end to end, the hybrid's scans restarting and its attention confined to each
    sample) change what a step computes, not what a resumed run redraws: the same weights, bit for bit."""
    packed = ["--arch", "hybrid", "--setup", "retrieval", "--samples", "1600", "--batch-size", "16", "--packing", "on"]
    whole = _train(tmp_path / "whole", *packed)
    assert whole.wait(timeout=600) == 0, whole.stderr.read()[-2000:]
    out = tmp_path / "killed"
    first = _train(out, *packed)
    _wait_for(out / ".training_state.pt", first)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert 0 < torch.load(out / ".training_state.pt", weights_only=False)["progress"]["step"] < 100
    again = _train(out, *packed)
    assert again.wait(timeout=600) == 0, again.stderr.read()[-2000:]
    a, b = _weights(tmp_path / "whole"), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.loads((d / "result.json").read_text()) for d in (tmp_path / "whole", out))
    assert ra["packed_rows"]["ran"] == rb["packed_rows"]["ran"] == "on" and rb["attempts"] == 2
    assert ra["curve"] == rb["curve"] and len({r["loss"] for r in ra["curve"]}) > 5


def test_a_killed_run_rerun_with_other_settings_is_refused_and_overwrite_moves_it_aside(tmp_path, capsys):
    out = tmp_path / "run"
    first = _train(out, "--report-to", "none")
    _wait_for(out / ".training_state.pt", first)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    args = [*SMALL, "--report-to", "none", "--output", str(out)]
    lr = args.index("--lr") + 1
    args[lr] = "1e-3"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "lr changed since this run started: 0.003 → 0.001" in err
    assert not (out / "result.json").exists()
    assert main([*args, "--overwrite", "--samples", "320"]) == 0
    (aside,) = out.glob("replaced-*")
    assert (aside / ".training_state.pt").exists() and (aside / "train_log.jsonl").exists()
    res = json.loads((out / "result.json").read_text())
    assert res["lr"] == 1e-3 and res["attempts"] == 1


def test_a_cell_is_never_trained_by_two_processes_at_once(tmp_path):
    cfg = TrainConfig(arch="transformer", size="smoke", nodes=4, setup="direct", samples=64, batch_size=32,
                      eval_every=32, eval_samples=8, report_to="none", live_eval=False,
                      output=str(tmp_path / "cell")).resolved()
    with RunLock(cfg.output):
        with pytest.raises(RunLockedError, match="in use by another run"):
            train_one(cfg, progress=False)
    assert not (tmp_path / "cell" / "train_run.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_grid_cells_die_with_the_grid(tmp_path, sig):
    """Stopped by a scheduler's SIGTERM (or killed outright), a --jobs 2 grid leaves no cell training; the rerun
    finds every cell's lock free."""
    root = tmp_path / "grid"
    cmd = [sys.executable, "-m", "harness.train", "--grid", "smoke", "--jobs", "2", "--samples", "10000000",
           "--eval-samples", "8", "--report-to", "none", "--no-progress", "--output", str(root)]
    grid = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while len(list(root.glob("*/.lock.json"))) < 2:
        assert time.time() < deadline and grid.poll() is None, grid.stderr.read()[-2000:] if grid.poll() else ""
        time.sleep(0.05)
    cells = [json.loads(p.read_text())["pid"] for p in root.glob("*/.lock.json")]
    assert all(_alive(pid) for pid in cells) and grid.pid not in cells
    grid.send_signal(sig)
    err = grid.communicate(timeout=60)[1]
    deadline = time.time() + 10
    while any(map(_alive, cells)) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, cells)), f"cells {cells} outlived the grid"
    if sig == signal.SIGTERM:
        assert grid.returncode == 130 and "interrupted: " in err and "Traceback" not in err
    for cell in root.glob("*/.lock.json"):  # a lock file left by a killed cell is free to take
        RunLock(cell.parent).acquire().release()


def test_cpu_cells_fork_from_a_server_and_gpu_cells_start_fresh():
    """Without CUDA a cell forks from a server that imported the trainer once (the grids above run that way and
    their cells die with the grid, SIGKILL included); with CUDA a cell is a fresh interpreter (spawn): a child
    forked after CUDA was touched cannot use it, and each GPU cell's visible device is set before it starts."""
    from harness.procs import child_context

    assert child_context(cuda=True).get_start_method() == "spawn"
    assert child_context(cuda=False, preload=("harness.training.grid",)).get_start_method() == "forkserver"


def test_a_non_finite_loss_stops_with_an_error_and_keeps_the_best_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*SMALL, "--report-to", "none", "--output", str(out), "--samples", "640", "--eval-every", "32",
            "--warmup", "64000"]
    # ramps up over a long warm-up: the first steps are fine, then it diverges (a smaller peak, 1,000, only
    # collapses the tiny Transformer to a constant output under torch 2.13)
    args[args.index("--lr") + 1] = "1e12"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the ") and "became nan" in err and "at step " in err and "Traceback" not in err
    assert "the last checkpoint (teacher-forced EM" in err
    assert (out / "model.safetensors").exists() and not (out / "result.json").exists()
    assert all(torch.isfinite(t).all() for t in _weights(out).values())  # the kept checkpoint is from before


@pytest.mark.parametrize("flag,value", [("--lr", "0"), ("--lr", "inf"), ("--lr", "nan"), ("--lr", "-1e-3"),
                                        ("--threads", "-1"), ("--warmup", "-5"), ("--d-model", "0"),
                                        ("--layers", "0"), ("--samples", "0"), ("--eval-every", "-1"),
                                        ("--length", "0"), ("--eval-max-new-tokens", "0")])
def test_every_trainer_flag_is_checked_before_anything_is_written(tmp_path, capsys, flag, value):
    out = tmp_path / "run"
    assert main([*SMALL, "--report-to", "none", "--output", str(out), f"{flag}={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} ") and "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint(tmp_path):
    """A file-size limit (what a full disk does to a write) hit while the next checkpoint is written: the error
    names what was kept, and the kept checkpoint is the previous one, whole."""
    from harness.engine.identity import folder_digest

    out = tmp_path / "run"
    out.mkdir()
    script = f"""
import resource, signal, sys, torch
from evals.base import word_level_tokenizer
from harness.models.istree import build_model
from harness.training.state import TrainingError, save_checkpoint
torch.manual_seed(int(sys.argv[1]))
model = build_model("transformer", "smoke", 20)
tok = word_level_tokenizer([f"w{{i}}" for i in range(20)])
if sys.argv[2] == "limit":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
try:
    save_checkpoint(__import__("pathlib").Path({str(out)!r}), model, tok, {{"task": "istree"}})
except TrainingError as e:
    print("error:", e)
    sys.exit(2)
"""
    ok = subprocess.run([sys.executable, "-c", script, "0", "free"], cwd=REPO, env=ENV, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    kept = folder_digest(out, "weights")
    full = subprocess.run([sys.executable, "-c", script, "1", "limit"], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert full.returncode == 2 and "the previous checkpoint is kept" in full.stdout, full.stderr[-2000:]
    assert folder_digest(out, "weights") == kept
    assert not list(out.glob(".checkpoint*"))  # no half-written folder left behind
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # and it loads


def test_the_live_evaluation_never_counts_rows_of_another_checkpoint(tmp_path):
    from evals.base import word_level_tokenizer
    from harness.models.istree import build_model
    from harness.training.data import TrainTask
    from harness.training.state import save_checkpoint
    from harness.training.trainer import evaluate

    cfg = TrainConfig(size="smoke", nodes=4, setup="direct", eval_samples=6, report_to="none").resolved()
    task = TrainTask(cfg)
    tok = word_level_tokenizer(task.vocab)
    run = tmp_path / "run"
    run.mkdir()
    for seed, expect_generated in ((0, 6), (1, 6)):  # the second checkpoint replaces the first in place
        torch.manual_seed(seed)
        model = build_model("transformer", "smoke", len(task.vocab)).eval()
        save_checkpoint(run, model, tok, {"task": "istree", "args": task.eval_args})
        res = evaluate(model, tok, run, "istree", task.eval_args, batch_size=6)
        assert res["counts"]["generated"] == expect_generated and res["counts"]["resumed"] == 0
    assert len(list((run / "eval").glob("replaced-*"))) == 1  # the first checkpoint's rows, kept apart


@pytest.mark.slow
def test_a_scheduler_runs_cells_and_a_killed_cell_resumes_on_the_rerun(tmp_path):
    """Cells through submitit's local executor (real job processes, the code path of --launcher slurm): one
    cell's process is killed mid-training; the grid names it and keeps the other; the rerun resumes the killed
    cell from its last evaluation and leaves the finished one alone."""
    pytest.importorskip("submitit")
    import threading

    from harness.engine.config import ConfigError
    from harness.training.launch import run_on_scheduler

    def cell(arch, samples):
        return TrainConfig(arch=arch, size="smoke", nodes=4, setup="direct", samples=samples, batch_size=32,
                           warmup=64, lr=3e-3, eval_every=320, eval_samples=16, eval_batch_size=16, threads=1,
                           report_to="none", live_eval=False, output=str(tmp_path / arch)).resolved()

    cells = [cell("transformer", 640), cell("mamba", 4800)]
    outcome = {}

    def grid():
        try:
            outcome["results"] = run_on_scheduler("submitit-local", "t", cells, tmp_path, 2, 1, False, poll_s=0.2)
        except ConfigError as e:
            outcome["error"] = str(e)

    runner = threading.Thread(target=grid)
    runner.start()
    victim = tmp_path / "mamba"
    _wait_for(victim / ".training_state.pt", timeout=240)  # an evaluation is saved: mid-training
    pid = json.loads((victim / ".lock.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    runner.join(timeout=300)
    assert not runner.is_alive()
    assert "1 cell(s) failed" in outcome.get("error", "") and cells[1].name in outcome["error"]
    assert (tmp_path / "transformer" / "result.json").exists() and not (victim / "result.json").exists()
    first = json.loads((tmp_path / "transformer" / "result.json").read_text())
    results = run_on_scheduler("submitit-local", "t", cells, tmp_path, 2, 1, False, poll_s=0.2)
    by_arch = {r["arch"]: r for r in results}
    assert by_arch["transformer"] == first  # finished: returned, not trained again
    resumed = by_arch["mamba"]
    assert resumed["attempts"] == 2  # resumed from the killed attempt's state, not started over
    samples = [r["samples"] for r in resumed["curve"] if "eval_em" in r]
    assert samples == list(range(320, 4801, 320))  # every evaluation once: nothing lost or doubled
    assert list(tmp_path.glob("submitit/*/*.out"))  # the jobs ran through submitit, logs kept
