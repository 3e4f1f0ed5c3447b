"""The GPU suite (issue 21) runs on a machine without CUDA at tiny sizes, so it cannot rot between GPU runs; the
carried mamba-ssm source tree imports with the stand-ins the GPU machines need."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_gpu_suite_runs_on_cpu_and_writes_its_report(tmp_path):
    out = tmp_path / "suite"
    res = subprocess.run([sys.executable, "-m", "harness.doctor", "--suite", "gpu", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["size"] == "tiny" and report["device"] == "cpu"
    names = [c["name"] for c in report["checks"]]
    assert sum("batched == no prefix reuse == alone" in n for n in names) == 3 and any("family matrix" in n for n in names)
    assert all(c["ok"] for c in report["checks"])
    assert all(c["distinct_generations"] >= 2 for c in report["checks"] if "distinct_generations" in c
               and isinstance(c["distinct_generations"], int))
    assert any("no CUDA" in s for s in report["skipped"])
    phi = next(r for r in report["throughput"] if r["model"] == "phi")
    assert phi["same_tokens_as_generate"] == f"{phi['samples']}/{phi['samples']}"  # the harness = generate
    assert report["decode"] and {r["batch"] for r in report["decode"]} == {1, 4} and len(report["trainer"]) == 9
    assert "paper grid" in report["trainer_projection"] and report["auto_batch"] == []  # needs CUDA memory
    md = (out / "report.md").read_text()
    assert "all checks passed" in md and "## Throughput" in md
    assert (out / "decode.png").stat().st_size > 10_000


def test_a_carried_mamba_ssm_tree_imports_its_triton_ops(tmp_path):
    from harness.engine.identity import cache_dir
    from harness.models.kernels import fetch_mamba_ssm_sources

    try:
        src = fetch_mamba_ssm_sources(cache_dir())
    except OSError as e:
        pytest.skip(f"mamba-ssm sources: {e}")
    code = ("from harness.models import kernels\nkernels.use_carried_sources()\n"
            "from mamba_ssm.ops.triton.selective_state_update import selective_state_update\n"
            "from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined\nprint('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ICR_MAMBA_SSM_SRC": str(src)})
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
    size = sum(f.stat().st_size for f in Path(src).rglob("*") if f.is_file())
    assert size < 8 * 2**20  # what the device tool carries: far below its 64 MiB
