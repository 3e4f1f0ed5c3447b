"""Per-condition statistics of a run's samples: means, bootstrap standard errors, skips and tool-call counts."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from evals.metrics import bootstrap_se


def condition_of(record: dict) -> str:
    """A sample's condition (``position`` in runs written before tasks declared their condition)."""
    return record["condition"] if "condition" in record else record["position"]



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
            if all(r.get("state_bytes") is not None for r in scored):  # the model state the prompts left
                row["state_bytes"] = _mean([r["state_bytes"] for r in scored])
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
