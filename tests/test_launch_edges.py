"""The trainer's switches and launchers fail with an ``error:`` line before anything is created, an interrupted
projection says that nothing was kept, and a grid cell that died says how (real processes and signals)."""
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.procs import exit_description
from harness.train import main as train_main
from tests.helpers import ctrl_c_reaches

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--arch", "mamba", "--size", "smoke", "--nodes", "4", "--setup", "direct", "--samples", "32",
         "--batch-size", "8", "--report-to", "none", "--no-progress"]


def _refused(capsys, argv, out: Path) -> str:
    capsys.readouterr()
    rc = train_main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and "Traceback" not in err, err
    assert not out.exists(), f"{out} was created before the error"
    return err


def test_the_triton_scan_forced_where_it_cannot_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ICR_SCAN", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is here: the Triton scan can run")
    err = _refused(capsys, [*SMALL, "--output", str(tmp_path / "run")], tmp_path / "run")
    assert "--scan triton" in err and "--scan auto or torch" in err
    monkeypatch.delenv("ICR_SCAN")
    err = _refused(capsys, [*SMALL, "--scan", "triton", "--output", str(tmp_path / "r1")], tmp_path / "r1")
    assert "--scan triton" in err
    monkeypatch.setenv("ICR_SCAN", "fast")
    err = _refused(capsys, [*SMALL, "--output", str(tmp_path / "r2")], tmp_path / "r2")
    assert "use auto, torch, triton, sequential" in err


def test_a_scheduler_that_is_not_here(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no sbatch, no srun
    err = _refused(capsys, ["--grid", "smoke", "--launcher", "slurm", "--output", str(tmp_path / "grid")],
                   tmp_path / "grid")
    assert "slurm" in err.lower()


@pytest.mark.parametrize("flag", [["--jobs", "2"], ["--launcher", "slurm"], ["--cells-per-gpu", "2"],
                                  ["--slurm-partition", "gpu"], ["--timeout-min", "30"]])
def test_grid_options_given_to_a_single_run(tmp_path, capsys, flag):
    err = _refused(capsys, [*SMALL, *flag, "--output", str(tmp_path / "run")], tmp_path / "run")
    assert flag[0] in err and "grids only" in err


@pytest.mark.slow
def test_an_interrupted_projection_says_nothing_was_kept(tmp_path):
    out = tmp_path / "grid"
    proc = subprocess.Popen([sys.executable, "-m", "harness.train", "--grid", "smoke", "--plan", "--output", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_reaches)
    seen, t0 = "", time.monotonic()
    while "measuring" not in seen and time.monotonic() - t0 < 120:  # it says up front what it measures
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
    assert "measuring" in seen and "nothing is trained" in seen, seen
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "trains nothing and wrote nothing" in err and "kept in" not in err
    assert not (out / "results.md").exists()


def _die(how: str):
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)


@pytest.mark.slow
@pytest.mark.parametrize("how, said", [("kill", "killed by SIGKILL (out of memory"), ("exit", "exit code 3")])
def test_a_dead_cell_says_how_it_died(how, said):
    proc = multiprocessing.get_context("spawn").Process(target=_die, args=(how,))
    proc.start()
    proc.join(60)
    assert exit_description(proc.exitcode).startswith(said)
    assert exit_description(128 + signal.SIGTERM).startswith("killed by SIGTERM")  # a shell's 143


def test_every_switch_is_checked_before_anything_starts(tmp_path, capsys):
    """A misspelled flag is argparse's usage line naming it (not HfArgumentParser's traceback); a task option
    given twice is refused (the later one won silently); CUDA graphs without CUDA stop a grid before any cell
    starts or its folder exists (every cell failed alike, one after another)."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        train_main([*SMALL, "--bogus", "1", "--output", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus 1" in err and "Traceback" not in err
    assert not out.exists()
    err = _refused(capsys, ["--task", "mqar", "--size", "smoke", "--task-arg", "pairs=8", "--task-arg", "pairs=16",
                            "--output", str(out)], out)
    assert "--task-arg pairs is given twice (8 and 16)" in err
    if __import__("torch").cuda.is_available():
        return
    t = time.perf_counter()
    err = _refused(capsys, ["--grid", "smoke", "--cuda-graphs", "on", "--output", str(tmp_path / "grid")],
                   tmp_path / "grid")
    assert "--cuda-graphs on" in err and "--cuda-graphs off" in err
    assert time.perf_counter() - t < 60  # refused at once, not after nine cells


@pytest.mark.slow
def test_an_exported_scan_leaves_a_transformer_run_as_it_was(tmp_path, capsys, monkeypatch):
    """``ICR_SCAN`` names the scan of models that have one: a Transformer run made without it is the same run
    with it (resumed as finished), and its result records no scan of its own."""
    import json

    base = ["--arch", "transformer", "--size", "smoke", "--nodes", "4", "--setup", "direct", "--samples", "32",
            "--batch-size", "8", "--report-to", "none", "--no-progress", "--eval-samples", "8", "--no-live-eval",
            "--output", str(tmp_path / "run")]
    monkeypatch.delenv("ICR_SCAN", raising=False)
    assert train_main(base) == 0
    first = json.loads((tmp_path / "run" / "result.json").read_text())
    monkeypatch.setenv("ICR_SCAN", "sequential")
    capsys.readouterr()
    assert train_main(base) == 0, capsys.readouterr().err
    again = json.loads((tmp_path / "run" / "result.json").read_text())
    assert again == first and again["scan"] == "auto" and again["scans"] == []
