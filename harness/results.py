"""Run outputs built from the resume log (``harness.runlog``): per-condition statistics and output formats.

Files in a run directory:
  samples.jsonl      one line per (question, condition): prompt, generation, answer, scores, tool calls
  results.json       metrics per condition (HotpotQA: gold position) with bootstrap standard errors, config,
                     versions, timings, skips
  ...                task-specific files (HotpotQA: predictions/, official prediction files per position)
  table.md / .csv    the per-condition table
"""
from __future__ import annotations

import platform
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from evals.metrics import bootstrap_se


def summarize(records: Iterable[dict], metrics: tuple[str, ...], conditions: list[str] | None = None,
              keep_ids: set[str] | None = None, seed: int = 0,
              keep_keys: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per condition: n scored, n skipped (and why), mean and bootstrap SE of each metric, the rate at which
    an answer was found, tool-call counts. ``{metric}_skipped_as_0`` counts skipped prompts as wrong, as the
    official HotpotQA script does for questions without a prediction."""
    by_pos: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if (keep_ids is None or r["id"] in keep_ids) and (keep_keys is None or r["key"] in keep_keys):
            by_pos[condition_of(r)].append(r)
    order = conditions or sorted(by_pos, key=lambda p: _mean([r.get("gold_start", 0) for r in by_pos[p]]))
    out = {}
    for pos in order:
        recs = by_pos.get(pos, [])
        scored = [r for r in recs if not r.get("skipped")]
        row: dict[str, Any] = {"n": len(scored), "skipped": sum(1 for r in recs if r.get("skipped")),
                               "skipped_too_long": sum(1 for r in recs if r.get("skipped") == "prompt_too_long")}
        for m in metrics:
            vals = [float(r["scores"][m]) for r in scored]
            row[m] = _mean(vals)
            row[f"{m}_se"] = bootstrap_se(vals, seed=seed) if vals else float("nan")
            row[f"{m}_skipped_as_0"] = sum(vals) / len(recs) if recs else float("nan")
        row["answer_found"] = _mean([float(r.get("answer_found", False)) for r in scored])
        if scored:
            row["prompt_tokens"] = _mean([r["prompt_tokens"] for r in scored])
            row["gold_start"] = _mean([r.get("gold_start", 0) for r in scored])
            calls = [c for r in scored for c in r.get("tool_calls", [])]
            if any("tool_calls" in r for r in scored):
                row["tool_calls"] = len(calls)
                for status in ("ok", "no_match", "error", "timeout"):
                    row[f"tool_{status}"] = sum(1 for c in calls if c["status"] == status)
        elif recs:
            row["gold_start"] = _mean([r.get("gold_start", 0) for r in recs])
        out[pos] = row
    return out


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("icr-harness", "torch", "transformers", "accelerate", "datasets", "jinja2", "mamba-ssm", "vllm"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def git_hash() -> str | None:
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return res.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def condition_of(record: dict) -> str:
    """A sample's condition (``position`` in runs written before tasks declared their condition)."""
    return record["condition"] if "condition" in record else record["position"]


def metrics_table(by_position: dict[str, dict], metrics: tuple[str, ...], condition: str = "position"):
    """A pandas DataFrame: one row per condition, each metric as 'mean ± se' ready for markdown."""
    import pandas as pd

    rows = []
    for pos, m in by_position.items():
        row = {condition: pos, "n": m["n"], "skipped": m["skipped"], "answer_found": m.get("answer_found")}
        for k in metrics:
            row[k] = m[k]
            row[f"{k}_se"] = m[f"{k}_se"]
        rows.append(row)
    return pd.DataFrame(rows)


def format_markdown(df, metrics: tuple[str, ...], id_cols=("position",)) -> str:
    """Metrics in percent as 'mean ± SE'; ``answer found`` is the share of scored generations in which the
    answer rule found an answer (a low rate means format failures, not wrong answers)."""
    shown = df[[*id_cols, "n", "skipped"]].copy()
    if "answer_found" in df:
        shown["answer found"] = [f"{100 * v:.1f}" if v == v and v is not None else "n/a" for v in df["answer_found"]]
    for m in metrics:
        shown[m] = [f"{100 * v:.1f} ± {100 * s:.1f}" if v == v else "n/a" for v, s in zip(df[m], df[f"{m}_se"])]
    return shown.to_markdown(index=False)
