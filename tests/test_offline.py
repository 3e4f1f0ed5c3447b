"""Offline, the first commands fail at once with what is missing and the commands that get it (issue 22): one
probe of the hub, no retries; a path-like --model that does not exist is a path error."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _eval(tmp_path, *args, **env):
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env = {**clean, "HF_HUB_CACHE": str(tmp_path / "empty-hf-cache"), "HF_HOME": str(tmp_path / "hf-home"), **env}
    return subprocess.run([sys.executable, "-m", "harness.eval", *args, "--output", str(tmp_path / "run")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_an_unreachable_hub_is_probed_once_and_missing_models_are_named_with_their_commands(tmp_path):
    # a hub endpoint on a closed loopback port: unreachable at once, without HF_HUB_OFFLINE
    res = _eval(tmp_path, "--model", "phi-mamba", "--task", "hotpotqa", "--data", "fixture", "--distractors", "10",
                HF_ENDPOINT="http://127.0.0.1:9")
    assert res.returncode == 2
    err = res.stderr
    assert "unreachable" in err and "Retrying" not in err and "Traceback" not in err
    assert "hf download goombalab/Phi-Mamba" in err and "hf download microsoft/phi-1_5" in err
    assert "--model DIR / --tokenizer DIR" in err
    assert not (tmp_path / "run").exists()


def test_the_headline_command_offline_says_how_to_get_the_data(tmp_path):
    res = _eval(tmp_path, "--model", "phi-mamba", "--task", "hotpotqa", "--distractors", "10", HF_HUB_OFFLINE="1")
    assert res.returncode == 2 and "Retrying" not in res.stderr and "Traceback" not in res.stderr
    err = res.stderr
    assert err.count("error: ") == 1 and "--data PATH" in err and "--data fixture" in err
    assert not (tmp_path / "run").exists()


def test_a_path_like_model_that_does_not_exist_is_a_path_error(tmp_path, tiny_phi_dir):
    (tmp_path / "runs").mkdir()
    os.symlink(tiny_phi_dir, tmp_path / "runs" / "tiny-phi")
    res = _eval(tmp_path, "--model", "runs/tiny-phii", "--task", "hotpotqa", "--data", "fixture", HF_HUB_OFFLINE="1")
    assert res.returncode == 2
    assert "model directory 'runs/tiny-phii' does not exist; close names in runs/: tiny-phi" in res.stderr
