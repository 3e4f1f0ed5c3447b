"""Run directories as a report reads them: results.json and the rows it counted (read once per file state),
run labels from the settings that differ, and one table of every run's conditions."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd

from evals import task_class
from evals.base import instance_key
from harness.engine.config import NOT_RESULT_DECIDING, RunConfig
from harness.engine.rows import row_problem
from harness.engine.runlog import SampleLog
from harness.engine.stats import summarize
from harness.hashing import json_digest

# Run settings that name a run in a legend when they differ between the runs of one report, in this order
# (then the task's own options, each as the task labels it).
LABEL_FIELDS = ("model", "retrieval", "template", "max_new_tokens", "data", "dtype", "backend", "seed", "stop",
                "max_tool_calls", "tool_timeout", "tool_max_chars", "limit", "ids", "split", "tokenizer", "cuda_graphs")
# Run flags no label needs: those that never change a row (the engine's list), the device (the hash holds its
# type; labels show the backend and dtype) and the template's hash (labels show the template).
UNLABELLED = (*NOT_RESULT_DECIDING, "device", "template_sha256")


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
    if not isinstance(results, dict) or not isinstance(results.get("config"), dict) \
            or not isinstance(results.get("metrics"), dict) or not isinstance(results.get("task"), str):
        raise ReportError(f"{res_file} is not a run's results.json (it needs task, config and metrics); rerun the "
                          "evaluation to rewrite it")
    run_hash = results.get("config_hash")
    log = SampleLog(run_dir, read_only=True)
    records = [r for r in log.records.values() if r.get("config_hash") == run_hash]  # the run's settings only
    sel = results.get("selection")
    if sel:
        keys = {instance_key(i, c) for i in sel["ids"] for c in run_conditions(results)}
        records = [r for r in records if r["key"] in keys]
        if len(records) < len(keys):
            raise ReportError(f"{run_dir}: results.json counted {len(keys)} rows, but samples.jsonl holds only "
                              f"{len(records)} of them made with its settings (hash {run_hash}); the directory was "
                              "changed after the run finished. Rerun the evaluation into it to make them again.")
    for rec in records:
        problem = row_problem(rec)
        if problem:
            file, line = log.origin[rec["key"]]
            raise ReportError(f"{file}:{line}: row {rec['key']!r} {problem}. harness.eval writes every row; restore "
                              f"that line, or delete it and rerun the evaluation into {run_dir} to make the row "
                              "again")
    return results, records


def run_conditions(results: dict) -> list[str]:
    return (results.get("selection") or {}).get("conditions") or list(results["metrics"])


def data_hash(results: dict) -> str | None:
    """The hash of the data a run read (None for runs that did not record it)."""
    return (results.get("resolved") or {}).get("data_sha256")


def run_settings(cfg: dict) -> dict:
    """A run's config with its task's options at the top level (HotpotQA's distractors, MQAR's keys, ...), every
    flag and option the run did not record (one added since) filled with its default: a run made before
    ``--vllm-arg`` existed ran with none, and differs in nothing from a run given none."""
    filled = {**_defaults(RunConfig), **cfg}
    options = {}
    try:
        options = _defaults(task_class(cfg.get("task")).Options)
    except (KeyError, ValueError, TypeError):  # an unknown task: its options as recorded
        pass
    return {**{k: v for k, v in filled.items() if k != "task_args"}, **options, **(cfg.get("task_args") or {})}


def implied_out(settings: dict, task: type) -> dict:
    """Settings without what another setting implies: the template a run used because of ``--retrieval`` (its
    task's default for that choice) is no difference of its own ("+retrieval", not "+retrieval
    template=hotpotqa_cot_retrieval")."""
    implied = task.retrieval_template if settings.get("retrieval") else task.default_template
    if settings.get("template") in (implied, None):
        return {k: v for k, v in settings.items() if k != "template"}
    return settings


def _defaults(cls) -> dict:
    """A dataclass's fields that have defaults, as JSON holds them."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return json.loads(json.dumps(out, default=str))


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
    fields = list(dict.fromkeys(list(LABEL_FIELDS) + options + sorted(run_flags - set(UNLABELLED))
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
        configs = [implied_out({k: v for k, v in run_settings(loaded[i][0]["config"]).items() if k not in swept},
                               task_class(task)) for i in idx]
        conds = [set(run_conditions(loaded[i][0])) for i in idx]
        for i, label in zip(idx, run_labels(configs, conds, task_class(task))):
            labels[i] = label
    rows = []
    for d, label, (results, samples) in zip(run_dirs, labels, loaded):
        cfg = run_settings(results["config"])
        first = next(iter(results["metrics"].values()), {})
        metrics = tuple(k for k in first if f"{k}_se" in first)
        statistic = task_class(results["task"]).axis_statistic
        by_condition = summarize(samples, metrics, run_conditions(results), keep_ids=keep_ids, seed=cfg.get("seed", 0),
                                 axis_statistic=statistic)
        audit = results.get("audit")
        for condition, m in by_condition.items():
            x, series = task_class(results["task"]).axis_position(condition, m.get(statistic) if statistic else None)
            rows.append({"run": label, "dir": str(d), "task": results["task"],
                         "audit": f"{audit['agree']}/{audit['rows']}" if audit else None,
                         "condition_name": results["condition"], "condition": condition, "x": x, "series": series,
                         **m})
    return pd.DataFrame(rows)


def explorer_runs(runs: list[str], df: pd.DataFrame, keep_ids: set[str] | None) -> list[dict]:
    """Each run's label, task and counted rows, for the HTML report's sample explorer."""
    label = dict(zip(df["dir"], df["run"]))
    out = []
    for d in runs:
        results, samples = load_run(d)
        out.append({"label": label.get(str(d), str(d)), "dir": str(d), "task": results["task"],
                    "condition_name": results["condition"], "data_sha256": data_hash(results),
                    "settings": results["config"],
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
