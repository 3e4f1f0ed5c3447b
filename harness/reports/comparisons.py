"""What a report compares: paired differences within and between runs of a task, and runs that differ only
in --seed pooled where they are real replicates; notes say why anything was not compared."""
from __future__ import annotations

import json

import pandas as pd

from evals import task_class
from harness.reports.paired import matcher, paired, pairing, same_question, seed_spread
from harness.reports.runs import data_hash, load_run, run_settings


def comparisons(run_dirs: list[str], df: pd.DataFrame, metrics: dict[str, str], keep_ids: set[str] | None = None,
                reference: str | None = None) -> tuple[list, list[dict], list[str]]:
    """Paired differences (``harness.reports.paired``) of each task's plotted metric: within each run, its first
    condition on the plot's axis against its last; between runs, each run against the reference run of its task
    (``reference``, a run directory; default the first given), per shared condition and over all of them
    (clustered by question); and runs that differ only in a ``--seed``
    that reaches the task's data, pooled with their between-seed spread. Rows pair only where they hold the same
    question; the notes say where runs were given that pair nothing or replicate nothing."""
    diffs, seeds, notes = [], [], []
    for task, g in df.groupby("task", sort=False):
        metric = metrics[task]
        binary = metric in task_class(task).binary_metrics
        dirs = list(dict.fromkeys(g["dir"]))
        label = dict(zip(g["dir"], g["run"]))
        rows, configs, data = {}, {}, {}
        for d in dirs:
            results, samples = load_run(d)
            rows[d] = [r for r in samples if keep_ids is None or r["id"] in keep_ids]
            configs[d] = run_settings(results["config"])
            data[d] = data_hash(results)
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
        base = reference if reference in dirs else dirs[0]
        for d in [d for d in dirs if d != base]:  # each run against the reference, per condition and all shared
            shared = [c for c in dict.fromkeys(g[g["dir"] == d]["condition"]) if c in set(g[g["dir"] == base]["condition"])]
            for c in shared + (["all"] if len(shared) > 1 else []):
                pick = (lambda r: True) if c == "all" else (lambda r, c=c: r["condition"] == c)
                a_rows = [r for r in rows[d] if pick(r) and r["condition"] in shared]
                b_rows = [r for r in rows[base] if pick(r) and r["condition"] in shared]
                key = lambda r: (r["id"], r["condition"])  # noqa: E731
                same = matcher(data[d], data[base])
                got = paired(a_rows, b_rows, metric, key=key, cluster=lambda r: r["id"], a=label[d], b=label[base],
                             condition=c, seed=seed, binary=binary, same=same)
                if got is not None:
                    got.task = task
                    diffs.append(got)
                elif c != "all":
                    got = pairing(a_rows, b_rows, key, same)
                    notes.append(f"{label[d]} vs {label[base]} ({c}): no row pairs: " + (
                        f"{got.mismatched} rows share an id but hold other questions (another eval_seed, data or "
                        "tokenizer), so no paired difference is reported" if got.mismatched else
                        f"{got.unverified} rows share an id, but nothing shows they hold the same question (rows "
                        "written before instance hashes, from other data and prompts), so no paired difference is "
                        "reported" if got.unverified else "the runs share no scored question"))
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


def seed_line(s: dict) -> str:
    sd = "n/a" if s["sd_between_seeds"] is None else f"{100 * s['sd_between_seeds']:.1f}"
    return (f"- {s['condition']}: {s['metric']} {100 * s['mean']:.1f} (sd between seeds {sd}, range "
            f"{100 * s['min']:.1f}-{100 * s['max']:.1f}; {s['seeds']} seeds: {', '.join(s['runs'])})")
