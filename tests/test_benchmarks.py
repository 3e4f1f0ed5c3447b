"""Every benchmark runs end to end at toy sizes (no timing is asserted: the numbers are for people, the machines
are noisy), and where it compares two paths their outputs agree (each prints the check as True/False)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "context_fit.py": (["--distractors", "0,10"], "| 10 |"),
    "cpu_attention.py": (["--shapes", "0:40,30:70", "--step", "3:20:60", "--repeats", "1"], "flash kernel"),
    "decode_bound.py": (["--lengths", "32,64", "--steps", "2"], "of bound"),
    "decode_scaling.py": (["--lengths", "32,64", "--steps", "2", "--hidden", "32", "--layers", "2"],
                          "decode-state memory"),
    "html_report.py": (["--questions", "30"], "report.html:"),
    "kv_cache.py": (["--lengths", "40,300", "--steps", "4", "--hidden", "32", "--layers", "2"], "True"),
    "live_eval.py": (["--nodes", "8", "--samples", "8", "--batch", "3", "--size", "smoke", "--repeats", "1",
                      "--threads", "1"],
                     "every row wrote the same tokens: True"),
    "loglikelihood.py": (["--questions", "2", "--choices", "3", "--distractors", "1", "--hidden", "32", "--layers",
                          "1"], "True"),
    "prefix_tree.py": (["--models", "phi,hybrid-phi-mamba", "--questions", "1", "--samples", "1", "--hidden", "32",
                        "--layers", "1", "--lengths", "64,128", "--no-lm-eval"], "| True | True |"),
    "scan.py": (["--lengths", "16,33", "--cells", "4:retrieval", "--batch", "2", "--steps", "1",
                 "--repeats", "1"], "losses of every step agree"),
    "retrieval_resume.py": (["--context", "120", "--calls", "2", "--new-tokens", "8", "--hidden", "32", "--layers",
                             "2", "--samples", "2"], "identical tokens: True"),
    "throughput.py": (["--questions", "2", "--positions", "first", "--distractors", "2", "--max-new-tokens", "4",
                       "--hidden", "32", "--layers", "1"], "True"),
    "tool_timeouts.py": (["--rows", "3", "--timeout", "0.2"], "every row got [timeout]: True"),
    # packed against padded rows (the scan comparison's path is the same CLI runs, on another flag)
    "train_cli.py": (["--compare", "packing", "--nodes", "8", "--batch", "4", "--steps", "1,2", "--size", "smoke",
                      "--repeats", "1", "--batches", "3", "--threads", "1"], "same losses batch by batch: True"),
    # its --side-by-side table is harness.training.sharing's (tests/test_sharing.py, the quick suite's part (c))
    "train_throughput.py": (["--sizes", "0.5M", "--nodes", "4", "--setups", "direct,retrieval", "--measure-batch",
                             "2", "--steps", "1"], "paper grid (18 runs of 5M samples"),
}


def test_every_benchmark_is_covered():
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")) == sorted(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_runs(script, warm_python):
    args, expect = CASES[script]
    res = warm_python.run([str(ROOT / "benchmarks" / script), *args], env=warm_python.env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert expect in res.stdout and "False" not in res.stdout, res.stdout[-2000:]
    if script == "throughput.py":  # it says where it is before its table
        assert "[1/8, " in res.stderr and "timing transformers.generate" in res.stderr, res.stderr[-2000:]


def test_a_benchmarks_help_shows_every_default():
    """Flags without a help text of their own show their default too (HelpFormatter)."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split("options:", 1)[1].split())
    for flag, default in (("--questions QUESTIONS", "8"), ("--distractors DISTRACTORS", "10"),
                          ("--icr-batch-size ICR_BATCH_SIZE", "8"), ("--backend {transformers,vllm}", "transformers")):
        assert f"(default: {default})" in text.split(flag, 1)[1][:200], flag


@pytest.mark.slow
def test_the_scan_benchmarks_memory_and_profile_parts_run():
    """``benchmarks/scan.py --memory`` under Triton's interpreter prints the backward's bytes beside the gradients'
    (nothing the size of steps x channels x states, which alone would be 3.6x the gradients here: under 3x, the
    partial sums of dB and dC per block of 4 channels included), and ``--profile`` a step's share of the scan."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    script = str(ROOT / "benchmarks" / "scan.py")
    res = subprocess.run([sys.executable, script, "--memory", "--batch", "1", "--channels", "24", "--lengths", "70"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    row = res.stdout.strip().splitlines()[-1].split()
    assert row[:2] == ["70", "float32"] and 1.0 <= float(row[-1].rstrip("x")) < 3.0, res.stdout
    env.pop("TRITON_INTERPRET")
    res = subprocess.run([sys.executable, script, "--profile", "--batch", "1", "--cells", "4:direct"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    shares = {line.split()[0]: float(line.split()[-1].rstrip("%")) for line in res.stdout.splitlines()
              if line.startswith("  ") and line.strip().endswith("%")}
    assert shares["scan"] > 0 and shares["convolution"] > 0 and abs(sum(shares.values()) - 100) < 0.5, res.stdout
