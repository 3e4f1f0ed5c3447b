"""``python -m harness.report RUN_DIR...``: merge runs into one table and one plot.

    python -m harness.report runs/phi-1.5-k10 runs/phi-mamba-k10 runs/phi-mamba-k20 --out reports/k10
    python -m harness.report runs/phi-1.5 runs/phi-mamba --subset runs/phi-1.5-oracle runs/phi-mamba-oracle
    python -m harness.report runs/phi-1.5 --official-gold reports/gold

Each run is labelled by the settings that differ between the runs of its task (model, retrieval, template,
the task's options: HotpotQA's distractors, MQAR's keys, ...), and counts exactly the rows its results.json selected (a narrower rerun into the same
directory keeps older rows in samples.jsonl; they are not counted). ``--subset`` keeps only questions that
every oracle run (``--distractors 0``) answered correctly by ``--subset-metric``, the paper's way of
separating retrieval failures from questions a model cannot answer at all. ``--official-gold`` writes, per
run and position, the gold file cut to the questions the harness scored, so the official
``hotpot_evaluate_v1.py`` reproduces the harness's numbers (skipped prompts are left out, see docs/scoring.md).

This module is the command line; what it reads, compares and draws is ``harness.reports`` (``runs``,
``comparisons``, ``figures``, ``html``)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from evals import task_class
from evals.base import DataError
from harness.engine.results import TABLE_LEGEND, format_table
from harness.files import StagedFiles, printable, strict_json, write_atomic
from harness.reports.comparisons import comparisons, seed_line
from harness.reports.figures import AGAINST, plot, plot_against
from harness.reports.html import render_html
from harness.reports.runs import (
    ReportError,
    distinct_runs,
    explorer_runs,
    load_run,
    merge,
    oracle_subset,
    run_conditions,
)


def write_official_gold(run_dirs: list[str], out: Path) -> list[Path]:
    """Per run and condition, the gold file of the task's official scorer cut to the ids the harness scored
    there (``Task.official_gold``): the scorer on it and the run's own prediction files prints the harness's
    numbers."""
    paths = []
    for d in run_dirs:
        results, samples = load_run(d)
        cfg = results["config"]
        task = task_class(cfg.get("task"))
        if task.official_scorer is None:
            raise ReportError(f"--official-gold: {d} is a {cfg.get('task')} run; that task has no official "
                              "scoring script")
        scored = {c: {r["id"] for r in samples if r["condition"] == c and not r.get("skipped")}
                  for c in run_conditions(results)}
        try:
            gold = task.official_gold(cfg, results.get("resolved") or {}, scored)
        except DataError as e:
            raise ReportError(f"--official-gold: {d} was run with --data {cfg.get('data')!r}, which cannot be "
                              f"used from here ({Path.cwd()}): {e}. Runs made now record the absolute path; for "
                              "an older one, run the report from the folder the evaluation ran in") from None
        for condition, rows in gold.items():
            path = out / Path(d).name / f"{condition}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            paths.append(write_atomic(path, json.dumps(rows, ensure_ascii=False)))
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories written by harness.eval")
    ap.add_argument("--subset", nargs="+", default=None, metavar="ORACLE_RUN",
                    help="keep only questions every one of these oracle runs answered correctly")
    ap.add_argument("--subset-metric", default=None, help="what 'answered correctly' means for --subset (default: the "
                    "task's first metric, em for HotpotQA)")
    ap.add_argument("--metric", default=None, help="metric to plot (default: the task's first metric, em for "
                    "HotpotQA)")
    ap.add_argument("--reference", default=None, metavar="RUN",
                    help="the run every other run of its task is compared with (default: the first run given); a "
                         "difference reads RUN_A − RUN_B, positive where A scores higher")
    ap.add_argument("--official-gold", default=None, metavar="DIR",
                    help="also write gold files cut to the scored questions, for the official evaluation script")
    ap.add_argument("--out", default="reports/latest", help="directory for report.md, report.csv and the plots "
                    "(default: reports/latest; a new report replaces the previous one's files there only once it is "
                    "whole)")
    a = ap.parse_args(argv)
    staged = None
    try:
        keep = oracle_subset(a.subset, a.subset_metric) if a.subset else None
        if keep is not None and not keep:
            raise ReportError(f"--subset kept no question: none was answered correctly ({a.subset_metric or 'the first metric'} = 1) by "
                              f"every one of {', '.join(a.subset)}; check that these are oracle runs "
                              "(--distractors 0) of the same questions, or drop --subset")
        runs, run_notes = distinct_runs(a.runs)
        reference = _reference(a.reference, runs)
        df = merge(runs, keep)
        if df.empty or not (df["n"] > 0).any():
            raise ReportError("no scored samples in the runs given" + (" after --subset" if keep else ""))
        plotted = {task: _metric_of(g, a.metric) for task, g in df.groupby("task", sort=False)}
        _check_out(Path(a.out))
        # everything is rendered into a staging folder first; the previous report is replaced only once the new
        # one is whole, so a failure, a full disk or Ctrl-C leaves the old report as it was
        staged = StagedFiles(Path(a.out), MANIFEST)
        table = _render(staged, runs, run_notes, df, plotted, keep, reference)
        gold_files = write_official_gold(runs, Path(a.official_gold)) if a.official_gold else []
        written = staged.commit()
    except (ReportError, DataError, OSError) as e:
        if staged is not None:
            staged.discard()
        print(printable(f"error: {e}{_kept(a.out)}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if staged is not None:
            staged.discard()
        print(printable(f"interrupted: no report written{_kept(a.out)}"), file=sys.stderr)
        return 130
    print(printable(table))
    print(printable(f"\nwrote {', '.join(str(p) for p in written if p.name != 'report.html')}, "
                    f"{Path(a.out) / 'report.html'} (sample explorer)"))
    for f in gold_files:
        print(printable(f"official gold: {f}"))
    return 0


def _reference(asked: str | None, runs: list[str]) -> str | None:
    """``--reference``, as the run directory it names among those given."""
    if asked is None:
        return None
    same = [d for d in runs if Path(d).resolve() == Path(asked).resolve()]
    if not same:
        raise ReportError(f"--reference {asked}: not one of the runs given ({', '.join(runs)}); name one of them")
    return same[0]


DIRECTION = ("Each line is A − B in points of the plotted metric: positive where A scores higher. Within a run, its "
             "first condition on the axis − its last; between runs, each run − the reference run of its task ({ref}; "
             "--reference picks another). 95% interval: a bootstrap over questions; McNemar's exact test for 0/1 "
             "metrics, with its 2x2 of paired rows.")


def _render(staged: StagedFiles, runs: list[str], run_notes: list[str], df: pd.DataFrame, plotted: dict,
            keep: set | None, reference: str | None = None) -> str:
    """Every file of the report, written into ``staged``; returns report.md's text."""
    staged.write_text("report.csv", df.drop(columns=["x", "series"]).to_csv(index=False))
    tables, pngs, html_tables = [], [], []
    for task, g in df.groupby("task", sort=False):  # runs of different tasks never share a table or a figure
        metrics = tuple(_metrics(g))
        present = g.drop(columns=[c for c in g.columns if g[c].isna().all()  # another task's metric columns
                                  and not (c.endswith("_se") and c[:-3] in metrics)])
        name = g["condition_name"].iloc[0]
        shown = present.rename(columns={"condition": name})
        audits = {run: a for run, a in zip(g["run"], g["audit"]) if a}
        table = format_table(shown, metrics, id_cols=("run", name))
        html_tables.append((f"{task}: {metrics[0] if metrics else ''} by {name}", table.to_html(index=False)))
        tables.append((f"## {task}\n\n" if len(plotted) > 1 else "") + table.to_markdown(index=False)
                      + ("\n\naudit (rows generated again alone, unpadded, float32; agree/drawn): "
                         + ", ".join(f"{run} {a}" for run, a in audits.items()) if audits else ""))
        metric = plotted[task]
        stem = f"{metric}_by_{_slug(name)}"
        prefix = "" if len(plotted) == 1 else f"{task}_"
        pngs.append(plot(g, metric, staged.path(f"{prefix}{stem}.png"),
                         subset=len(keep) if keep is not None else None))
        for column, (_, name) in AGAINST.items():
            if column in g and g[column].notna().any():
                pngs.append(plot_against(g, metric, column, staged.path(f"{prefix}{metric}_vs_{name}.png")))
    header = (f"questions kept by --subset: {len(keep)}\n\n" if keep is not None else "") + f"{TABLE_LEGEND}\n\n"
    diffs, seeds, notes = comparisons(runs, df, plotted, keep, reference)
    notes = run_notes + notes
    label = dict(zip(df["dir"], df["run"]))
    direction = DIRECTION.format(ref=label.get(reference, reference) if reference else "the first run given")
    if diffs:
        tables.append("## Paired differences (95% CI resampling questions; McNemar's exact test for 0/1 metrics)"
                      f"\n\n{direction}\n\n" + "\n".join(
                          f"- {'**' if d.significant else ''}{d.line()}{'**' if d.significant else ''}"
                          + (f"\n  - 2x2: {d.table()}" if d.table() else "") for d in diffs))
    if seeds:
        tables.append("## Runs that differ only in --seed\n\n" + "\n".join(seed_line(x) for x in seeds))
    if notes:
        tables.append("## Notes on the comparisons\n\n" + "\n".join(f"- {n}" for n in notes))
    table = header + "\n\n".join(tables)
    staged.write_text("report.md", table + "\n")
    staged.write_text("comparisons.json", strict_json({"differences": [d.to_dict() for d in diffs], "seeds": seeds,
                                                       "notes": notes}, indent=2))
    staged.write_text("report.html", render_html(
        title=f"icr-harness report: {', '.join(runs)}", tables=html_tables, pngs=pngs, diffs=diffs,
        seeds=[seed_line(x) for x in seeds], notes=notes, runs=explorer_runs(runs, df, keep), plotted=plotted,
        direction=direction, legend=TABLE_LEGEND))
    for png in pngs:
        staged.add(png.name)
    return table


def _metrics(df: pd.DataFrame) -> list[str]:
    """The metrics one task's rows hold (a metric whose standard errors are all missing, one row per condition,
    is still a metric)."""
    return [c[:-3] for c in df.columns if c.endswith("_se") and c[:-3] in df.columns and df[c[:-3]].notna().any()]


def _metric_of(df: pd.DataFrame, asked: str | None) -> str:
    """The metric drawn for one task's runs: ``--metric``, else the task's first metric (where its rows hold it)."""
    have = _metrics(df)
    first = task_class(df["task"].iloc[0]).metrics[0]
    metric = asked or (first if first in have else have[0])
    if metric not in have:
        raise ReportError(f"--metric {metric!r}: the {df['task'].iloc[0]} runs have {', '.join(have)}")
    return metric


MANIFEST = ".report-files"  # what the last report wrote into its folder: the next one replaces exactly these


def _kept(out: str) -> str:
    return f" (the previous report in {out} is unchanged)" if (Path(out) / MANIFEST).is_file() else ""


def _check_out(out: Path) -> None:
    """``--out`` must be (or become) a folder."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out}: a file of that name exists; give a folder for the report")
    bad = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if bad is not None:
        raise ReportError(f"--out {out}: {bad} is a file, not a folder; give a folder for the report")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


if __name__ == "__main__":
    sys.exit(main())
