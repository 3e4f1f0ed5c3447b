"""``python -m harness.report RUN_DIR...``: merge runs of several models into one table and one plot.

    python -m harness.report runs/phi-1.5 runs/phi-mamba --out reports/k10
    python -m harness.report runs/phi-1.5 runs/phi-mamba --subset runs/phi-1.5-oracle runs/phi-mamba-oracle

``--subset`` keeps only questions that every oracle run (``--distractors 0``) answered correctly, the paper's
way of separating retrieval failures from questions a model cannot answer at all."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from harness.results import format_markdown, summarize


def load_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    run_dir = Path(run_dir)
    res_file, samples_file = run_dir / "results.json", run_dir / "samples.jsonl"
    if not res_file.is_file() or not samples_file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a finished run directory (needs results.json and samples.jsonl)")
    results = json.loads(res_file.read_text())
    samples = [json.loads(l) for l in samples_file.read_text().splitlines() if l.strip()]
    return results, samples


def oracle_subset(oracle_dirs: list[str], metric: str = "em") -> set[str]:
    """Ids answered correctly (metric == 1) in every given run."""
    keep: set[str] | None = None
    for d in oracle_dirs:
        _, samples = load_run(d)
        good = {s["id"] for s in samples if not s.get("skipped") and s["scores"][metric] >= 1.0}
        keep = good if keep is None else keep & good
    return keep or set()


def merge(run_dirs: list[str], keep_ids: set[str] | None = None) -> pd.DataFrame:
    rows = []
    for d in run_dirs:
        results, samples = load_run(d)
        cfg = results["config"]
        first = next(iter(results["metrics"].values()), {})
        metrics = tuple(k for k in first if f"{k}_se" in first)
        by_pos = summarize(samples, metrics, cfg.get("positions") if cfg.get("distractors") else None,
                           keep_ids=keep_ids, seed=cfg.get("seed", 0))
        label = cfg["model"] + (" +retrieval" if cfg.get("retrieval") else "") + \
            (" (oracle)" if cfg.get("distractors") == 0 else "")
        for pos, m in by_pos.items():
            rows.append({"model": label, "run": str(d), "distractors": cfg.get("distractors"), "position": pos,
                         "gold_start": m.get("gold_start"), **{k: v for k, v in m.items() if k != "gold_start"}})
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, metric: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for model, g in df.groupby("model", sort=False):
        g = g.sort_values("gold_start")
        ax.errorbar(g["gold_start"], 100 * g[metric], yerr=100 * g[f"{metric}_se"], marker="o", capsize=3,
                    label=model)
    first = df.drop_duplicates("position").sort_values("gold_start")
    ax.set_xticks(first["gold_start"], [f"{p}\n({s:.0f})" for p, s in zip(first["position"], first["gold_start"])])
    ax.set_xlabel("gold paragraph position (index of first gold paragraph)")
    ax.set_ylabel(f"{metric.upper()} (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Accuracy against gold-paragraph position")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories written by harness.eval")
    ap.add_argument("--subset", nargs="+", default=None, metavar="ORACLE_RUN",
                    help="keep only questions every one of these oracle runs answered correctly")
    ap.add_argument("--metric", default=None, help="metric to plot (default: em, or the task's first metric)")
    ap.add_argument("--out", default="reports/latest", help="directory for report.md, report.csv and the plot")
    a = ap.parse_args(argv)
    try:
        keep = oracle_subset(a.subset, a.metric or "em") if a.subset else None
        df = merge(a.runs, keep)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    metric = a.metric or ("em" if "em" in df.columns else next(c[:-3] for c in df.columns if c.endswith("_se")))
    metrics = tuple(c[:-3] for c in df.columns if c.endswith("_se") and c[:-3] in df.columns)
    df.to_csv(out / "report.csv", index=False)
    table = format_markdown(df, metrics, id_cols=("model", "position"))
    header = f"questions kept by --subset: {len(keep)}\n\n" if keep is not None else ""
    (out / "report.md").write_text(header + table + "\n")
    png = plot(df, metric, out / f"{metric}_by_position.png")
    print(header + table)
    print(f"\nwrote {out / 'report.md'}, {out / 'report.csv'}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
