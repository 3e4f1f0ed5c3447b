"""What a samples.jsonl row must hold before anything counts it. The engine writes every row; a row edited by hand,
merged from another tool or damaged on disk (a NaN score, a null where text belongs, evidence that is not spans)
would otherwise reach a mean, a paired test or the report's page as a wrong number, a traceback or a page that shows
nothing. Readers name such a row by its file and line instead."""
from __future__ import annotations

import math
from typing import Any

TEXT_OR_ABSENT = ("generation", "prompt", "finish_reason", "prediction", "skipped")


def row_problem(rec: dict) -> str | None:
    """What is wrong with one row (None: it can be counted)."""
    bad = _non_finite(rec, "")
    if bad:
        return f"holds a non-finite number at {bad}"
    if not isinstance(rec.get("id"), str):
        return f"has id {rec.get('id')!r}, not text"
    if not isinstance(rec.get("condition"), (str, int, float)) or isinstance(rec.get("condition"), bool):
        return f"has condition {rec.get('condition')!r}, not a name or a number"
    for field in TEXT_OR_ABSENT:
        if field in rec and rec[field] is not None and not isinstance(rec[field], str):
            return f"has {field} of type {type(rec[field]).__name__}, not text"
    for field in ("generation", "prompt"):  # the engine writes text here, never null
        if field in rec and rec[field] is None:
            return f"has {field} null, not text"
    problem = _evidence_problem(rec.get("evidence"), rec.get("prompt"))
    if problem:
        return problem
    if "tool_calls" in rec:
        calls = rec["tool_calls"]
        if not isinstance(calls, list):
            return f"has tool_calls {_kind(calls)}, not a list of calls"
        for i, call in enumerate(calls):
            if not isinstance(call, dict) or not isinstance(call.get("status"), str):
                return f"has tool_calls[{i}] {call!r}, not a call with a status"
    if rec.get("skipped"):
        return None
    scores = rec.get("scores")
    if not isinstance(scores, dict) or not scores:
        return f"is scored but has scores {_kind(scores)}, not a table of metrics"
    for metric, value in scores.items():
        if not _number(value):
            return f"has scores.{metric} = {value!r}, not a number"
    if not _number(rec.get("prompt_tokens")):
        return f"has prompt_tokens {rec.get('prompt_tokens')!r}, not a number"
    if rec.get("state_bytes") is not None and not _number(rec["state_bytes"]):
        return f"has state_bytes {rec['state_bytes']!r}, not a number"
    return None


def _evidence_problem(spans: Any, prompt: Any) -> str | None:
    """Evidence: [start, end, label] spans into the prompt (absent or empty where a task marks none)."""
    if spans is None:
        return None
    if not isinstance(spans, list):
        return f"has evidence {_kind(spans)}, not a list of [start, end, label] spans"
    limit = len(prompt) if isinstance(prompt, str) else None
    for i, span in enumerate(spans):
        ok = (isinstance(span, list) and len(span) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                 for x in span[:2]) and isinstance(span[2], str))
        if ok:
            ok = 0 <= span[0] <= span[1] and (limit is None or span[1] <= limit)
        if not ok:
            return f"has evidence[{i}] = {span!r}, not a [start, end, label] span inside the prompt"
    return None


def _number(x: Any) -> bool:
    return isinstance(x, (int, float))  # a 0/1 score written as a boolean counts as its number


def _kind(x: Any) -> str:
    return "null" if x is None else f"of type {type(x).__name__}"


def _non_finite(x: Any, where: str) -> str | None:
    if isinstance(x, float) and not math.isfinite(x):
        return where or "the row"
    if isinstance(x, dict):
        for k, v in x.items():
            found = _non_finite(v, f"{where}.{k}" if where else str(k))
            if found:
                return found
    elif isinstance(x, list):
        for i, v in enumerate(x):
            found = _non_finite(v, f"{where}[{i}]")
            if found:
                return found
    return None
