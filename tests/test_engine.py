import json

import pytest

from harness.backends.loading import load_backend
from harness.engine import run_eval
from harness.engine.prompting import PromptTemplate
from harness.backends.planner import plan_batches
from harness.engine.runlog import ResumeMismatchError
from harness.eval import main as eval_main
from harness.models import MODELS, UnknownModelError, resolve_model
from tests.helpers import assert_varied, EachBatch, run_config

_cfg = run_config


def _gens(out):
    return {json.loads(l)["key"]: json.loads(l).get("generation") for l in open(out / "samples.jsonl")}


@pytest.mark.parametrize("which", ["phi", "llama"])
def test_greedy_outputs_identical_for_batch_sizes_1_4_16(which, tmp_path, request):
    backend = request.getfixturevalue(f"{which}_backend")
    model_dir = request.getfixturevalue(f"tiny_{which}_dir")
    runs = {}
    for bs in ("1", "4", "16"):
        out = tmp_path / f"bs{bs}"
        run_eval(_cfg(model_dir, out, batch_size=bs, limit=8), backend=backend, progress=False)
        runs[bs] = _gens(out)
    assert len(runs["1"]) == 16
    assert_varied(runs["1"].values())
    assert runs["1"] == runs["4"] == runs["16"]


def test_run_directory_contents(tiny_phi_dir, phi_backend, tmp_path):
    res = run_eval(_cfg(tiny_phi_dir, tmp_path), backend=phi_backend, progress=False)
    assert list(res["metrics"]) == ["first", "last"]
    assert res["counts"] == {"questions": 6, "instances": 12, "generated": 12, "resumed": 0, "ranks": 1,
                             "skipped_too_long": 0, "stale_regenerated": 0}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["config"]["task_args"]["distractors"] == 4 and saved["config"]["template"] == "hotpotqa_cot"
    assert {"torch", "transformers", "python"} <= set(saved["versions"])
    assert saved["metrics"]["first"]["n"] == 6 and "em_se" in saved["metrics"]["first"]
    lines = [json.loads(l) for l in open(tmp_path / "samples.jsonl")]
    rec = lines[0]
    for field in ("id", "condition", "gold_start", "prompt_sha256", "prompt", "generation", "prediction", "gold", "scores"):
        assert field in rec
    pred = json.loads((tmp_path / "predictions" / "first.json").read_text())
    assert set(pred) == {"answer", "sp"} and len(pred["answer"]) == 6
    assert "| position" in (tmp_path / "table.md").read_text()


def _interrupting(inner, n):
    """A real backend that raises after ``n`` batches, as a kill mid-run would."""
    def before(k):
        if k == n:
            raise KeyboardInterrupt
    return EachBatch(inner, before)


def test_resume_after_interruption_regenerates_nothing_done(tiny_phi_dir, phi_backend, tmp_path):
    full = tmp_path / "full"
    run_eval(_cfg(tiny_phi_dir, full), backend=phi_backend, progress=False)
    part = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        run_eval(_cfg(tiny_phi_dir, part), backend=_interrupting(phi_backend, 2), progress=False)
    assert len(_gens(part)) == 8  # two batches of four were written before the kill
    with open(part / "samples.jsonl", "a") as fh:
        fh.write('{"key": "fx0005@last", "truncated')  # a write cut short by the kill
    res = run_eval(_cfg(tiny_phi_dir, part), backend=phi_backend, progress=False)
    assert res["counts"]["resumed"] == 8 and res["counts"]["generated"] == 4
    assert_varied(_gens(full).values())
    assert _gens(part) == _gens(full)
    again = run_eval(_cfg(tiny_phi_dir, part), backend=None, progress=False)  # all done: no model is loaded
    assert again["counts"]["generated"] == 0
    assert again["metrics"]["first"]["em"] == res["metrics"]["first"]["em"]


def test_resume_refuses_a_different_config(tiny_phi_dir, phi_backend, tmp_path):
    run_eval(_cfg(tiny_phi_dir, tmp_path, limit=2), backend=phi_backend, progress=False)
    with pytest.raises(ResumeMismatchError, match="max_new_tokens changed since this run started: 12 → 20"):
        run_eval(_cfg(tiny_phi_dir, tmp_path, limit=2, max_new_tokens=20), backend=phi_backend, progress=False)
    # more positions or questions with the same settings extend the run instead
    res = run_eval(_cfg(tiny_phi_dir, tmp_path, limit=3, positions=["first", "last", "middle"]),
                   backend=phi_backend, progress=False)
    assert res["counts"]["resumed"] == 4 and res["counts"]["generated"] == 5


def test_a_phi_mamba_run_resumes_through_the_cli_or_the_api_alike(tiny_phi_mamba_dir, phi_mamba_backend, tmp_path,
                                                                   capsys):
    """The scan path is in the settings hash whether the CLI decides it before loading or a backend passed in
    reports it: a run started by one resumes through the other (rows from two scans never mix)."""
    out = tmp_path / "run"
    assert eval_main(["--model", tiny_phi_mamba_dir, "--task", "hotpotqa", "--data", "fixture", "--distractors", "4",
                      "--positions", "first,last", "--limit", "1", "--max-new-tokens", "12", "--device", "cpu",
                      "--dtype", "float32", "--batch-size", "4", "--output", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert json.loads((out / "run.json").read_text())["hashed"]["scan"] == "pytorch reference"
    res = run_eval(run_config(tiny_phi_mamba_dir, out, limit=2), backend=phi_mamba_backend, progress=False)
    assert res["counts"]["resumed"] == 2 and res["counts"]["generated"] == 2
    assert eval_main(["--model", tiny_phi_mamba_dir, "--task", "hotpotqa", "--data", "fixture", "--distractors", "4",
                      "--positions", "first,last", "--limit", "2", "--max-new-tokens", "12", "--device", "cpu",
                      "--dtype", "float32", "--batch-size", "4", "--output", str(out), "--no-progress"]) == 0
    counts = json.loads((out / "results.json").read_text())["counts"]
    assert counts["resumed"] == 4 and counts["generated"] == 0


def test_overlong_prompts_are_counted_per_position_not_truncated(tiny_tokenizer, tmp_path):
    from evals.hotpotqa import HotpotQA, load_rows
    from harness.tiny import make_tiny_model

    rows = load_rows("fixture")
    instances = HotpotQA(distractors=5, positions=["first"]).instances(rows, seed=1234)
    tpl = PromptTemplate("hotpotqa_cot")
    lengths = sorted(len(tiny_tokenizer(tpl.render(**i.template_vars(), shots=4))["input_ids"]) for i in instances)
    limit = lengths[len(lengths) // 2] + 8  # a context that holds about half the prompts
    model_dir = make_tiny_model(tmp_path / "short", "phi", max_positions=limit, tokenizer=tiny_tokenizer)
    cfg = _cfg(str(model_dir), tmp_path / "run", distractors=5, limit=None, max_new_tokens=8, positions=["first", "last"])
    res = run_eval(cfg, progress=False)
    recs = [json.loads(l) for l in open(tmp_path / "run" / "samples.jsonl")]
    for pos in ("first", "last"):
        expected = sum(1 for r in recs if r["condition"] == pos
                       and len(tiny_tokenizer(r["prompt"])["input_ids"]) + 8 > limit)
        assert 0 < expected < 24
        assert res["metrics"][pos]["skipped_too_long"] == expected
        assert res["metrics"][pos]["n"] == 24 - expected
    assert all(r["prompt_tokens"] + r["new_tokens"] <= limit for r in recs if not r["skipped"])


def test_registry_paths_and_unknown_model(tiny_phi_dir, tmp_path):
    assert resolve_model("phi-1.5").path == "microsoft/phi-1_5"
    assert resolve_model("phi-mamba").backend == "phi-mamba"
    assert resolve_model("hybrid-phi-mamba").tokenizer == "microsoft/phi-1_5"
    assert resolve_model("EleutherAI/pythia-70m").backend == "transformers"
    assert resolve_model(tiny_phi_dir).backend == "transformers"
    with pytest.raises(UnknownModelError) as e:
        resolve_model("phi-15")
    for name in MODELS:
        assert name in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownModelError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_cli_end_to_end_and_bad_inputs(tiny_phi_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--data", "fixture", "--distractors", "3", "--positions", "first,2",
                    "--limit", "2", "--max-new-tokens", "6", "--device", "cpu", "--output", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| first" in printed and "| 2 " in printed
    assert eval_main(["--model", "nonexistent-model", "--task", "hotpotqa", "--data", "fixture", "--output", str(tmp_path / "x")]) == 2
    assert "Registered models" in capsys.readouterr().err
    assert eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--data", str(tmp_path / "nope.json"), "--output", str(tmp_path / "y")]) == 2
    assert "--data fixture" in capsys.readouterr().err
    assert eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--data", "fixture", "--template", "nope", "--output", str(tmp_path / "z")]) == 2
    assert "bundled templates" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--task-args", "--template-sha256"])
def test_recorded_fields_are_not_flags(flag, capsys):
    """RunConfig fields the harness fills in are refused on the command line, with the right way named."""
    with pytest.raises(SystemExit):
        eval_main(["--model", "x", "--task", "hotpotqa", flag, "{}"])
    assert "not a flag" in capsys.readouterr().err


def test_ids_file_selects_questions(tiny_phi_dir, phi_backend, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("fx0003\nfx0007\n")
    res = run_eval(_cfg(tiny_phi_dir, tmp_path / "o", ids=str(ids), limit=None), backend=phi_backend, progress=False)
    assert res["counts"]["questions"] == 2
    assert {json.loads(l)["id"] for l in open(tmp_path / "o" / "samples.jsonl")} == {"fx0003", "fx0007"}


def test_plan_batches_auto_respects_budget():
    lengths = [100, 900, 300, 500, 50]
    fixed = plan_batches(lengths, 2, 0, 10)
    assert fixed == [[1, 3], [2, 0], [4]]
    auto = plan_batches(lengths, "auto", 1900, 50)
    for b in auto:
        assert len(b) == 1 or len(b) * (max(lengths[i] for i in b) + 50) <= 1900
    assert sorted(i for b in auto for i in b) == list(range(5))


def test_vllm_backend_without_vllm_says_how_to_get_it(tiny_phi_dir, tmp_path, capsys):
    try:
        import vllm  # noqa: F401
        pytest.skip("vllm is installed here; this test is for machines without it")
    except ImportError:
        pass
    rc = eval_main(["--model", tiny_phi_dir, "--task", "hotpotqa", "--backend", "vllm", "--data", "fixture", "--limit", "1",
                    "--output", str(tmp_path / "v")])
    assert rc == 2
    assert "icr-harness[vllm]" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"own kind.*only --backend phi-mamba \(or auto\) or vllm runs it"):
        load_backend("phi-mamba", backend="transformers")


def test_every_flag_is_in_the_settings_hash_or_marked_as_never_changing_a_row():
    """``NOT_RESULT_DECIDING`` is the one list of flags left out of the hash (and of report labels); every other
    flag is hashed as itself or as what it resolves to, so a new flag must take a side."""
    import dataclasses

    from harness.backends.loading import resolve
    from harness.engine.config import NOT_RESULT_DECIDING, RunConfig

    cfg = RunConfig(task="hotpotqa", model="phi-1.5", device="cpu")
    hashed = cfg.resolved("d" * 16, "t" * 16, resolve(cfg.model, device=cfg.device))
    flags = {f.name for f in dataclasses.fields(RunConfig)}
    assert not set(NOT_RESULT_DECIDING) & set(hashed)
    resolved_as = {"data": "data_sha256", "template": "template_sha256", "device": "device_type"}
    chooses_rows = {"limit", "ids"}  # which rows exist, not what a row holds
    elsewhere = {"vllm_arg", "cuda_graphs"}  # the backend's run_identity; cuda_graphs where graphs run
    assert flags - set(hashed) - set(NOT_RESULT_DECIDING) == set(resolved_as) | chooses_rows | elsewhere
    assert all(v in hashed for v in resolved_as.values())


def test_graphed_and_compiled_decodes_hash_apart():
    """Graphs pad a batch to its bucket and a compiled step fuses kernels: rows of eager, graphed and compiled
    decodes round apart, so each is its own run; a resolved model rebuilt for another device keeps its mode."""
    from harness.backends.loading import resolve
    from harness.engine.config import RunConfig

    cfg = RunConfig(task="hotpotqa", model="phi-1.5", device="cpu")
    hashed = {mode: cfg.resolved("d" * 16, "t" * 16, resolve(cfg.model, device="cpu", cuda_graphs=mode))
              .get("cuda_graphs") for mode in ("auto", "off", "on", "compiled")}
    assert hashed == {"auto": None, "off": None, "on": True, "compiled": "compiled"}
    model = resolve("phi-mamba", device="cpu", cuda_graphs="compiled")
    assert model.compiled_decode and model.on_device("cpu").graph_mode == "compiled"
    with pytest.raises(ValueError, match="decode from CUDA graphs"):
        resolve("phi-1.5", backend="vllm", device="cpu", cuda_graphs="compiled")
