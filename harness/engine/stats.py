"""Per-condition statistics of a run's samples: means, bootstrap standard errors, skips and tool-call counts."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import numpy as np


def summarize(records: Iterable[dict], metrics: tuple[str, ...], conditions: list[str] | None = None,
              keep_ids: set[str] | None = None, seed: int = 0, keep_keys: set[str] | None = None,
              axis_statistic: str | None = None) -> dict[str, dict[str, Any]]:
    """Per condition: n scored, n skipped (and why), mean and bootstrap SE of each metric, the rate at which
    an answer was found, tool-call counts, and the mean of the task's ``axis_statistic`` field (HotpotQA:
    gold_start), which also orders the conditions when ``conditions`` is not given. ``{metric}_skipped_as_0``
    counts skipped prompts as wrong, as the official HotpotQA script does for questions without a prediction."""
    by_condition: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if (keep_ids is None or r["id"] in keep_ids) and (keep_keys is None or r["key"] in keep_keys):
            by_condition[r["condition"]].append(r)
    order = conditions or (sorted(by_condition, key=lambda c: _mean(r.get(axis_statistic, 0) for r in by_condition[c]))
                           if axis_statistic else list(by_condition))
    return {c: _condition_row(by_condition.get(c, []), metrics, seed, axis_statistic) for c in order}


def _condition_row(recs: list[dict], metrics: tuple[str, ...], seed: int, axis_statistic: str | None) -> dict:
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
        if all(r.get("state_bytes") is not None for r in scored):  # the model state the prompts left
            row["state_bytes"] = _mean([r["state_bytes"] for r in scored])
        if any("tool_calls" in r for r in scored):
            calls = [c for r in scored for c in r.get("tool_calls", [])]
            row["tool_calls"] = len(calls)
            row["tool_calls_per_row"] = len(calls) / len(scored)
            row["rows_with_tool_calls"] = sum(1 for r in scored if r.get("tool_calls"))
            for status in ("ok", "no_match", "error", "timeout"):
                row[f"tool_{status}"] = sum(1 for c in calls if c["status"] == status)
    if axis_statistic and recs:
        row[axis_statistic] = _mean([r.get(axis_statistic, 0) for r in (scored or recs)])
    return row


def bootstrap_se(values, n_boot: int = 1000, seed: int = 0) -> float:
    """Standard error of the mean by the percentile-free bootstrap (std of resampled means)."""
    x = np.asarray(list(values), dtype=float)
    if len(x) < 2:
        return float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    return float(x[idx].mean(axis=1).std(ddof=1))


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")
