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
``hotpot_evaluate_v1.py`` reproduces the harness's numbers (skipped prompts are left out, see docs/scoring.md)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from evals import task_class
from evals.base import DataError, instance_key
from harness.engine.config import RunConfig
from harness.engine.results import format_table
from harness.engine.runlog import SampleLog
from harness.engine.stats import summarize
from harness.files import write_atomic, write_json
from harness.hashing import json_digest
from harness.reports.html import write_html
from harness.reports.paired import paired, pairing, same_question, seed_spread
from harness.reports.plotting import pyplot, save

# Run settings that name a run in a legend when they differ between the runs of one report, in this order
# (then the task's own options, each as the task labels it).
LABEL_FIELDS = ("model", "retrieval", "template", "max_new_tokens", "data", "dtype", "backend", "seed", "stop",
                "max_tool_calls", "tool_timeout", "tool_max_chars", "limit", "ids", "split", "tokenizer", "cuda_graphs")
# Run flags that decide how rows are computed, never what they hold (outputs are identical across them).
NOT_RESULT_DECIDING = ("output", "overwrite", "audit", "batch_size", "prefix_reuse", "prefix_memory", "device",
                       "template_sha256")


class ReportError(ValueError):
    pass


_LOADED: dict[tuple, tuple[dict, list[dict]]] = {}  # one read per run and file state (a report reads each run
# for its table, its comparisons and its HTML page; at the full dev set a run is ~180 MB of JSON lines)


def load_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """results.json and the samples it counted (its selection of ids and positions); read again only when one of
    the files changed. Callers read what it returns, never change it."""
    run_dir = Path(run_dir)
    res_file = run_dir / "results.json"
    if not res_file.is_file() or not (run_dir / "samples.jsonl").is_file():
        raise ReportError(f"{run_dir} is not a finished run directory (needs results.json and samples.jsonl); "
                          "run harness.eval into it first, or rerun it to finish")
    stamp = (str(run_dir.resolve()), *((st.st_size, st.st_mtime_ns, st.st_ino) for st in
                                       (res_file.stat(), (run_dir / "samples.jsonl").stat())))
    if stamp not in _LOADED:
        if len(_LOADED) >= 16:
            _LOADED.clear()
        _LOADED[stamp] = _read_run(run_dir, res_file)
    return _LOADED[stamp]


def _read_run(run_dir: Path, res_file: Path) -> tuple[dict, list[dict]]:
    try:
        results = json.loads(res_file.read_text())
    except ValueError as e:
        raise ReportError(f"{res_file} is not valid JSON ({e}); rerun the evaluation to rewrite it") from e
    run_hash = results.get("config_hash")
    every = list(SampleLog(run_dir, read_only=True).records.values())
    records = [r for r in every if r.get("config_hash") == run_hash]  # only rows made with the run's settings
    sel = results.get("selection")
    if sel:
        keys = {instance_key(i, c) for i in sel["ids"] for c in _conditions(results)}
        records = [r for r in records if r["key"] in keys]
        if len(records) < len(keys):
            raise ReportError(f"{run_dir}: results.json counted {len(keys)} rows, but samples.jsonl holds only "
                              f"{len(records)} of them made with its settings (hash {run_hash}); the directory was "
                              "changed after the run finished. Rerun the evaluation into it to make them again.")
    return results, records


def _conditions(results: dict) -> list[str]:
    return (results.get("selection") or {}).get("conditions") or list(results["metrics"])


def _settings(cfg: dict) -> dict:
    """A run's config with its task's options at the top level (HotpotQA's distractors, MQAR's keys, ...)."""
    return {**{k: v for k, v in cfg.items() if k != "task_args"}, **(cfg.get("task_args") or {})}


def oracle_subset(oracle_dirs: list[str], metric: str | None = None) -> set[str]:
    """Ids answered correctly (``metric`` == 1; default: each run's task's first metric) in every given run."""
    keep: set[str] | None = None
    for d in oracle_dirs:
        results, samples = load_run(d)
        metric = metric or task_class(results["task"]).metrics[0]
        scored = [s for s in samples if not s.get("skipped")]
        if not scored:
            raise ReportError(f"--subset: every row of {d} was skipped (e.g. prompt_too_long), so it answered no "
                              "question; give oracle runs whose prompts fit the model, or drop --subset")
        if metric not in scored[0]["scores"]:
            raise ReportError(f"--subset-metric {metric!r}: {d} has no such metric (it has "
                              f"{', '.join(scored[0]['scores'])})")
        good = {s["id"] for s in samples if not s.get("skipped") and s["scores"][metric] >= 1.0}
        keep = good if keep is None else keep & good
    return keep or set()


def run_labels(configs: list[dict], conditions: list[set] | None = None, task: type | None = None) -> list[str]:
    """Short legend names from what differs between the runs of one task (just the model when nothing else
    does). Runs of the same settings share a name (one line over the condition axis) where their ``conditions``
    do not overlap; otherwise their directories tell them apart."""
    def value(cfg, k):
        v = cfg.get(k)
        if k == "model":
            return _short_model(str(v), [str(c.get("model")) for c in configs])
        if k == "retrieval":
            return "+retrieval" if v else "no retrieval"
        return task.label(k, v) if task is not None and k in options else f"{k}={v}"

    options = [f.name for f in dataclasses.fields(task.Options)] if task is not None else []
    run_flags = {f.name for f in dataclasses.fields(RunConfig)}
    # every setting that decides a result: the listed ones first, then the task's, then any other run flag
    fields = list(dict.fromkeys(list(LABEL_FIELDS) + options + sorted(run_flags - set(NOT_RESULT_DECIDING))
                                + sorted({k for c in configs for k in c} - run_flags - set(options))))
    differ = [k for k in fields if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in configs}) > 1]
    shown = ["model", *[k for k in differ if k != "model"]]
    labels = [" ".join(value(c, k) for k in shown) for c in configs]
    conditions = conditions or [{"all"} for _ in configs]  # unknown: runs of the same settings overlap
    for lab in set(labels):
        same = [i for i, x in enumerate(labels) if x == lab]
        if sum(len(conditions[i]) for i in same) > len(set().union(*(conditions[i] for i in same))):
            where = _distinct_paths([str(configs[i].get("output", i)) for i in same])
            labels = [f"{lab} [{where[same.index(i)]}]" if i in same else x for i, x in enumerate(labels)]
    return labels


def _distinct_paths(paths: list[str]) -> list[str]:
    """The shortest tails of ``paths`` that tell them apart (``a/run``, ``b/run``); the same path given twice is
    numbered, so no two labels are ever one."""
    parts = [Path(p.rstrip("/")).parts or (p,) for p in paths]
    for n in range(1, max(map(len, parts)) + 1):
        tails = ["/".join(p[-n:]) for p in parts]
        if len(set(tails)) == len(tails):
            return tails
    return [f"{'/'.join(p)} #{k + 1}" for k, p in enumerate(parts)]


def _short_model(model: str, all_models: list[str]) -> str:
    """The last path part ("runs/tiny-phi" -> "tiny-phi"), or more of it where that alone is ambiguous."""
    parts = Path(model.rstrip("/")).parts
    for n in range(1, len(parts) + 1):
        short = "/".join(parts[-n:])
        if sum(1 for m in set(all_models) if "/".join(Path(m.rstrip("/")).parts[-n:]) == short) <= 1:
            return short
    return model


def merge(run_dirs: list[str], keep_ids: set[str] | None = None) -> pd.DataFrame:
    """One row per run and condition: the run's label, task, condition (``condition``, named in
    ``condition_name``), the condition's place on the task's plot axis (``x``, and ``series`` where a condition
    has two parts), and the metrics."""
    loaded = [load_run(d) for d in run_dirs]
    tasks = [res["task"] for res, _ in loaded]
    labels = [""] * len(loaded)
    for task in dict.fromkeys(tasks):  # a run is named by what differs from the other runs of its task
        idx = [i for i, t in enumerate(tasks) if t == task]
        axis = loaded[idx[0]][0]["condition"]  # the plot's x: never what tells runs apart
        swept = {p for name in axis.split("@") for p in (name, f"{name}s")}
        configs = [{k: v for k, v in _settings(loaded[i][0]["config"]).items() if k not in swept} for i in idx]
        conds = [set(_conditions(loaded[i][0])) for i in idx]
        for i, label in zip(idx, run_labels(configs, conds, task_class(task))):
            labels[i] = label
    rows = []
    for d, label, (results, samples) in zip(run_dirs, labels, loaded):
        cfg = _settings(results["config"])
        first = next(iter(results["metrics"].values()), {})
        metrics = tuple(k for k in first if f"{k}_se" in first)
        statistic = task_class(results["task"]).axis_statistic
        by_condition = summarize(samples, metrics, _conditions(results), keep_ids=keep_ids, seed=cfg.get("seed", 0),
                                 axis_statistic=statistic)
        audit = results.get("audit")
        for condition, m in by_condition.items():
            x, series = task_class(results["task"]).axis_position(condition, m.get(statistic) if statistic else None)
            rows.append({"run": label, "dir": str(d), "task": results["task"],
                         "audit": f"{audit['agree']}/{audit['rows']}" if audit else None,
                         "condition_name": results["condition"], "condition": condition, "x": x, "series": series,
                         **m})
    return pd.DataFrame(rows)


def comparisons(run_dirs: list[str], df: pd.DataFrame, metrics: dict[str, str], keep_ids: set[str] | None = None
                ) -> tuple[list, list[dict], list[str]]:
    """Paired differences (``harness.reports.paired``) of each task's plotted metric: within each run, its first
    condition on the plot's axis against its last; between runs, each later run against the first of its task,
    per shared condition and over all of them (clustered by question); and runs that differ only in a ``--seed``
    that reaches the task's data, pooled with their between-seed spread. Rows pair only where they hold the same
    question; the notes say where runs were given that pair nothing or replicate nothing."""
    diffs, seeds, notes = [], [], []
    for task, g in df.groupby("task", sort=False):
        metric = metrics[task]
        binary = metric in task_class(task).binary_metrics
        dirs = list(dict.fromkeys(g["dir"]))
        label = dict(zip(g["dir"], g["run"]))
        rows, configs = {}, {}
        for d in dirs:
            results, samples = load_run(d)
            rows[d] = [r for r in samples if keep_ids is None or r["id"] in keep_ids]
            configs[d] = _settings(results["config"])
        seed = 0
        for d in dirs:  # first against last on the axis: one question's two conditions
            order = g[g["dir"] == d].sort_values("x", na_position="last")["condition"].tolist()
            if len(order) >= 2:
                first, last = order[0], order[-1]
                got = paired([r for r in rows[d] if r["condition"] == first],
                             [r for r in rows[d] if r["condition"] == last], metric, key=lambda r: r["id"],
                             cluster=lambda r: r["id"], a=first, b=last, condition=label[d], seed=seed,
                             binary=binary, same=same_question)
                if got is not None:
                    got.task = task
                    diffs.append(got)
        base = dirs[0]
        for d in dirs[1:]:  # each run against the first, per condition and over all shared ones
            shared = [c for c in dict.fromkeys(g[g["dir"] == d]["condition"]) if c in set(g[g["dir"] == base]["condition"])]
            for c in shared + (["all"] if len(shared) > 1 else []):
                pick = (lambda r: True) if c == "all" else (lambda r, c=c: r["condition"] == c)
                a_rows = [r for r in rows[d] if pick(r) and r["condition"] in shared]
                b_rows = [r for r in rows[base] if pick(r) and r["condition"] in shared]
                key = lambda r: (r["id"], r["condition"])  # noqa: E731
                got = paired(a_rows, b_rows, metric, key=key, cluster=lambda r: r["id"], a=label[d], b=label[base],
                             condition=c, seed=seed, binary=binary)
                if got is not None:
                    got.task = task
                    diffs.append(got)
                elif c != "all":
                    mismatched = pairing(a_rows, b_rows, key).mismatched
                    notes.append(f"{label[d]} vs {label[base]} ({c}): no row pairs: " + (
                        f"{mismatched} rows share an id but hold other questions (another eval_seed, data or "
                        "tokenizer), so no paired difference is reported" if mismatched else
                        "the runs share no scored question"))
        if not shared_any(dirs, g):
            notes.append(f"{task}: the runs share no condition; no paired difference between them")
        seeds += _seed_replicates(task, metric, g, dirs, rows, configs, label, notes)
    return diffs, seeds, notes


def shared_any(dirs: list, g: pd.DataFrame) -> bool:
    """Whether every later run shares a condition with the first (or there is one run)."""
    base = set(g[g["dir"] == dirs[0]]["condition"])
    return all(base & set(g[g["dir"] == d]["condition"]) for d in dirs[1:])


def _seed_replicates(task: str, metric: str, g: pd.DataFrame, dirs: list, rows: dict, configs: dict, label: dict,
                     notes: list[str]) -> list[dict]:
    """Runs whose settings differ only in --seed, pooled, where the seed reaches the task's data and their rows
    really differ; otherwise a note says why they were not pooled."""
    settings = {d: json.dumps({k: v for k, v in configs[d].items() if k not in ("seed", "output")},
                              sort_keys=True, default=str) for d in dirs}
    out = []
    for same in {v: [d for d in dirs if settings[d] == v] for v in settings.values()}.values():
        if len(same) < 2:
            continue
        names = ", ".join(label[d] for d in same)
        if not task_class(task).seed_reaches_data:
            notes.append(f"{names} differ only in --seed, which task {task} does not use (its held-out sets are "
                         "drawn with eval_seed): the same run, not seed replicates; not pooled")
            continue
        prompts = [frozenset(r.get("prompt_sha256") for r in rows[d]) for d in same]
        if len(set(prompts)) < len(prompts):
            notes.append(f"{names} differ only in --seed but some hold the very same prompts: not pooled as seed "
                         "replicates")
            continue
        for c in dict.fromkeys(g["condition"]):
            vals = g[(g["dir"].isin(same)) & (g["condition"] == c)][metric].dropna().tolist()
            if len(vals) > 1:
                out.append({"task": task, "metric": metric, "condition": c, "runs": [label[d] for d in same],
                            **seed_spread(vals)})
    return out


def explorer_runs(runs: list[str], df: pd.DataFrame, keep_ids: set[str] | None) -> list[dict]:
    """Each run's label, task and counted rows, for the HTML report's sample explorer."""
    label = dict(zip(df["dir"], df["run"]))
    out = []
    for d in runs:
        results, samples = load_run(d)
        out.append({"label": label.get(str(d), str(d)), "dir": str(d), "task": results["task"],
                    "condition_name": results["condition"],
                    "rows": [r for r in samples if keep_ids is None or r["id"] in keep_ids]})
    return out


def distinct_runs(run_dirs: list[str]) -> tuple[list[str], list[str]]:
    """The run directories with each run once: a folder given twice, or a copy of a run (the same settings hash
    and the same rows), is one run, named by the first folder given. Returns the runs and a note for each one
    left out."""
    kept, notes, seen = [], [], {}
    for d in run_dirs:
        results, samples = load_run(d)
        ident = (results.get("config_hash"),
                 json_digest(sorted((r["key"], r.get("generation"), r.get("prompt_sha256")) for r in samples)))
        real = Path(d).resolve()
        first = next((k for k, (p, i) in seen.items() if p == real or i == ident), None)
        if first is not None:
            notes.append(f"{d} is {'the same folder as' if seen[first][0] == real else 'a copy of'} {first}: "
                         "counted once")
            continue
        seen[d] = (real, ident)
        kept.append(d)
    return kept, notes


def plot(df: pd.DataFrame, metric: str, path: Path, subset: int | None = None) -> Path:
    """One task's runs on the task's own axis (``Task.axis_position``): by a statistic (HotpotQA's gold-paragraph
    slot); a two-part condition (the needle's length x depth) as a heatmap per run; a size-swept task (pairs,
    nodes, length) as one line per run over the size."""
    plt = pyplot()

    df = df[df["n"] > 0]
    task = df["task"].iloc[0]
    name = df["condition_name"].iloc[0]
    if df["series"].notna().any():
        return _heatmaps(df, metric, path, plt)
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    _run_lines(ax, df, "x", metric)
    if task_class(task).axis_statistic:  # conditions placed by a statistic: integer slots, names under them
        _slot_ticks(ax, df)
    else:
        values = sorted({v for v in df["x"].dropna()})
        if values and values[0] > 0 and values[-1] / values[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(values, [f"{v:g}" for v in values])
    ax.set_xlabel(task_class(task).axis_label or name)
    title = f"{task}: {metric} by {name}"
    ax.set_ylabel(f"{metric} (%)")
    ax.set_ylim(-3, 103)  # a line at 0 or 100 stays visible
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title + (f" ({subset} questions every oracle run answers)" if subset is not None else ""),
                 fontsize=10)
    save(fig, path, dpi=150)
    return path


AGAINST = {"state_bytes": ("model state the prompt left (bytes)", "state_memory"),
           "prompt_tokens": ("context length (prompt tokens)", "context_length")}


def plot_against(df: pd.DataFrame, metric: str, column: str, path: Path) -> Path:
    """The paper's axes: one line per run of the metric against the mean model-state bytes (or prompt length)
    of each condition: a Transformer's KV cache grows with the context, a recurrent model's state does not."""
    plt = pyplot()

    df = df[(df["n"] > 0) & df[column].notna()]
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    _run_lines(ax, df, column, metric)
    if len(df) and df[column].max() / max(df[column].min(), 1) >= 8:
        ax.set_xscale("log", base=2)
    if column == "state_bytes":
        from matplotlib.ticker import FuncFormatter

        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _human_bytes(v)))
    ax.set_xlabel(AGAINST[column][0])
    ax.set_ylabel(f"{metric} (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{df['task'].iloc[0]}: {metric} against {AGAINST[column][0].split(' (')[0]}", fontsize=10)
    save(fig, path, dpi=150)
    return path


def _run_lines(ax, df: pd.DataFrame, x: str, metric: str) -> None:
    """One line per run of the metric (percent, with its standard error) over column ``x``."""
    for run, g in df.groupby("run", sort=False):
        g = g.sort_values(x)
        ax.errorbar(g[x], 100 * g[metric], yerr=100 * g[f"{metric}_se"].fillna(0), marker="o", capsize=3, label=run)


def _human_bytes(v: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.3g} {unit}"
        v /= 1024
    return str(v)


def _slot_ticks(ax, df: pd.DataFrame) -> None:
    """One tick per slot, the named positions (first, middle, last) under their slot."""
    slots = sorted({int(round(s)) for s in df["x"].dropna()})
    if not slots:
        return
    ticks = list(range(0, max(slots) + 1))
    names: dict[int, list[str]] = {t: [] for t in ticks}
    for pos, s in zip(df["condition"], df["x"]):
        if not pos.isdigit() and s == s and pos not in names[int(round(s))]:
            names[int(round(s))].append(pos)
    step = 1 if len(ticks) <= 26 else 2
    ax.set_xticks(ticks, ["\n".join([str(t), *names[t]]) if names[t] or t % step == 0 else "" for t in ticks],
                  fontsize=8)


def _heatmaps(df: pd.DataFrame, metric: str, path: Path, plt) -> Path:
    """A grid per run of a two-part condition (the needle's length x depth), each cell the metric in percent;
    the axes are titled by the task."""
    task = task_class(df["task"].iloc[0])
    runs = list(dict.fromkeys(df["run"]))
    fig, axes = plt.subplots(1, len(runs), figsize=(1.6 + 3.6 * len(runs), 3.8), squeeze=False,
                             constrained_layout=True)
    for ax, run in zip(axes[0], runs):
        g = df[df["run"] == run]
        grid = g.pivot_table(index="series", columns="x", values=metric, aggfunc="mean")
        grid = grid.reindex(sorted(grid.index, key=lambda s: float(s.split()[-1])))
        im = ax.imshow(100 * grid.values, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(grid.columns)), [f"{c:g}" for c in grid.columns])
        ax.set_yticks(range(len(grid.index)), [s.split()[-1] for s in grid.index])
        for (i, j), v in np.ndenumerate(grid.values):
            ax.text(j, i, "" if v != v else f"{100 * v:.0f}", ha="center", va="center", fontsize=8,
                    color="white" if v == v and v < 0.6 else "black")
        ax.set_xlabel(task.axis_label or df["condition_name"].iloc[0].split("@")[0])
        if ax is axes[0][0]:
            ax.set_ylabel(task.series_label or df["condition_name"].iloc[0].split("@")[-1])
        ax.set_title(run, fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), label=f"{metric} (%)")
    first, second = df["condition_name"].iloc[0].split("@", 1)  # the axes' titles say more
    fig.suptitle(f"{task.name}: {metric} by {first} and {second}", fontsize=10)

    save(fig, path, dpi=150, tight=False)
    return path


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
                  for c in _conditions(results)}
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
    ap.add_argument("--official-gold", default=None, metavar="DIR",
                    help="also write gold files cut to the scored questions, for the official evaluation script")
    ap.add_argument("--out", default="reports/latest", help="directory for report.md, report.csv and the plots "
                    "(default: reports/latest, replaced by each report)")
    a = ap.parse_args(argv)
    try:
        keep = oracle_subset(a.subset, a.subset_metric) if a.subset else None
        if keep is not None and not keep:
            raise ReportError(f"--subset kept no question: none was answered correctly ({a.subset_metric or 'the first metric'} = 1) by "
                              f"every one of {', '.join(a.subset)}; check that these are oracle runs "
                              "(--distractors 0) of the same questions, or drop --subset")
        runs, run_notes = distinct_runs(a.runs)
        df = merge(runs, keep)
        if df.empty or not (df["n"] > 0).any():
            raise ReportError("no scored samples in the runs given" + (" after --subset" if keep else ""))
        plotted = {task: _metric_of(g, a.metric) for task, g in df.groupby("task", sort=False)}
        out = _report_dir(Path(a.out))
        gold_files = write_official_gold(runs, Path(a.official_gold)) if a.official_gold else []
    except (ReportError, DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_atomic(out / "report.csv", df.drop(columns=["x", "series"]).to_csv(index=False))
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
        pngs.append(plot(g, metric, out / f"{prefix}{stem}.png", subset=len(keep) if keep is not None else None))
        for column, (_, name) in AGAINST.items():
            if column in g and g[column].notna().any():
                pngs.append(plot_against(g, metric, column, out / f"{prefix}{metric}_vs_{name}.png"))
    header = f"questions kept by --subset: {len(keep)}\n\n" if keep is not None else ""
    diffs, seeds, notes = comparisons(runs, df, plotted, keep)
    notes = run_notes + notes
    if diffs:
        tables.append("## Paired differences (95% CI resampling questions; McNemar's exact test for 0/1 metrics)"
                      "\n\n" + "\n".join(f"- {'**' if d.significant else ''}{d.line()}{'**' if d.significant else ''}"
                                           for d in diffs))
    if seeds:
        tables.append("## Runs that differ only in --seed\n\n" + "\n".join(_seed_line(x) for x in seeds))
    if notes:
        tables.append("## Notes on the comparisons\n\n" + "\n".join(f"- {n}" for n in notes))
    table = header + "\n\n".join(tables)
    write_atomic(out / "report.md", table + "\n")
    write_json(out / "comparisons.json", {"differences": [d.to_dict() for d in diffs], "seeds": seeds,
                                          "notes": notes}, indent=2)
    html = write_html(out / "report.html", title=f"icr-harness report: {', '.join(runs)}", tables=html_tables,
                      pngs=pngs, diffs=diffs, seeds=[_seed_line(x) for x in seeds], notes=notes,
                      runs=explorer_runs(runs, df, keep), plotted=plotted)
    write_atomic(out / MANIFEST, "".join(f"{p.name}\n" for p in [out / "report.md", out / "report.csv",
                                                                  out / "comparisons.json", html, *pngs]))
    print(table)
    print(f"\nwrote {out / 'report.md'}, {out / 'report.csv'}, {html} (sample explorer), {', '.join(map(str, pngs))}")
    for f in gold_files:
        print(f"official gold: {f}")
    return 0


def _seed_line(s: dict) -> str:
    sd = "n/a" if s["sd_between_seeds"] is None else f"{100 * s['sd_between_seeds']:.1f}"
    return (f"- {s['condition']}: {s['metric']} {100 * s['mean']:.1f} (sd between seeds {sd}, range "
            f"{100 * s['min']:.1f}-{100 * s['max']:.1f}; {s['seeds']} seeds: {', '.join(s['runs'])})")


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


def _report_dir(out: Path) -> Path:
    """``--out``, a folder: created, or emptied of the files the previous report wrote there (its figures
    included; nothing else a user keeps there)."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out}: a file of that name exists; give a folder for the report")
    bad = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if bad is not None:
        raise ReportError(f"--out {out}: {bad} is a file, not a folder; give a folder for the report")
    out.mkdir(parents=True, exist_ok=True)
    listed = out / MANIFEST
    old = listed.read_text().split() if listed.exists() else ["report.md", "report.csv"]
    for name in old:
        if "/" not in name:
            (out / name).unlink(missing_ok=True)
    return out


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


if __name__ == "__main__":
    sys.exit(main())
