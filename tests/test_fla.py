"""flash-linear-attention's models through the transformers backend. fla's kernels are Triton only, so on CPU they
run under Triton's interpreter, which must be on before triton is imported: each check runs in a child process.
The whole family matrix (tests/test_families.py, with fla's families) takes minutes a family there; CI runs a
compact version of it for GLA: ``TRITON_INTERPRET=1 pytest tests/test_families.py`` runs all of it."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                               reason='fla is not installed: pip install "icr-harness[fla]"')

COMPACT = """
import json, tempfile, warnings
warnings.simplefilter("ignore")
from harness.backends.loading import load_backend
from harness.backends.generation import greedy_generate
from harness.tiny import build_tokenizer, make_tiny_model
from tests.helpers import QUESTIONS, family_requests, generate_with, RecomputeReference, result_fields

arch = {arch!r}
path = make_tiny_model(tempfile.mkdtemp() + "/m", arch, tokenizer=build_tokenizer(), init_std=0.2)
b = load_backend(str(path), device="cpu", dtype="float32")
tok = b.tokenizer
reqs = lambda end: family_requests(tok, end, max_new=6)[:2]  # two: each costs ~20 s in the interpreter
# without the tool, only to find a character the model writes (the reference below is what is compared): the
# backend's own decode, alone and unpadded, costs a fraction of recomputing every sequence under the interpreter
plain = generate_with(b, reqs(None), 1, "none")
counts = {{}}
for r in plain:
    for ch in set(r.text[:-2]):
        counts[ch] = counts.get(ch, 0) + 1
end = max(sorted(counts), key=counts.get)  # a text the model writes, so the tool is called mid-generation
ref = [greedy_generate(RecomputeReference(b.model), tok, [r])[0] for r in reqs(end)]
same = {{f"batch {{n}}, prefix reuse {{reuse}}": result_fields(generate_with(b, reqs(end), n, reuse)) == result_fields(ref)
        for n, reuse in [(2, "batch"), (1, "batch"), (2, "none"), (2, "tree")]}}
print("RESULT " + json.dumps({{"family": b.family.name, "padding": b.family.padding, "same": same,
                              "distinct": len({{r.text for r in plain}}),
                              "tool_lengths": sorted({{e - s for r in ref for s, e in r.tool_spans}})}}))
"""


def _child(code: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=env)


@pytest.mark.slow
@needs_fla
def test_gla_batches_exactly_with_tool_calls_under_the_interpreter():
    """Batch 2 with the prefix reused == batch 1 == no reuse == an uncached per-sample reference, with tool
    results of different lengths (ragged right-padded blocks) on prompts whose generations differ."""
    res = _child(COMPACT.format(arch="gla"), interpret=True)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, res.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    assert got["family"] == "gla" and got["padding"] == "masked"
    assert got["distinct"] >= 2 and len(got["tool_lengths"]) >= 2
    assert all(got["same"].values()), got["same"]


@pytest.mark.slow
@needs_fla
def test_an_fla_model_on_cpu_without_the_interpreter_is_one_clear_error(tmp_path):
    code = (f"from harness.tiny import make_tiny_model\nmake_tiny_model({str(tmp_path / 'm')!r}, 'gla')\n"
            "from harness.backends.loading import load_backend\n"
            f"try:\n    load_backend({str(tmp_path / 'm')!r}, device='cpu')\n"
            "except Exception as e:\n    print('RESULT', type(e).__name__, e)\n")
    res = _child(code, interpret=False)
    assert "RESULT" in res.stdout, res.stderr[-3000:]
    assert "TRITON_INTERPRET=1" in res.stdout and "need a GPU" in res.stdout


@pytest.mark.slow
def test_an_fla_checkpoint_without_fla_installed_is_one_error_line_with_the_install_command(tmp_path):
    """Runs with or without fla: the child blocks its import, as a machine without the extra has none."""
    from harness.tiny import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gla", "hidden_size": 64}))
    code = ("import sys\nsys.modules['fla'] = None  # what a missing package looks like to import\n"
            "from harness.eval import main\n"
            f"sys.exit(main(['--model', {str(tmp_path)!r}, '--task', 'hotpotqa', '--device', 'cpu', "
            f"'--data', 'fixture', '--limit', '1', '--output', {str(tmp_path / 'out')!r}]))\n")
    res = _child(code, interpret=False)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    err = res.stderr.strip().splitlines()
    assert err[-1].startswith("error: ") and "'gla' checkpoint" in err[-1] and 'icr-harness[fla]' in err[-1]
    assert "Traceback" not in res.stderr
