"""Data parallelism over ranks (torchrun / accelerate launch set the same variables; CPU processes here)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.engine import run_eval
from harness.engine.config import RunConfig
from tests.helpers import assert_varied

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(model_dir, out):
    return ["-m", "harness.eval", "--model", model_dir, "--task", "hotpotqa", "--data", "fixture", "--distractors", "4",
            "--positions", "first,last", "--limit", "12", "--max-new-tokens", "16", "--batch-size", "2",
            "--device", "cpu", "--dtype", "float32", "--output", str(out), "--no-progress",
            # the prefix tree, asked: auto's choice between plans is timed, and on a loaded machine may be another
            "--prefix-reuse", "tree"]


def _torchrun(model_dir, out, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), *_args(model_dir, out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _samples(out):
    return {r["key"]: r["generation"] for r in map(json.loads, open(out / "samples.jsonl"))}


@pytest.fixture(scope="module")
def single_rank(tiny_phi_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    cfg = RunConfig(task="hotpotqa", model=tiny_phi_dir, data="fixture", task_args={"distractors": 4, "positions": ["first", "last"]}, limit=12,
                    max_new_tokens=16, batch_size="2", device="cpu", dtype="float32", output=str(out),
                    prefix_reuse="none")  # the ranks run the prefix tree: both modes agree
    res = run_eval(cfg, progress=False)
    return out, res


@pytest.mark.slow
def test_two_ranks_merge_to_the_single_rank_result(tiny_phi_dir, single_rank, tmp_path):
    out1, res1 = single_rank
    out = tmp_path / "two"
    proc = _torchrun(tiny_phi_dir, out)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    assert sorted(p.name for p in out.glob("samples*.jsonl")) == ["samples.jsonl"]  # shards merged away
    assert_varied(_samples(out1).values())
    assert _samples(out) == _samples(out1)
    res2 = json.loads((out / "results.json").read_text())
    assert res2["counts"]["ranks"] == 2 and res2["counts"]["generated"] == 24
    assert res2["timings"]["prefix_reuse"] == "tree"
    assert res2["metrics"] == res1["metrics"]


@pytest.mark.slow
def test_killed_rank_then_resume_with_another_world_size(tiny_phi_dir, single_rank, tmp_path):
    out1, res1 = single_rank
    out = tmp_path / "killed"
    proc = _torchrun(tiny_phi_dir, out, start_new_session=True)
    deadline = time.time() + 240
    shard = out / "samples.rank1.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if shard.exists() and shard.read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    import psutil

    ranks = {p.environ().get("RANK"): p for p in psutil.Process(proc.pid).children(recursive=True)
             if "harness.eval" in " ".join(p.cmdline())}
    ranks["1"].kill()  # one rank dies mid-run; torchrun then tears the job down
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    done_before = sum(f.read_text().count("\n") for f in out.glob("samples*.jsonl"))
    assert 0 < done_before < 24
    res = run_eval(RunConfig(task="hotpotqa", model=tiny_phi_dir, data="fixture", task_args={"distractors": 4, "positions": ["first", "last"]},
                             limit=12, max_new_tokens=16, batch_size="2", device="cpu", dtype="float32",
                             output=str(out)), progress=False)
    assert res["counts"]["resumed"] >= done_before - 2  # at most a partial line per shard is redone
    assert _samples(out) == _samples(out1)
    assert res["metrics"] == res1["metrics"]
    assert not list(out.glob("samples.rank*.jsonl"))
