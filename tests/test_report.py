import json
from pathlib import Path

import pytest

from harness.engine import run_eval
from harness.report import main as report_main
from harness.reports.runs import merge, oracle_subset
from tests.helpers import run_config


def _run(model_dir, backend, out, **kw):
    kw = {"limit": 6, "max_new_tokens": 8, "batch_size": "8", **kw}
    cfg = run_config(model_dir, out, **kw)
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
    assert len(df) == 6 and set(df.condition) == {"first", "middle", "last"}
    assert (out / "report.csv").exists() and (out / "em_by_position.png").stat().st_size > 10_000
    assert "llama0/ckpt" in (out / "report.md").read_text()  # short legend names, unambiguous
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


@pytest.mark.slow
def test_three_runs_are_three_labelled_lines_with_readable_ticks(tiny_phi_dir, tiny_llama_dir, phi_backend,
                                                                 llama_backend, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from unittest import mock

    from harness.reports.figures import plot

    runs = [tmp_path / "phi-k10", tmp_path / "llama-k10", tmp_path / "llama-k20"]
    _run(tiny_phi_dir, phi_backend, runs[0], distractors=10, positions=["first", "middle", "last"])
    _run(tiny_llama_dir, llama_backend, runs[1], distractors=10, positions=["first", "middle", "last"])
    _run(tiny_llama_dir, llama_backend, runs[2], distractors=20, positions=["first", "middle", "last"])
    df = merge([str(r) for r in runs])
    assert list(dict.fromkeys(df.run)) == ["phi0/ckpt k=10", "llama0/ckpt k=10", "llama0/ckpt k=20"]
    captured = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def grab(fig, *a, **kw):
        ax = fig.axes[0]
        captured["lines"] = [t.get_text() for t in ax.get_legend().get_texts()]
        captured["ticks"] = {int(x): lab.get_text() for x, lab in zip(ax.get_xticks(), ax.get_xticklabels())}
        captured["title"] = ax.get_title()
        return real_savefig(fig, *a, **kw)

    with mock.patch.object(matplotlib.figure.Figure, "savefig", grab):
        plot(df, "f1", tmp_path / "f1.png")
    assert captured["lines"] == ["phi0/ckpt k=10", "llama0/ckpt k=10", "llama0/ckpt k=20"]
    assert sorted(captured["ticks"]) == list(range(21))  # one tick per slot
    assert captured["ticks"][0] == "0\nfirst" and captured["ticks"][5] == "5\nmiddle"
    assert captured["ticks"][10] == "10\nlast\nmiddle" and captured["ticks"][20] == "20\nlast"  # shared slot: one label
    assert captured["ticks"][7] == "7" and captured["title"].startswith("hotpotqa: f1 by position")


def test_an_empty_subset_is_a_clear_message(tiny_phi_dir, phi_backend, tmp_path, capsys):
    oracle, run = tmp_path / "oracle", tmp_path / "run"
    _run(tiny_phi_dir, phi_backend, oracle, distractors=0)
    _run(tiny_phi_dir, phi_backend, run, distractors=3, positions=["first"])
    assert oracle_subset([str(oracle)]) == set()  # a random model answers nothing
    rc = report_main([str(run), "--subset", str(oracle), "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --subset kept no question") and "Traceback" not in err
    assert report_main([str(run), "--metric", "nope", "--out", str(tmp_path / "rep")]) == 2
    assert "--metric 'nope'" in capsys.readouterr().err


def test_official_gold_reproduces_the_harness_numbers_with_the_official_division(tiny_phi_dir, phi_backend,
                                                                                  tmp_path):
    """The official script averages over every gold row and scores a row without a prediction as 0. With the
    gold cut to the scored ids it must print the harness's EM/F1; with the full gold, the skipped-as-0 figure."""
    from evals.hotpotqa import HotpotQA
    from evals.metrics import exact_match, f1_score

    run = tmp_path / "run"
    res = _run(tiny_phi_dir, phi_backend, run, distractors=3, positions=["first", "last"])
    recs = [json.loads(l) for l in open(run / "samples.jsonl")]
    for r in recs[:4]:  # give some rows right answers so the numbers are not all zero
        r["prediction"], r["answer_found"] = r["gold"], True
        r["scores"] = {"em": 1.0, "f1": 1.0, "contains": 1.0}
    recs[5]["skipped"] = "prompt_too_long"  # and one skipped prompt
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "results.json").unlink()
    res = _run(tiny_phi_dir, phi_backend, run, distractors=3, positions=["first", "last"])
    assert report_main([str(run), "--official-gold", str(tmp_path / "gold"), "--out", str(tmp_path / "rep")]) == 0
    all_gold = {r["_id"]: r for r in HotpotQA(data="fixture").load()}
    for pos in ("first", "last"):
        pred = json.loads((run / "predictions" / f"{pos}.json").read_text())["answer"]
        gold = json.loads((tmp_path / "gold" / "run" / f"{pos}.json").read_text())

        def official(gold_rows):
            em = sum(exact_match(pred[g["_id"]], g["answer"]) if g["_id"] in pred else 0 for g in gold_rows)
            f1 = sum(f1_score(pred[g["_id"]], g["answer"]) if g["_id"] in pred else 0 for g in gold_rows)
            return em / len(gold_rows), f1 / len(gold_rows)

        m = res["metrics"][pos]
        assert len(gold) == m["n"] and official(gold) == (m["em"], m["f1"])
        full = [all_gold[i] for i in res["selection"]["ids"]]
        assert official(full)[0] == m["em_skipped_as_0"]
    assert res["metrics"]["first"]["em"] > 0 and res["metrics"]["last"]["skipped"] + res["metrics"]["first"]["skipped"] == 1


def test_a_run_whose_results_json_was_cut_is_an_error_line(tiny_phi_dir, phi_backend, tmp_path, capsys):
    run = tmp_path / "run"
    _run(tiny_phi_dir, phi_backend, run, distractors=2, positions=["first"])
    (run / "results.json").write_text("")  # what an in-place write left when killed
    assert report_main([str(run), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "results.json is not valid JSON" in err


def test_the_report_never_modifies_a_run_it_reads(tiny_phi_dir, phi_backend, tmp_path):
    """A run being written may end in a half-written line; reading it for a report must leave it alone."""
    run = tmp_path / "run"
    _run(tiny_phi_dir, phi_backend, run, distractors=2, positions=["first"])
    samples = run / "samples.jsonl"
    samples.write_bytes(samples.read_bytes() + b'{"key": "fx9999@first", "gen')  # another process mid-write
    before = samples.read_bytes()
    assert report_main([str(run), "--out", str(tmp_path / "rep")]) == 0
    assert samples.read_bytes() == before


def _figure(monkeypatch):
    """What the report draws: each figure's axes, captured as it is saved."""
    import harness.reports.plotting as plotting

    figures = []
    real = plotting.save

    def grab(fig, path, dpi, tight=True):
        figures.append({"path": path, "axes": [{"xlabel": ax.get_xlabel(), "title": ax.get_title(),
                                                "ticks": [t.get_text() for t in ax.get_xticklabels()],
                                                "yticks": [t.get_text() for t in ax.get_yticklabels()],
                                                "legend": [t.get_text() for t in ax.get_legend().get_texts()]
                                                if ax.get_legend() else []}
                                               for ax in fig.axes]})
        return real(fig, path, dpi, tight)

    import harness.reports.figures as figures_module

    monkeypatch.setattr(figures_module, "save", grab)  # the name the report draws with
    return figures


def test_every_task_is_drawn_on_its_own_axis(tiny_phi_dir, tiny_llama_dir, phi_backend, llama_backend, tmp_path,
                                             monkeypatch, capsys):
    """A swept size (MQAR's pairs) is one line per model over its values; the needle is a length x depth heatmap
    per model; runs of different tasks never share a figure or a table."""
    runs = {}
    for name, model, backend in (("phi", tiny_phi_dir, phi_backend), ("llama", tiny_llama_dir, llama_backend)):
        runs[f"mqar-{name}"] = tmp_path / f"mqar-{name}"
        run_eval(run_config(model, runs[f"mqar-{name}"], task="mqar", task_args={"pairs": [4, 8, 16], "samples": 3},
                            limit=None, max_new_tokens=None), backend=backend, progress=False)
        runs[f"needle-{name}"] = tmp_path / f"needle-{name}"
        run_eval(run_config(model, runs[f"needle-{name}"], task="needle", limit=None, max_new_tokens=None,
                            task_args={"lengths": [96, 192], "depths": [0.0, 0.5, 1.0], "samples": 2}),
                 backend=backend, progress=False)
    figures = _figure(monkeypatch)
    out = tmp_path / "rep"
    assert report_main([*map(str, runs.values()), "--out", str(out)]) == 0
    by_name = {Path(f["path"]).name: f["axes"] for f in figures}
    assert sorted(by_name) == ["mqar_accuracy_by_pairs.png", "mqar_accuracy_vs_context_length.png",
                               "mqar_accuracy_vs_state_memory.png", "needle_accuracy_by_length_depth.png",
                               "needle_accuracy_vs_context_length.png", "needle_accuracy_vs_state_memory.png"]
    (state,) = by_name["mqar_accuracy_vs_state_memory.png"]
    assert state["xlabel"] == "model state the prompt left (bytes)" and state["legend"] == ["phi0/ckpt", "llama0/ckpt"]
    (mq,) = by_name["mqar_accuracy_by_pairs.png"]
    assert mq["xlabel"] == "pairs" and mq["ticks"] == ["4", "8", "16"] and mq["legend"] == ["phi0/ckpt", "llama0/ckpt"]
    heat = [a for a in by_name["needle_accuracy_by_length_depth.png"] if a["title"]]
    assert [a["title"] for a in heat] == ["phi0/ckpt", "llama0/ckpt"]
    assert heat[0]["ticks"] == ["96", "192"] and heat[0]["yticks"] == ["0", "0.5", "1"]
    assert heat[0]["xlabel"] == "context length (model tokens)"
    md = (out / "report.md").read_text()
    assert "## mqar" in md and "## needle" in md and "pairs=16" in md and "192@0.5" in md
    for png in out.glob("*.png"):
        assert png.stat().st_size > 10_000


def test_a_task_option_is_swept_in_one_run(tiny_phi_dir, tmp_path, capsys):
    from harness.eval import main as eval_main

    out = tmp_path / "run"
    base = ["--model", tiny_phi_dir, "--task", "mqar", "--task-arg", "samples=4", "--output", str(out), "--no-progress",
            "--device", "cpu"]
    assert eval_main([*base, "--task-arg", "pairs=4,8"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["metrics"]) == ["pairs=4", "pairs=8"] and res["counts"]["instances"] == 8
    assert res["config"]["task_args"]["pairs"] == [4, 8]
    prompts = [json.loads(l)["prompt"] for l in (out / "samples.jsonl").read_text().splitlines()]
    assert len(set(prompts)) == 8  # every value its own samples
    assert eval_main([*base, "--task-arg", "pairs=4,8", "--limit", "2"]) == 0  # --limit: per value, resumed
    res = json.loads((out / "results.json").read_text())
    assert res["counts"]["instances"] == 4 and res["counts"]["resumed"] == 4
    capsys.readouterr()
    assert eval_main([*base, "--task-arg", "queries=1,2"]) == 2
    assert "'queries' takes one value; sweepable in one run: pairs" in capsys.readouterr().err
    assert eval_main([*base, "--task-arg", "pairs=4,100"]) == 2  # each value checked: 100 pairs > 64 keys
    assert "pairs (100)" in capsys.readouterr().err
