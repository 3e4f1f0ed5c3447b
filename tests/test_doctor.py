"""`harness.doctor` on a CPU machine, and mamba-ssm's Triton kernels run by Triton's CPU interpreter against
the Phi-Mamba reference path: the GPU glue is exercised in CI without a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_doctor_reports_paths_and_passes_on_cpu(capsys, tmp_path):
    from harness.doctor import main

    assert main(["--json", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    assert "phi-mamba backend      cpu, scan: pytorch reference" in out and "all checks passed" in out
    report = json.loads((tmp_path / "d.json").read_text())
    assert [c["ok"] for c in report["checks"]] == [True]
    decode = {(r["model"], r["context"]): r for r in report["decode"]}
    assert decode[("phi-mamba", 8192)]["state_mib"] == decode[("phi-mamba", 512)]["state_mib"]  # constant state
    assert decode[("phi", 8192)]["state_mib"] > 10 * decode[("phi", 512)]["state_mib"] / 2  # a growing KV cache
    hybrid = [decode[("hybrid-phi-mamba", n)]["state_mib"] for n in (512, 8192)]
    assert decode[("phi-mamba", 512)]["state_mib"] < hybrid[0] < hybrid[1] < decode[("phi", 8192)]["state_mib"]


@pytest.fixture(scope="session")
def mamba_ssm_src():
    pytest.importorskip("triton", reason="triton is in the dev extra: pip install -e '.[dev]'")
    from harness.ops import kernels

    cache = Path(os.environ.get("ICR_CACHE", Path.home() / ".cache" / "icr-harness"))
    try:
        return kernels.fetch_mamba_ssm_sources(cache), cache
    except OSError as e:
        pytest.skip(f"mamba-ssm kernels under the interpreter: the package index cannot be reached ({e})")


@pytest.mark.slow
def test_mamba_ssm_kernels_equal_the_reference_under_the_triton_interpreter(mamba_ssm_src, tmp_path):
    """Prompt scan (mamba_chunk_scan_combined) and decode step (selective_state_update), Phi-Mamba and the
    hybrid, a left-padded batch of three lengths, greedy tokens, in a child process with TRITON_INTERPRET=1."""
    _, cache = mamba_ssm_src
    res = subprocess.run([sys.executable, "-m", "harness.doctor", "--interpret-kernels", "--cache", str(cache),
                          "--no-decode", "--json", str(tmp_path / "d.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads((tmp_path / "d.json").read_text())["checks"]}
    kernel = checks["phi-mamba: mamba-ssm kernels == reference (cpu), triton interpreter"]
    assert kernel["ok"] and kernel["same_tokens"] and kernel["max_diff"] < 1e-3
    assert kernel["kernel_calls"]["chunk_scan"] >= 2 and kernel["kernel_calls"]["state_update"] >= 8


def test_asking_for_kernels_where_they_cannot_run_is_an_error():
    import torch

    from harness.ops import kernels

    with pytest.raises(RuntimeError, match="cannot run here"):
        kernels.require("kernel", torch.zeros(1))
    assert kernels.require("torch", torch.zeros(1)) is None and kernels.require("auto", torch.zeros(1)) is None


@pytest.mark.slow
def test_rows_split_below_the_kernels_int32_limit_give_the_same_logits(mamba_ssm_src):
    """mamba-ssm's kernels address a call in 32-bit, so a batch past 2**31 elements runs as row groups; groups of
    one row (the limit lowered, as 2**31 elements cannot be interpreted on CPU) give the whole batch's logits."""
    from harness.ops.kernels import int32_safe_rows

    assert int32_safe_rows(5, 2**30) == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4), slice(4, 5)]
    assert int32_safe_rows(5, 10) == [slice(0, 5)] and int32_safe_rows(7, 2**29 + 1) == [slice(0, 3), slice(3, 6),
                                                                                          slice(6, 7)]
    src, _ = mamba_ssm_src
    code = ("import json, torch\nfrom harness.ops import kernels\n"
            "kernels.enable_cpu_interpreter()\n"
            "from harness.tools.checks import _probe_prompts, _run_paths, _tiny_phi_mamba\n"
            "model, seqs = _tiny_phi_mamba([1], 'cpu'), _probe_prompts()\n"
            "whole = _run_paths(model, seqs, 3, 'kernel', 'cpu')\n"
            "calls = dict(kernels.CALLS)\nkernels.INT32_MAX = 1\n"
            "split = _run_paths(model, seqs, 3, 'kernel', 'cpu')\n"
            "diff = max((a - b).abs().max().item() for a, b in zip([whole[0], *whole[1]], [split[0], *split[1]]))\n"
            "varies = max((whole[0][0] - r).abs().max().item() for r in whole[0][1:])\n"
            "print('RESULT ' + json.dumps({'diff': diff, 'varies': varies, 'rows': len(seqs), "
            "'scans': [calls['chunk_scan'], kernels.CALLS['chunk_scan'] - calls['chunk_scan']]}))\n")
    from harness.ops.kernels import interpreter_env

    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900,
                         env=interpreter_env(src))
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, res.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    assert got["varies"] > 1e-3  # the rows' logits differ, so equal logits say something
    assert got["scans"][1] == got["rows"] * got["scans"][0]  # each row its own kernel call
    assert got["diff"] == 0.0
