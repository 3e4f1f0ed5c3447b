"""``python -m harness.report RUN_DIR...``: merge runs into one table and one plot.

    python -m harness.report runs/phi-1.5-k10 runs/phi-mamba-k10 runs/phi-mamba-k20 --out reports/k10
    python -m harness.report runs/phi-1.5 runs/phi-mamba --subset runs/phi-1.5-oracle runs/phi-mamba-oracle
    python -m harness.report runs/phi-1.5 --official-gold reports/gold

Each run is labelled by the settings that differ between the runs given (model, distractors, template,
retrieval, shots, ...), and counts exactly the rows its results.json selected (a narrower rerun into the same
directory keeps older rows in samples.jsonl; they are not counted). ``--subset`` keeps only questions that
every oracle run (``--distractors 0``) answered correctly by ``--subset-metric``, the paper's way of
separating retrieval failures from questions a model cannot answer at all. ``--official-gold`` writes, per
run and position, the gold file cut to the questions the harness scored, so the official
``hotpot_evaluate_v1.py`` reproduces the harness's numbers (skipped prompts are left out, see README)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from harness.results import format_markdown
from harness.stats import condition_of, summarize
from harness.runlog import savefig_atomic, write_atomic

# Settings that name a run in a legend when they differ between the runs of one report, in this order.
LABEL_FIELDS = ("model", "distractors", "retrieval", "template", "shots", "max_new_tokens", "task_args", "data",
                "dtype", "backend", "seed", "stop", "max_tool_calls", "tool_timeout")


class ReportError(ValueError):
    pass


def load_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """results.json and the samples it counted (its selection of ids and positions)."""
    from harness.runlog import SampleLog

    run_dir = Path(run_dir)
    res_file = run_dir / "results.json"
    if not res_file.is_file() or not (run_dir / "samples.jsonl").is_file():
        raise ReportError(f"{run_dir} is not a finished run directory (needs results.json and samples.jsonl); "
                          "run harness.eval into it first, or rerun it to finish")
    try:
        results = json.loads(res_file.read_text())
    except ValueError as e:
        raise ReportError(f"{res_file} is not valid JSON ({e}); rerun the evaluation to rewrite it") from e
    run_hash = results.get("config_hash")
    every = list(SampleLog(run_dir, read_only=True).records.values())
    records = [r for r in every if r.get("config_hash") == run_hash]  # only rows made with the run's settings
    sel = results.get("selection")
    if sel:
        keys = {f"{i}@{p}" for i in sel["ids"] for p in _conditions(results)}
        records = [r for r in records if r["key"] in keys]
        if len(records) < len(keys):
            raise ReportError(f"{run_dir}: results.json counted {len(keys)} rows, but samples.jsonl holds only "
                              f"{len(records)} of them made with its settings (hash {run_hash}); the directory was "
                              "changed after the run finished. Rerun the evaluation into it to make them again.")
    return results, records


def _conditions(results: dict) -> list[str]:
    sel = results.get("selection") or {}
    return sel.get("conditions") or sel.get("positions") or list(results["metrics"])


def _settings(cfg: dict) -> dict:
    """A run's config with its task's options at the top level (HotpotQA's distractors, shots, ...)."""
    return {**{k: v for k, v in cfg.items() if k != "task_args"}, **(cfg.get("task_args") or {})}


def oracle_subset(oracle_dirs: list[str], metric: str = "em") -> set[str]:
    """Ids answered correctly (metric == 1) in every given run."""
    keep: set[str] | None = None
    for d in oracle_dirs:
        _, samples = load_run(d)
        if samples and metric not in next(s for s in samples if not s.get("skipped"))["scores"]:
            raise ReportError(f"--subset-metric {metric!r}: {d} has no such metric")
        good = {s["id"] for s in samples if not s.get("skipped") and s["scores"][metric] >= 1.0}
        keep = good if keep is None else keep & good
    return keep or set()


def run_labels(configs: list[dict]) -> list[str]:
    """Short legend names from what differs between the runs (just the model when nothing else does)."""
    def value(cfg, k):
        v = cfg.get(k)
        if k == "model":
            return _short_model(str(v), [str(c.get("model")) for c in configs])
        if k == "retrieval":
            return "+retrieval" if v else "no retrieval"
        if k == "distractors":
            return "oracle" if v == 0 else f"k={v}"
        return f"{k}={v}"

    import dataclasses

    from harness.config import RunConfig

    run_flags = {f.name for f in dataclasses.fields(RunConfig)}
    task_options = sorted({k for c in configs for k in c} - run_flags - set(LABEL_FIELDS) - {"positions"})
    fields = list(LABEL_FIELDS) + task_options
    differ = [k for k in fields if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in configs}) > 1]
    shown = ["model", *[k for k in differ if k != "model"]]
    labels = [" ".join(value(c, k) for k in shown) for c in configs]
    if len(set(labels)) < len(labels):  # same settings: tell the runs apart by their directories
        labels = [f"{lab} [{Path(c['output']).name}]" for lab, c in zip(labels, configs)]
    return labels


def _short_model(model: str, all_models: list[str]) -> str:
    """The last path part ("runs/tiny-phi" -> "tiny-phi"), or more of it where that alone is ambiguous."""
    parts = Path(model.rstrip("/")).parts
    for n in range(1, len(parts) + 1):
        short = "/".join(parts[-n:])
        if sum(1 for m in set(all_models) if "/".join(Path(m.rstrip("/")).parts[-n:]) == short) <= 1:
            return short
    return model


def merge(run_dirs: list[str], keep_ids: set[str] | None = None) -> pd.DataFrame:
    loaded = [load_run(d) for d in run_dirs]
    labels = run_labels([_settings(res["config"]) for res, _ in loaded])
    rows = []
    for d, label, (results, samples) in zip(run_dirs, labels, loaded):
        cfg = _settings(results["config"])
        first = next(iter(results["metrics"].values()), {})
        metrics = tuple(k for k in first if f"{k}_se" in first)
        by_pos = summarize(samples, metrics, _conditions(results), keep_ids=keep_ids, seed=cfg.get("seed", 0))
        for pos, m in by_pos.items():
            rows.append({"run": label, "dir": str(d), "distractors": cfg.get("distractors"), "position": pos,
                         "gold_start": m.get("gold_start"), **{k: v for k, v in m.items() if k != "gold_start"}})
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, metric: str, path: Path, subset: int | None = None) -> Path:
    """One line per run over the gold paragraph's slot; one tick per slot, named positions under their slot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = df[df["n"] > 0]
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    for run, g in df.groupby("run", sort=False):
        g = g.sort_values("gold_start")
        ax.errorbar(g["gold_start"], 100 * g[metric], yerr=100 * g[f"{metric}_se"].fillna(0), marker="o",
                    capsize=3, label=run)
    slots = sorted({int(round(s)) for s in df["gold_start"].dropna()})
    if slots:
        ticks = list(range(0, max(slots) + 1))
        names: dict[int, list[str]] = {t: [] for t in ticks}
        for pos, s in zip(df["position"], df["gold_start"]):
            if not pos.isdigit() and s == s and pos not in names[int(round(s))]:
                names[int(round(s))].append(pos)
        step = 1 if len(ticks) <= 26 else 2
        ax.set_xticks(ticks, ["\n".join([str(t), *names[t]]) if names[t] or t % step == 0 else "" for t in ticks],
                      fontsize=8)
    ax.set_xlabel("slot of the first gold paragraph (0 = first in the context)")
    ax.set_ylabel(f"{metric.upper()} (%)")
    ax.set_ylim(-3, 103)  # a line at 0 or 100 stays visible
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    title = f"{metric.upper()} by gold-paragraph position"
    ax.set_title(title + (f" ({subset} questions every oracle run answers)" if subset is not None else ""),
                 fontsize=10)
    fig.tight_layout()
    savefig_atomic(fig, path, dpi=150)
    plt.close(fig)
    return path


def write_official_gold(run_dirs: list[str], out: Path) -> list[Path]:
    """Per run and position, the official-format gold file cut to the ids the harness scored there:
    ``hotpot_evaluate_v1.py RUN/predictions/POS.json OUT/RUN/POS.json`` then prints the harness's EM and F1
    (the official script divides by every gold row, and counts a row without a prediction as 0)."""
    from evals.hotpotqa import HotpotQA
    from harness.config import content_sha256

    paths = []
    for d in run_dirs:
        results, samples = load_run(d)
        cfg = results["config"]
        if cfg.get("task") != "hotpotqa":
            raise ReportError(f"--official-gold: {d} is a {cfg.get('task')} run; only HotpotQA has an official script")
        rows = HotpotQA(data=cfg.get("data"), split=cfg.get("split", "validation")).load()
        want = (results.get("resolved") or {}).get("data_sha256")
        if want and content_sha256(rows) != want:
            raise ReportError(f"--official-gold: the data {cfg.get('data')!r} changed since {d} ran (content hash "
                              f"{content_sha256(rows)} vs {want}); point the run's --data at the file it used")
        for pos in _conditions(results):
            scored = {r["id"] for r in samples if condition_of(r) == pos and not r.get("skipped")}
            path = out / Path(d).name / f"{pos}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            paths.append(write_atomic(path, json.dumps([r for r in rows if r["_id"] in scored], ensure_ascii=False)))
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories written by harness.eval")
    ap.add_argument("--subset", nargs="+", default=None, metavar="ORACLE_RUN",
                    help="keep only questions every one of these oracle runs answered correctly")
    ap.add_argument("--subset-metric", default="em", help="what 'answered correctly' means for --subset (default: em)")
    ap.add_argument("--metric", default=None, help="metric to plot (default: em, or the task's first metric)")
    ap.add_argument("--official-gold", default=None, metavar="DIR",
                    help="also write gold files cut to the scored questions, for the official evaluation script")
    ap.add_argument("--out", default="reports/latest", help="directory for report.md, report.csv and the plot")
    a = ap.parse_args(argv)
    try:
        keep = oracle_subset(a.subset, a.subset_metric) if a.subset else None
        if keep is not None and not keep:
            raise ReportError(f"--subset kept no question: none was answered correctly ({a.subset_metric} = 1) by "
                              f"every one of {', '.join(a.subset)}; check that these are oracle runs "
                              "(--distractors 0) of the same questions, or drop --subset")
        df = merge(a.runs, keep)
        if df.empty or not (df["n"] > 0).any():
            raise ReportError("no scored samples in the runs given" + (" after --subset" if keep else ""))
        metric = a.metric or ("em" if "em" in df.columns else next(c[:-3] for c in df.columns if c.endswith("_se")))
        if f"{metric}_se" not in df.columns:
            raise ReportError(f"--metric {metric!r}: the runs have {', '.join(c[:-3] for c in df.columns if c.endswith('_se'))}")
        gold_files = write_official_gold(a.runs, Path(a.official_gold)) if a.official_gold else []
    except (ReportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = tuple(c[:-3] for c in df.columns if c.endswith("_se") and c[:-3] in df.columns)
    write_atomic(out / "report.csv", df.to_csv(index=False))
    table = format_markdown(df, metrics, id_cols=("run", "position"))
    header = f"questions kept by --subset: {len(keep)}\n\n" if keep is not None else ""
    write_atomic(out / "report.md", header + table + "\n")
    png = plot(df, metric, out / f"{metric}_by_position.png", subset=len(keep) if keep is not None else None)
    print(header + table)
    print(f"\nwrote {out / 'report.md'}, {out / 'report.csv'}, {png}")
    for f in gold_files:
        print(f"official gold: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
