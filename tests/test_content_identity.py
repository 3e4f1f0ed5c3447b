"""Runs are identified by content, not by path (issue 20): a checkpoint changed in place, an edited tokenizer, a
re-downloaded hub model, a replaced directory, a row without a settings hash — each is refused by name or
never counted; a moved checkpoint is the same run."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evals.fixture import FIXTURE_PATH
from harness.engine import run_eval
from harness.cache import FileHashCache
from harness.engine.identity import model_identity
from harness.engine.runlog import ResumeMismatchError, RunDirError
from harness.eval import main as eval_main
from tests.helpers import EachBatch, ctrl_c_reaches, run_config

REPO = Path(__file__).resolve().parent.parent


def _cfg(model_dir, out, **kw):
    return run_config(model_dir, out, **{"limit": 2, "max_new_tokens": 6, **kw})


@pytest.fixture
def ckpt(tmp_path, tiny_phi_dir):
    """A private copy of the tiny Phi checkpoint that a test may change in place."""
    return Path(shutil.copytree(tiny_phi_dir, tmp_path / "ckpt"))


def _cli(model, out, *extra):
    return ["--model", str(model), "--task", "hotpotqa", "--data", "fixture", "--limit", "2", "--max-new-tokens", "6", "--device", "cpu",
            "--output", str(out), "--no-progress", *extra]


# ------------------------------------------------------------------------------------------ model content
def test_weights_replaced_in_place_are_refused_by_name(ckpt, tmp_path, tiny_tokenizer, capsys):
    from harness.tiny import make_tiny_model

    out = tmp_path / "run"
    assert eval_main(_cli(ckpt, out)) == 0
    before = (ckpt / "model.safetensors").read_bytes()
    make_tiny_model(tmp_path / "retrained", "phi", seed=7, tokenizer=tiny_tokenizer)
    shutil.copy(tmp_path / "retrained" / "model.safetensors", ckpt / "model.safetensors")  # retrained, same path
    assert (ckpt / "model.safetensors").read_bytes() != before
    capsys.readouterr()
    assert eval_main(_cli(ckpt, out, "--limit", "4")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model weights changed since this run started" in err
    assert "--overwrite" in err and "Traceback" not in err
    rows = [json.loads(l) for l in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6  # nothing was added by the refused run
    # --overwrite starts over and keeps the old run's files aside
    assert eval_main(_cli(ckpt, out, "--overwrite")) == 0
    (aside,) = out.glob("replaced-*")
    assert (aside / "samples.jsonl").read_text().count("\n") == 6 and (aside / "run.json").exists()
    res = json.loads((out / "results.json").read_text())
    assert res["counts"]["generated"] == 6 and res["counts"]["resumed"] == 0


def test_an_edited_tokenizer_is_refused_by_name(ckpt, tmp_path, phi_backend):
    out = tmp_path / "run"
    run_eval(_cfg(ckpt, out), backend=phi_backend, progress=False)
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][:-50]  # a "fixed" tokenizer: still loads, splits differently
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ResumeMismatchError, match="tokenizer files changed since this run started"):
        run_eval(_cfg(ckpt, out), backend=phi_backend, progress=False)


def test_a_changed_config_and_package_versions_are_part_of_the_identity(ckpt):
    a = model_identity(str(ckpt), None)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_theta"] = 1234.0
    (ckpt / "config.json").write_text(json.dumps(cfg))
    b = model_identity(str(ckpt), None)
    assert a["model_config"] != b["model_config"] and a["model_weights"] == b["model_weights"]
    assert {"torch", "transformers", "icr-harness"} <= set(a["software"])
    # files that are not the model's (a trainer's logs, an eval folder, hidden state) are not part of it
    (ckpt / "train_log.jsonl").write_text("{}\n")
    (ckpt / ".training_state.pt").write_bytes(b"x")
    assert model_identity(str(ckpt), None) == b


def test_a_moved_checkpoint_is_the_same_run(ckpt, tmp_path, phi_backend):
    out = tmp_path / "run"
    run_eval(_cfg(ckpt, out), backend=phi_backend, progress=False)
    moved = Path(shutil.move(str(ckpt), tmp_path / "elsewhere"))
    res = run_eval(_cfg(moved, out), backend=phi_backend, progress=False)
    assert res["counts"]["resumed"] == 4 and res["counts"]["generated"] == 0


def test_file_hashes_are_cached_by_stat_and_any_rewrite_is_seen(tmp_path, monkeypatch):
    import harness.cache as cache_module

    calls = []
    real = cache_module.file_digest
    monkeypatch.setattr(cache_module, "file_digest", lambda p: calls.append(p) or real(p))
    cache = FileHashCache(tmp_path / "cache.json")
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 4096)
    past = time.time() - 3600
    os.utime(f, (past, past))
    first = cache.sha256(f)
    assert FileHashCache(tmp_path / "cache.json").sha256(f) == first and len(calls) == 1  # read once, then cached
    f.write_bytes(b"b" * 4096)  # same size, same mtime: only the content (and ctime) changed
    os.utime(f, (past, past))
    assert FileHashCache(tmp_path / "cache.json").sha256(f) != first and len(calls) == 2
    g = tmp_path / "fresh.bin"
    g.write_bytes(b"c")  # written just now: may change again within the clock's resolution, never cached
    cache.sha256(g)
    cache.sha256(g)
    assert len(calls) == 4


def _hub_snapshot(cache: Path, repo: str, commit: str, src: Path) -> None:
    """A Hugging Face cache entry in the hub's real layout: snapshots/COMMIT/ and refs/main naming it."""
    base = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(src, base / "snapshots" / commit)
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(commit)


@pytest.mark.slow
def test_a_redownloaded_hub_model_is_refused_by_its_commit(tmp_path, tiny_phi_dir, tiny_tokenizer):
    """Loaded by hub id from the HF cache, offline, in a real process: the run is keyed by the snapshot commit;
    after a re-download that moved main to another commit the run is refused, naming both commits."""
    from harness.tiny import make_tiny_model

    cache = tmp_path / "hf"
    _hub_snapshot(cache, "icr-test/tiny-phi", "a" * 40, Path(tiny_phi_dir))
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "ICR_CACHE": str(tmp_path / "icr")}
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness.eval", *_cli("icr-test/tiny-phi", out)]
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads((out / "run.json").read_text())["hashed"]["model_weights"] == f"hub:icr-test/tiny-phi@{'a' * 40}"
    make_tiny_model(tmp_path / "v2", "phi", seed=3, tokenizer=tiny_tokenizer)
    _hub_snapshot(cache, "icr-test/tiny-phi", "b" * 40, tmp_path / "v2")
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2
    assert f"model weights changed since this run started: hub:icr-test/tiny-phi@{'a' * 40} → " \
           f"hub:icr-test/tiny-phi@{'b' * 40}" in again.stderr


# ------------------------------------------------------------------------------------------ every row checked
def test_a_row_without_a_settings_hash_is_never_accepted(ckpt, tmp_path, phi_backend):
    out = tmp_path / "run"
    run_eval(_cfg(ckpt, out), backend=phi_backend, progress=False)
    rows = [json.loads(l) for l in (out / "samples.jsonl").read_text().splitlines()]
    del rows[1]["config_hash"]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ResumeMismatchError, match="no settings hash"):
        run_eval(_cfg(ckpt, out), backend=phi_backend, progress=False)


def test_the_report_counts_only_rows_of_the_runs_settings(ckpt, tmp_path, phi_backend):
    from harness.reports.runs import ReportError, load_run

    out = tmp_path / "run"
    run_eval(_cfg(ckpt, out), backend=phi_backend, progress=False)
    assert len(load_run(out)[1]) == 4
    rows = [json.loads(l) for l in (out / "samples.jsonl").read_text().splitlines()]
    rows[0]["config_hash"] = "0123456789abcdef"  # a row of another run, put there after the run finished
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ReportError, match="only 3 of them made with its settings"):
        load_run(out)


def _replaces_its_directory(backend, out: Path):
    """A real backend whose second batch finds its run directory replaced by another process's (moved away
    and recreated with a foreign row), as a second run that deleted and recreated --output would leave it."""
    def before(k):
        if k == 1:
            os.rename(out, out.parent / "moved")
            out.mkdir()
            (out / "samples.jsonl").write_text(json.dumps({"key": "x@first", "config_hash": "other"}) + "\n")
    return EachBatch(backend, before)


def test_a_directory_replaced_mid_run_fails_loudly_and_writes_no_results(ckpt, tmp_path, phi_backend):
    out = tmp_path / "run"
    backend = _replaces_its_directory(phi_backend, out)
    with pytest.raises(RunDirError, match="deleted, moved or replaced"):
        run_eval(_cfg(ckpt, out, limit=4, batch_size="2"), backend=backend, progress=False)
    assert backend.calls == 2
    assert not (out / "results.json").exists() and not (tmp_path / "moved" / "results.json").exists()
    assert (out / "samples.jsonl").read_text().count("\n") == 1  # the other run's file, untouched


def test_a_failed_start_leaves_no_directory_behind(ckpt, tmp_path, capsys):
    (ckpt / "model.safetensors").write_bytes(b"not a checkpoint")
    out = tmp_path / "new" / "run"
    assert eval_main(_cli(ckpt, out)) == 2
    assert "error: " in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------------------ bad input
def test_a_non_utf8_data_file_is_an_error_naming_it(tiny_phi_dir, tmp_path, capsys):
    data = tmp_path / "latin1.json"
    data.write_bytes(FIXTURE_PATH.read_text().replace("Ostland", "Östland").encode("latin-1", "replace"))
    out = tmp_path / "run"
    assert eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--data", str(data), "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{data} is not UTF-8" in err and "line " in err and "Traceback" not in err
    assert not out.exists()


def test_a_template_rendering_an_empty_prompt_is_an_error(tiny_phi_dir, tmp_path, capsys):
    tpl = tmp_path / "blank.j2"
    tpl.write_text("{% if false %}{{ question }}{% endif %}\n")
    out = tmp_path / "run"
    assert eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--data", "fixture", "--template", str(tpl), "--output", str(out),
                      "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"template {tpl} renders an empty prompt" in err
    assert not out.exists()


def test_a_tokenizer_without_eos_is_an_error_before_anything_is_written(ckpt, tmp_path, capsys):
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["eos_token"] = None
    cfg["pad_token"] = None
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(ckpt).eos_token_id is None  # the edit took
    out = tmp_path / "run"
    assert eval_main(_cli(ckpt, out)) == 2
    err = capsys.readouterr().err
    assert "has no eos token" in err and str(ckpt) in err and "Traceback" not in err
    assert not out.exists()


# ------------------------------------------------------------------------------------------ templates
def test_templates_are_sandboxed(tmp_path, tiny_phi_dir, capsys):
    marker = tmp_path / "pwned"
    tpl = tmp_path / "evil.j2"
    tpl.write_text("{{ cycler.__init__.__globals__.os.system('touch %s') }}{{ question }}\n" % marker)
    out = tmp_path / "run"
    assert eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--data", "fixture", "--template", str(tpl), "--output", str(out),
                      "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error: template" in err and "unsafe" in err
    assert not marker.exists() and not out.exists()


def test_a_template_includes_its_sibling_and_is_hashed_with_it(tmp_path):
    from harness.engine.prompting import PromptTemplate, TemplateError

    (tmp_path / "shots.j2").write_text("Q: What is two? A: 2\n")
    (tmp_path / "main.j2").write_text('{% include "shots.j2" %}\nQ: {{ question }} A:')
    t = PromptTemplate(str(tmp_path / "main.j2"))
    assert t.render(question="one?") == "Q: What is two? A: 2\nQ: one? A:"
    (tmp_path / "shots.j2").write_text("Q: What is three? A: 3\n")
    assert PromptTemplate(str(tmp_path / "main.j2")).sha256 != t.sha256  # an edited include is another template
    (tmp_path / "bad.j2").write_text('{% include "missing.j2" %}{{ question }}')
    with pytest.raises(TemplateError, match="includes 'missing.j2', which is neither beside it"):
        PromptTemplate(str(tmp_path / "bad.j2"))


# ------------------------------------------------------------------------------------------ Ctrl-C, SIGTERM
@pytest.mark.slow
def test_an_interrupted_eval_says_what_it_kept_and_resumes(tiny_phi_dir, tmp_path):
    import signal

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness.eval", "--model", tiny_phi_dir, "--task", "hotpotqa", "--data", "fixture", "--limit", "12",
           "--max-new-tokens", "64", "--batch-size", "1", "--no-prefix-reuse", "--device", "cpu", "--output", str(out),
           "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, preexec_fn=ctrl_c_reaches)
    samples = out / "samples.jsonl"
    deadline = time.time() + 120
    while not (samples.exists() and samples.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted: " in err and "rerun the same command to resume" in err
    kept = samples.read_text().count("\n")
    assert 2 <= kept < 36 and f"{kept} finished row(s) are kept" in err
    assert eval_main(cmd[3:]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["counts"]["resumed"] == kept and res["counts"]["generated"] == 36 - kept


def test_a_lock_file_replaced_under_a_run_is_seen(tmp_path):
    """Another process that deleted the lock file and took a new one holds the directory now: the first run's
    check fails, naming the lock file."""
    from harness.engine.runlog import RunLock

    lock = RunLock(tmp_path / "run").acquire()
    lock.verify()
    (tmp_path / "run" / ".lock").unlink()
    (tmp_path / "run" / ".lock").touch()
    with pytest.raises(RunDirError, match="lock file"):
        lock.verify()
    lock.release()


def test_a_checkpoint_rewritten_while_it_loads_is_refused(ckpt, tmp_path, tiny_tokenizer, monkeypatch):
    """Hashed, then loaded while another process writes a retrained checkpoint into the folder: which weights
    were read is unknown, so nothing is written under either identity."""
    from harness.backends.loading import ResolvedModel
    from harness.tiny import make_tiny_model

    make_tiny_model(tmp_path / "other", "phi", seed=5, tokenizer=tiny_tokenizer)
    real = ResolvedModel.load

    def load_while_rewritten(model):
        backend = real(model)
        shutil.copy(tmp_path / "other" / "model.safetensors", ckpt / "model.safetensors")
        return backend

    monkeypatch.setattr(ResolvedModel, "load", load_while_rewritten)
    out = tmp_path / "run"
    with pytest.raises(ResumeMismatchError, match="model weights changed"):
        run_eval(_cfg(ckpt, out), progress=False)
    assert not out.exists()
