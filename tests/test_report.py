import json

from harness.config import RunConfig
from harness.engine import run_eval
from harness.report import main as report_main
from harness.report import merge, oracle_subset


def _run(model_dir, backend, out, **kw):
    cfg = RunConfig(model=model_dir, data="fixture", limit=6, max_new_tokens=8, device="cpu", dtype="float32",
                    output=str(out), batch_size="8", **kw)
    return run_eval(cfg, backend=backend, progress=False)


def test_report_merges_models_into_table_csv_and_plot(tiny_phi_dir, tiny_llama_dir, phi_backend, llama_backend,
                                                       tmp_path, capsys):
    a = tmp_path / "phi"
    b = tmp_path / "llama"
    _run(tiny_phi_dir, phi_backend, a, distractors=4, positions=["first", "middle", "last"])
    _run(tiny_llama_dir, llama_backend, b, distractors=4, positions=["first", "middle", "last"])
    out = tmp_path / "report"
    assert report_main([str(a), str(b), "--out", str(out)]) == 0
    df = merge([str(a), str(b)])
    assert len(df) == 6 and set(df.position) == {"first", "middle", "last"}
    assert (out / "report.csv").exists() and (out / "em_by_position.png").stat().st_size > 10_000
    assert tiny_llama_dir in (out / "report.md").read_text()
    assert "first" in capsys.readouterr().out


def test_subset_keeps_only_questions_every_oracle_run_answered(tiny_phi_dir, phi_backend, tmp_path):
    o1, o2, run = tmp_path / "o1", tmp_path / "o2", tmp_path / "run"
    _run(tiny_phi_dir, phi_backend, o1, distractors=0)
    _run(tiny_phi_dir, phi_backend, run, distractors=3, positions=["first", "last"])
    # mark some oracle answers correct by hand-editing copies of the real samples: the subset logic is what is tested
    for src, dst, good in ((o1, o1, {"fx0001", "fx0002", "fx0004"}), (o1, o2, {"fx0002", "fx0004", "fx0005"})):
        recs = [json.loads(l) for l in open(src / "samples.jsonl")]
        dst.mkdir(exist_ok=True)
        for r in recs:
            r["scores"]["em"] = 1.0 if r["id"] in good else 0.0
        (dst / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (dst / "results.json").write_text((o1 / "results.json").read_text())
    keep = oracle_subset([str(o1), str(o2)])
    assert keep == {"fx0002", "fx0004"}
    df = merge([str(run)], keep)
    assert list(df.n) == [2, 2]
