"""Run outputs: samples.jsonl appended as batches finish (the resume log), and the summaries built from it.

Files in a run directory:
  samples.jsonl      one line per (question, position): prompt, generation, answer, scores, tool calls
  results.json       metrics per position with bootstrap standard errors, config, versions, timings, skips
  predictions/       official HotpotQA prediction files, one per position
  table.md / .csv    the per-position table
"""
from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from evals.metrics import bootstrap_se

log = logging.getLogger("harness")


class ResumeMismatchError(RuntimeError):
    pass


class SampleLog:
    """Append-only JSONL keyed by ``id@position``; reopening it skips what is already there.

    With several ranks each appends to its own shard (``samples.rankN.jsonl``) and every rank reads all
    shards, so a resumed run knows what is done whatever the number of ranks before; ``merge`` folds the
    shards into one ``samples.jsonl``."""

    def __init__(self, out_dir: str | Path, config_hash: str, config: dict, shard: str | None = None):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / ("samples.jsonl" if shard is None else f"samples.{shard}.jsonl")
        self.config_hash = config_hash
        meta = self.dir / "run.json"
        if meta.exists():
            prev = json.loads(meta.read_text())
            if prev.get("config_hash") != config_hash:
                raise ResumeMismatchError(
                    f"{self.dir} holds a run with different settings (config hash {prev.get('config_hash')} vs "
                    f"{config_hash}; changed: {_diff(prev.get('config', {}), config)}). Use a new --output, "
                    "or delete the directory to start over.")
        else:
            tmp = meta.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"config_hash": config_hash, "config": config}, indent=2, default=str))
            tmp.replace(meta)
        self.records: dict[str, dict] = {}
        for f in self._files():
            self._load(f, own=(f == self.path))
        self._fh = open(self.path, "a", encoding="utf-8")

    def _files(self) -> list[Path]:
        return [f for f in [self.dir / "samples.jsonl", *sorted(self.dir.glob("samples.*.jsonl"))] if f.exists()]

    def _load(self, path: Path, own: bool) -> None:
        good_bytes = 0
        with open(path, "rb") as fh:
            for raw in fh:
                try:
                    rec = json.loads(raw)
                except json.JSONDecodeError:
                    break  # a line cut short by a kill: drop it and everything after
                self.records[rec["key"]] = rec
                good_bytes += len(raw)
        if own and good_bytes < path.stat().st_size:
            log.warning("%s ended in a partial line (interrupted write); it is dropped and redone", path.name)
            with open(path, "r+b") as fh:
                fh.truncate(good_bytes)

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def write(self, records: Iterable[dict]) -> None:
        for rec in records:
            self.records[rec["key"]] = rec
            self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def merge(self, order: list[str]) -> None:
        """Re-read every shard, write one samples.jsonl (``order`` first, then any other keys), drop shards."""
        self.records = {}
        files = self._files()
        for f in files:
            self._load(f, own=False)
        keys = [k for k in order if k in self.records] + [k for k in self.records if k not in set(order)]
        tmp = self.dir / "samples.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            for k in keys:
                fh.write(json.dumps(self.records[k], ensure_ascii=False) + "\n")
        tmp.replace(self.dir / "samples.jsonl")
        for f in files:
            if f.name != "samples.jsonl":
                f.unlink()


def _diff(a: dict, b: dict) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in ("positions", "limit", "ids",
                                                                               "batch_size", "device", "output"))
    return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys) or "unknown"


def summarize(records: Iterable[dict], metrics: tuple[str, ...], positions: list[str] | None = None,
              keep_ids: set[str] | None = None, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per position: n scored, n skipped (and why), mean and bootstrap SE of each metric, tool-call counts."""
    by_pos: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if keep_ids is None or r["id"] in keep_ids:
            by_pos[r["position"]].append(r)
    order = positions or sorted(by_pos, key=lambda p: _mean([r.get("gold_start", 0) for r in by_pos[p]]))
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
        if scored:
            row["answer_found"] = _mean([float(r.get("answer_found", False)) for r in scored])
            row["prompt_tokens"] = _mean([r["prompt_tokens"] for r in scored])
            row["gold_start"] = _mean([r.get("gold_start", 0) for r in scored])
            calls = [c for r in scored for c in r.get("tool_calls", [])]
            if any("tool_calls" in r for r in scored):
                row["tool_calls"] = len(calls)
                for status in ("ok", "no_match", "error", "timeout"):
                    row[f"tool_{status}"] = sum(1 for c in calls if c["status"] == status)
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


def write_predictions(records: Iterable[dict], out_dir: Path) -> list[Path]:
    """Official HotpotQA prediction files ({"answer": {id: text}, "sp": {id: []}}), one per position."""
    by_pos: dict[str, dict] = defaultdict(lambda: {"answer": {}, "sp": {}})
    for r in records:
        if not r.get("skipped"):
            by_pos[r["position"]]["answer"][r["id"]] = r["prediction"]
            by_pos[r["position"]]["sp"][r["id"]] = []
    pred_dir = out_dir / "predictions"
    pred_dir.mkdir(exist_ok=True)
    paths = []
    for pos, preds in by_pos.items():
        p = pred_dir / f"{pos}.json"
        p.write_text(json.dumps(preds, indent=1, ensure_ascii=False))
        paths.append(p)
    return paths


def metrics_table(by_position: dict[str, dict], metrics: tuple[str, ...]):
    """A pandas DataFrame: one row per position, each metric as 'mean ± se' ready for markdown."""
    import pandas as pd

    rows = []
    for pos, m in by_position.items():
        row = {"position": pos, "n": m["n"], "skipped": m["skipped"]}
        for k in metrics:
            row[k] = m[k]
            row[f"{k}_se"] = m[f"{k}_se"]
        rows.append(row)
    return pd.DataFrame(rows)


def format_markdown(df, metrics: tuple[str, ...], id_cols=("position",)) -> str:
    shown = df[[*id_cols, "n", "skipped"]].copy()
    for m in metrics:
        shown[m] = [f"{100 * v:.1f} ± {100 * s:.1f}" if v == v else "n/a" for v, s in zip(df[m], df[f"{m}_se"])]
    return shown.to_markdown(index=False)
