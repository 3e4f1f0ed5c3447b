"""One evaluation run (``EvalRun``): task → instances → prompts → backend → scores → run directory.

It knows nothing about any one model or task; both come in through their registries."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from evals import get_task, task_class
from evals.base import KEY_SEPARATOR, DataError, Instance, Task, ToolSpec, read_utf8
from harness import hub
from harness.backends.base import GenRequest
from harness.backends.loading import ModelLoadError, ResolvedModel, resolve
from harness.backends.tokenizer import load_tokenizer
from harness.engine import lm_eval_format
from harness.engine.audit import audit_rows
from harness.engine.config import ConfigError, RunConfig, settings_hash
from harness.engine.identity import awaits_download, model_identity
from harness.engine.prompting import PromptTemplate
from harness.engine.results import TABLE_LEGEND, format_markdown, git_hash, metrics_table, versions
from harness.engine.runlog import (
    ResumeMismatchError,
    RunDirError,
    RunLock,
    SampleLog,
    check_run_meta,
    describe_changes,
    move_aside,
    write_run_meta,
)
from harness.engine.stats import summarize
from harness.models.registry import ModelSpec
from harness.files import write_atomic, write_json
from harness.hashing import content_sha256, digest, json_digest

log = logging.getLogger("harness")

def _load_tokenizer(spec: ModelSpec, task: str):
    """The tokenizer the model will use, loaded before the model (a task builds its prompts with it)."""
    name = spec.tokenizer or spec.path
    hub.require((name, "tokenizer"))
    try:
        return load_tokenizer(name)
    except OSError as e:
        raise ModelLoadError(f"task {task!r} needs the model's tokenizer and {name!r} could not be loaded "
                             f"({e}); pass --tokenizer with a local copy") from e


def distributed_state():
    """accelerate's process state when launched on several ranks (accelerate launch / torchrun), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def select_rows(rows: list[dict], ids_file: str | None, limit: int | None) -> list[dict]:
    if ids_file:
        if not Path(ids_file).is_file():
            raise DataError(f"--ids {ids_file}: no such file; give a file of question ids, one per line or a JSON list")
        text = read_utf8(ids_file, "--ids file")
        wanted = json.loads(text) if text.lstrip().startswith("[") else [l.strip() for l in text.splitlines() if l.strip()]
        have = {r["_id"] for r in rows}
        missing = [i for i in wanted if i not in have]
        if missing:
            raise DataError(f"--ids {ids_file}: {len(missing)} id(s) not in the data, e.g. {missing[:3]}")
        keep = set(wanted)
        rows = [r for r in rows if r["_id"] in keep]
    return rows[:limit] if limit is not None else rows


def rank_share(todo: list[Instance], prompts: dict[str, str], rank: int, world: int) -> list[Instance]:
    """This rank's part of what is left: a fixed split (any number of ranks can resume any run) into contiguous
    runs of the prompts in text order, so prompts that share a prefix (one question's positions, one book's
    depths) mostly land on one rank and its prefix tree. Instance order within the share."""
    ranked = sorted(range(len(todo)), key=lambda i: prompts[todo[i].key])
    mine = set(ranked[len(ranked) * rank // world:len(ranked) * (rank + 1) // world])
    return [ins for i, ins in enumerate(todo) if i in mine]


def _check_unique(instances: list[Instance], source: str | None) -> None:
    """Every id once per condition, and no id holding the key separator (keys must split one way)."""
    bad = sorted({i.id for i in instances if KEY_SEPARATOR in i.id})
    if bad:
        raise DataError(f"{len(bad)} question id(s) in the data {source or ''} contain {KEY_SEPARATOR!r} ({', '.join(bad[:5])}"
                        f"{', ...' if len(bad) > 5 else ''}), which separates an id from its condition in a run's "
                        "keys; rename them")
    counts = Counter((i.id, i.condition) for i in instances)
    dup = sorted({i for (i, _), n in counts.items() if n > 1})
    if dup:
        raise DataError(f"{len(dup)} question id(s) occur more than once in the data {source or ''} ({', '.join(dup[:5])}"
                        f"{', ...' if len(dup) > 5 else ''}); each would be counted twice and resume by id is "
                        "ambiguous. Give every row a unique _id.")


def _backend_settings(resolved: dict, backend) -> dict:
    """The dtype and device type a given backend really runs with override what the flags resolve to."""
    if backend is None:
        return resolved
    info = backend.describe()
    out = {**resolved, "dtype": info.dtype, "device_type": torch.device(info.device).type}
    if info.scan:  # Phi-Mamba: the reference scan or mamba-ssm's kernels (and their dot precision) round apart
        out["scan"] = info.scan
    if info.linear:  # a CPU's linear layers on oneDNN: they round apart from PyTorch's BLAS
        out["linear"] = info.linear
    if info.attention:  # a CPU's attention by the flash kernel: it rounds apart from SDPA
        out["attention"] = info.attention
    return out


def run_eval(cfg: RunConfig, backend=None, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) one evaluation and write its run directory; returns the results dict."""
    return EvalRun(cfg, backend, progress).run()


@dataclass(frozen=True)
class PreparedRun:
    """A run as ``prepare`` fixed it before any file is written: the resolved config, the model (resolved once:
    spec, backend, device, dtype, engine arguments), the task (built with all it needs, never changed afterwards), the template,
    the selected rows, their instances and prompts, what each row asks of the backend (stop strings, the scorer's
    options, the tool's settings) and the settings hash with what it hashes."""

    cfg: RunConfig
    model: ResolvedModel
    task: Task
    template: PromptTemplate
    rows: list[dict]
    instances: list[Instance]
    prompts: dict[str, str]
    stop: list[str]
    score_kw: dict
    tool_spec: ToolSpec
    resolved: dict
    config_hash: str

    def with_identity(self, identity: dict) -> "PreparedRun":
        """The same run with the model's identity as loading found it (a hub model fetched to a commit)."""
        resolved = {**self.resolved, **identity}
        return dataclasses.replace(self, resolved=resolved, config_hash=settings_hash(resolved))


def prepare(cfg: RunConfig, backend=None, dist=None) -> tuple[PreparedRun, Any]:
    """Everything that can be checked before a file is written (flags, data, the template on every prompt, the
    model's identity), and the settings hash; returns the prepared run and the backend (``backend``, or the model
    loaded here when a hub model must be fetched before its identity is known)."""
    cfg.validate()
    # an unknown name, a missing folder or a backend that cannot run it fails here, at once
    model = resolve(cfg.model, cfg.tokenizer, cfg.backend, cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.vllm_arg)
    spec = model.spec
    absent = hub.missing((spec.path, "model"), (spec.tokenizer, "tokenizer")) if backend is None else []
    tokenizer = None
    if task_class(cfg.task).needs_tokenizer:  # e.g. contexts measured in the model's tokens
        tokenizer = backend.tokenizer if backend is not None else _load_tokenizer(spec, cfg.task)
    task = get_task(cfg.task, data=cfg.data, split=cfg.split, tokenizer=tokenizer, **cfg.task_args)
    if cfg.retrieval and task.retrieval_template is None and not cfg.template:
        raise ConfigError(f"--retrieval: task {cfg.task!r} has no retrieval prompt; pass --template with one")
    template = PromptTemplate(cfg.template or (task.retrieval_template if cfg.retrieval else task.default_template))
    # Resolved once: the task's complete options, the template, the budget; run.json records this config.
    cfg = dataclasses.replace(cfg, task_args=dataclasses.asdict(task.options), template=_absolute(cfg.template) or
                              template.name, template_sha256=template.sha256, data=_absolute(cfg.data),
                              ids=_absolute(cfg.ids), output=_absolute(cfg.output, always=True),
                              max_new_tokens=cfg.max_new_tokens or task.default_max_new_tokens)
    answer_phrase = template.declared("answer_phrase")
    tool_spec = ToolSpec(enabled=cfg.retrieval, max_calls=cfg.max_tool_calls, timeout=cfg.tool_timeout,
                         max_chars=cfg.tool_max_chars)
    all_rows = _load_rows(task, spec, absent)
    if not all_rows:
        raise DataError(f"--data {cfg.data or cfg.task}: the data holds no rows; give a file with at least one "
                        "question")
    rows = select_rows(all_rows, cfg.ids, cfg.limit)
    if not rows:
        raise DataError(f"the selection is empty: {len(all_rows)} row(s) in the data, none selected by "
                        f"--limit/--ids ({cfg.ids or cfg.limit})")
    instances = task.instances(rows, seed=cfg.seed, pool_rows=all_rows)
    _check_unique(instances, cfg.data)
    prompts = _render(task, template, instances, tool_spec)
    identity = model_identity(spec.path, spec.tokenizer)
    if awaits_download(spec.path, spec.tokenizer, identity) and backend is None:
        # a hub model not in the HF cache: loading it downloads it, and then its commit is known
        backend = _load_model(model, dist)
        identity = model_identity(spec.path, spec.tokenizer)
    selects = tuple(f.name for f in dataclasses.fields(task.Options) if f.metadata.get("selects"))
    resolved = cfg.resolved(content_sha256(all_rows), template.sha256, model, selects=selects)
    resolved.update(identity)
    resolved.update(model.identity())  # decided before loading (the CLI's case) ...
    resolved = _backend_settings(resolved, backend)  # ... and what a backend passed in really runs, the same way
    return PreparedRun(cfg=cfg, model=model, task=task, template=template,
                       rows=rows, instances=instances, prompts=prompts,
                       stop=cfg.stop if cfg.stop is not None else task.stop,
                       score_kw={"answer_phrase": answer_phrase} if answer_phrase else {}, tool_spec=tool_spec,
                       resolved=resolved, config_hash=settings_hash(resolved)), backend


def _load_rows(task: Task, spec: ModelSpec, absent: list) -> list[dict]:
    """The task's data; offline, everything missing (model, tokenizer, data) is named in one error."""
    why = (f"{spec.path} carries no tokenizer of its own (goombalab's folders do not); its tokenizer is "
           f"{spec.tokenizer}'s (--tokenizer picks another)." if spec.tokenizer and Path(spec.path).is_dir()
           else "")
    try:
        rows = task.load()
    except DataError as e:
        raise (hub.unreachable_error(absent, also=str(e), why=why) if absent else e) from None
    if absent:
        raise hub.unreachable_error(absent, why=why)
    return rows


def _render(task: Task, template: PromptTemplate, instances: list[Instance], tool_spec: ToolSpec) -> dict[str, str]:
    tool_vars = tool_spec.template_vars()
    prompts = {i.key: template.render(**task.template_vars(i), tool=tool_vars) for i in instances}
    empty = [k for k, p in prompts.items() if not p.strip()]
    if empty:
        names = ", ".join(task.template_vars(instances[0]))
        raise ConfigError(f"template {template.path} renders an empty prompt for {len(empty)} instance(s) (e.g. "
                          f"{empty[0]}); check that it writes the task's variables ({names})")
    return prompts


def _prepared(name: str) -> property:
    return property(lambda self: getattr(self.prepared, name), doc=f"the prepared run's ``{name}``")


class EvalRun:
    """One evaluation run, in the order it happens. ``prepare`` checks everything that can be checked before a
    file is written and fixes the settings hash (a ``PreparedRun``); ``run`` then holds the run directory's lock
    while it resumes (``resume``), loads the model only if something is left to generate, generates
    (``generate``), collects the rows (``collect``) and writes the results (``report``).
    ``harness.engine.audit`` reads its prompts, stops and tool settings."""

    cfg, task, rows, instances, prompts = (_prepared(n) for n in ("cfg", "task", "rows", "instances", "prompts"))
    stop, score_kw, tool_spec, resolved, config_hash = (_prepared(n) for n in ("stop", "score_kw", "tool_spec",
                                                                               "resolved", "config_hash"))

    def __init__(self, cfg: RunConfig, backend=None, progress: bool = True):
        self.t0 = time.perf_counter()
        self.progress = progress
        self.dist = distributed_state()
        self.rank, self.world = (self.dist.process_index, self.dist.num_processes) if self.dist else (0, 1)
        self.prepared, self.backend = prepare(cfg, backend, self.dist)
        self.lock = RunLock(self.cfg.output) if self.rank == 0 else None

    # -- under the run directory's lock -------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        if self.lock is not None:
            self.lock.acquire()
        try:
            if self.cfg.overwrite and self.rank == 0:
                move_aside(Path(self.cfg.output), _run_files(Path(self.cfg.output)))
            todo, n_todo, n_stale = self.resume()
            t_load = time.perf_counter()
            if self.backend is None and (todo or not self.has_meta):
                self.backend = _load_model(self.prepared.model, self.dist)
                self._identity_after_loading(fresh=not self.has_meta and not self.samples.records)
            load_s = time.perf_counter() - t_load
            self._log_backend()
            if not self.has_meta and self.rank == 0:  # only now: model, data, template and flags all work
                write_run_meta(Path(self.cfg.output), self.config_hash, self.resolved, self.cfg.to_dict())
            gen_s, new_tokens = self.generate(todo)
            self.samples.close()
            if self.dist:
                self.dist.wait_for_everyone()
                if self.rank != 0:
                    return {"rank": self.rank, "counts": {"generated": len(todo)}}
            records = self.collect()
            timings = {"load_s": round(load_s, 3), "generate_s": round(gen_s, 3),
                       "total_s": round(time.perf_counter() - self.t0, 3), "new_tokens": new_tokens,
                       "tokens_per_s": round(new_tokens / gen_s, 2) if gen_s > 0 else None, **self.prefill_stats}
            return self.report(records, {"generated": n_todo, "resumed": len(self.instances) - n_todo,
                                         "stale_regenerated": n_stale}, timings)
        finally:
            if self.lock is not None:
                self.lock.release()

    def resume(self) -> tuple[list[Instance], int, int]:
        """What is left to generate on this rank: instances without a row, and rows whose prompt or gold answer
        is no longer what the data and template give. Rows of other settings are refused, never mixed."""
        cfg, out = self.cfg, Path(self.cfg.output)
        self.has_meta = check_run_meta(out, self.config_hash, self.resolved)
        self.samples = SampleLog(out, shard=f"rank{self.rank}" if self.world > 1 else None)
        foreign = Counter(str(r.get("config_hash")) for r in self.samples.records.values()
                          if r.get("config_hash") != self.config_hash)
        if foreign:
            raise ResumeMismatchError(
                f"{out}/samples.jsonl holds {sum(foreign.values())} row(s) made with other settings or with no "
                f"settings hash (hash {', '.join(foreign)} vs {self.config_hash} now); they would mix with this "
                "run's. Use a new --output, or --overwrite to start over (the old rows are moved aside, not deleted).")
        records = self.samples.records
        stale = [i.key for i in self.instances if i.key in records and _is_stale(records[i.key], i, self.prompts[i.key])]
        if stale:
            log.warning("%d finished row(s) were made from a prompt or gold answer that differs from what the data "
                        "and template give now (e.g. %s); they are regenerated", len(stale), stale[0])
        stale_set = set(stale)
        if self.dist:
            self.dist.wait_for_everyone()  # every rank has read the same "done" set before anyone writes
        todo = [ins for ins in self.instances if ins.key not in records or ins.key in stale_set]
        log.info("task %s: %d questions x %d conditions (%s) = %d instances (%d already done in %s)", cfg.task,
                 len(self.rows), len({i.condition for i in self.instances}), self.task.condition, len(self.instances),
                 len(self.instances) - len(todo), cfg.output)
        n_todo = len(todo)
        todo = rank_share(todo, self.prompts, self.rank, self.world)
        if self.world > 1:
            log.info("rank %d of %d: %d instances", self.rank, self.world, len(todo))
        return todo, n_todo, len(stale)

    def _identity_after_loading(self, fresh: bool) -> None:
        """The loaded files hashed again: a hub model can resolve to a newer commit once it is fetched (a new run
        takes the commit it loaded; a resumed one is refused), and a local checkpoint rewritten while it loaded
        may have been read half old, half new (refused)."""
        spec = self.prepared.model.spec
        now = model_identity(spec.path, spec.tokenizer)
        before = {k: self.resolved.get(k) for k in now}
        if now != before:
            if not fresh or hub.is_local(spec.path) or (spec.tokenizer and hub.is_local(spec.tokenizer)):
                raise ResumeMismatchError(f"{self.cfg.output} holds a run made with other settings: "
                                          f"{describe_changes(before, now)} (the model was fetched or rewritten as "
                                          "it loaded). Use a new --output, or --overwrite to start over.")
            self.prepared = self.prepared.with_identity(now)
        # what the loaded backend runs (dtype, device, scan) against what the hash assumed before loading
        ran = {k: v for k, v in _backend_settings({}, self.backend).items() if k in self.resolved}
        before = {k: self.resolved[k] for k in ran}
        if ran != before:
            if not fresh:
                raise ResumeMismatchError(f"{self.cfg.output} holds a run made with other settings: "
                                          f"{describe_changes(before, ran)} (as the model loaded here). Use a new "
                                          "--output, or --overwrite to start over.")
            self.prepared = self.prepared.with_identity(ran)

    def _log_backend(self) -> None:
        if self.backend is not None:
            info = self.backend.describe()
            log.info("model %s: backend=%s device=%s dtype=%s batch_size=%s", self.cfg.model, info.backend,
                     info.device, info.dtype, self.cfg.batch_size)

    def generate(self, todo: list[Instance]) -> tuple[float, int]:
        """Generate and score ``todo`` batch by batch, each batch's rows written as soon as it is done. A prompt
        that does not fit the model's context is recorded as skipped, never truncated."""
        self.prefill_stats: dict[str, Any] = {}
        if not todo:
            return 0.0, 0
        cfg, backend = self.cfg, self.backend
        prompts = [self.prompts[ins.key] for ins in todo]
        prompt_ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
        limit = backend.max_context
        fits, too_long = [], []
        for i, ids in enumerate(prompt_ids):
            (too_long if limit is not None and len(ids) + cfg.max_new_tokens > limit else fits).append(i)
        if too_long:
            log.warning("%d prompt(s) do not fit the model's %d-token context with %d new tokens; they are skipped "
                        "and counted per position (never truncated)", len(too_long), limit, cfg.max_new_tokens)
            self.samples.write(self._record(todo[i], prompts[i], len(prompt_ids[i]), None, None,
                                            skipped="prompt_too_long") for i in too_long)
        gen_s, new_tokens = 0.0, 0
        bar = tqdm(total=len(todo), desc=f"{cfg.model} {cfg.task}", unit="sample",
                   disable=not (self.progress and self.rank == 0))
        bar.update(len(too_long))
        keep_stop = self.task.include_stop  # e.g. IsTree's verdict token is its stop string
        reqs = [self.request(todo[i], prompt_ids[i]) for i in fits]
        tools = [r.tool for r in reqs]
        t = time.perf_counter()
        generation = backend.generate_all(reqs, batch_size=cfg.batch_size, batching=cfg.batching,
                                          prefix_reuse=cfg.prefix_reuse,
                                          prefix_memory=cfg.prefix_memory)
        for batch, outs in generation:
            gen_s += time.perf_counter() - t
            new_tokens += sum(o.new_tokens for o in outs)
            self.samples.write(
                self._record(todo[fits[j]], prompts[fits[j]], o.prompt_tokens, o,
                             self.task.score(todo[fits[j]], o.text + (o.stop_string or "" if keep_stop else ""),
                                             **self.score_kw),
                             tool=tools[j], state_bytes=backend.state_bytes(o.prompt_tokens))
                for j, o in zip(batch, outs))
            bar.update(len(batch))
            t = time.perf_counter()
        bar.close()
        # what prefill cost, against the least it could, and which plan ran (results.json timings)
        self.prefill_stats = generation.plan.to_json()
        return gen_s, new_tokens

    def request(self, ins: Instance, prompt_ids: list[int] | None = None) -> GenRequest:
        """What one instance asks of the backend: its prompt, the budget, the stop strings and a fresh tool."""
        return GenRequest(self.prompts[ins.key], self.cfg.max_new_tokens, self.stop,
                          self.task.make_tool(ins, self.tool_spec), prompt_ids=prompt_ids)

    def _record(self, ins: Instance, prompt: str, prompt_tokens: int, out, scored: dict | None,
                skipped: str | None = None, tool=None, state_bytes: int | None = None) -> dict:
        """One samples.jsonl line; ``state_bytes``: the model state the prompt left (the paper's memory axis)."""
        rec = {"key": ins.key, "id": ins.id, "condition": ins.condition, **self.task.record_fields(ins),
               "config_hash": self.config_hash, "prompt_sha256": digest(prompt),
               "instance_sha256": json_digest(dataclasses.asdict(ins)), "prompt_tokens": prompt_tokens,
               "state_bytes": state_bytes, "gold": ins.answer, "skipped": skipped, "prompt": prompt,
               "evidence": _locate(prompt, self.task.evidence(ins))}
        if out is not None:
            rec.update(generation=out.text, finish_reason=out.finish_reason, new_tokens=out.new_tokens,
                       prediction=scored["prediction"], answer_found=scored["answer_found"],
                       scores={k: v for k, v in scored.items() if k not in ("prediction", "answer_found")})
            if tool is not None:
                rec["tool_calls"] = tool.log
                rec["tool_tokens"] = out.tool_tokens
        return rec

    def collect(self) -> list[dict]:
        """Every instance's row, in instance order, from this run's settings only (checked on disk)."""
        out = Path(self.cfg.output)
        self.lock.verify()  # the directory is still the one this run locked: its rows are this run's
        self.samples.merge([i.key for i in self.instances], self.config_hash)
        missing = [i.key for i in self.instances if i.key not in self.samples.records]
        if missing:
            raise RunDirError(f"{out}: {len(missing)} instance(s) have no record after the run "
                              f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); rerun the same "
                              "command to generate them")
        return [self.samples.records[i.key] for i in self.instances]

    def report(self, records: list[dict], counts: dict, timings: dict) -> dict[str, Any]:
        """Per-condition statistics, the table and the task's own files; results.json last (it marks the run
        finished)."""
        cfg, task, out = self.cfg, self.task, Path(self.cfg.output)
        conditions = list(dict.fromkeys(i.condition for i in self.instances))
        by_condition = summarize(records, task.metrics, conditions, seed=cfg.seed, axis_statistic=task.axis_statistic)
        results = {
            "task": cfg.task, "task_summary": task.describe(self.prepared.template.variables), "condition": task.condition,
            "model": cfg.model, "config": cfg.to_dict(), "config_hash": self.config_hash, "resolved": self.resolved,
            "backend": self.backend.describe().to_json() if self.backend is not None else None,
            "metrics": by_condition,
            "counts": {"questions": len(self.rows), "instances": len(self.instances), **counts, "ranks": self.world,
                       "skipped_too_long": sum(m["skipped_too_long"] for m in by_condition.values())},
            "selection": {"ids": list(dict.fromkeys(i.id for i in self.instances)), "conditions": conditions},
            "timings": timings, "seed": cfg.seed, "versions": versions(), "git": git_hash(),
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        if cfg.audit:
            by_key = {i.key: i for i in self.instances}
            backend = self.backend if self.backend is not None else _load_model(self.prepared.model, self.dist)
            results["audit"] = audit_rows(cfg, self.prepared.model, backend, records,
                                          lambda key: self.request(by_key[key]), cfg.audit)
        df = metrics_table(by_condition, task.metrics, task.condition)
        results["table"] = (format_markdown(df, task.metrics, id_cols=(task.condition,)) + audit_line(results)
                            + f"\n\n{TABLE_LEGEND}")
        results["files"] = ["results.json", "samples.jsonl", *task.write_outputs(records, out, conditions),
                            "table.md", "table.csv", *lm_eval_format.write(out, results, records, task.metrics)]
        write_atomic(out / "table.csv", df.to_csv(index=False))
        write_atomic(out / "table.md", results["table"] + "\n")
        self.lock.verify()
        write_json(out / "results.json", results, indent=2, default=str)
        return results


def _absolute(value: str | None, always: bool = False) -> str | None:
    """A path flag as an absolute path, so run.json and results.json resolve from anywhere (a report run from
    another folder); names that are not paths (a hub dataset, ``fixture``, a bundled template) stay as given."""
    if value is None or not (always or Path(value).expanduser().exists()):
        return value
    return str(Path(value).expanduser().resolve())


def _run_files(out: Path) -> set[str]:
    """What the evaluation in ``out`` wrote: the engine's own files and those its results.json lists (a task's
    outputs, e.g. HotpotQA's predictions/), never anything else a user keeps there."""
    names = {"run.json", "samples.jsonl", "samples.rejected.txt", "results.json", "table.md", "table.csv"}
    names |= {p.name for p in out.glob("samples.rank*.jsonl")}
    try:
        names |= {f.rstrip("/") for f in json.loads((out / "results.json").read_text()).get("files", [])}
    except (OSError, ValueError):
        pass
    return names


def _load_model(model: ResolvedModel, dist):
    """The run's backend, on this rank's GPU when launched on several."""
    if dist is not None and model.device_arg == "auto" and torch.cuda.is_available():
        model = model.on_device(f"cuda:{dist.local_process_index}")
    return model.load()


def audit_line(results: dict) -> str:
    """The audit's verdict under a results table ("" without one)."""
    a = results.get("audit")
    if not a:
        return ""
    ref = a["reference"]
    return (f"\n\naudit: {a['agree']} of {a['rows']} rows generated again alone (batch 1, no prefix reuse, no CUDA "
            f"graphs, {ref['dtype']}) agree" + (f"; first difference: {a['differ'][0]['key']} at generated token "
                                                f"{a['differ'][0]['token']}" if a["differ"] else ""))


def _locate(prompt: str, texts: list[tuple[str, str]]) -> list[list]:
    """[start, end, label] of each text in the prompt, found from its end (the test input follows the few-shot
    exemplars); texts the template does not show verbatim are left out."""
    spans = []
    for text, label in texts:
        at = prompt.rfind(text) if text else -1
        if at >= 0:
            spans.append([at, at + len(text), label])
    return spans


def _is_stale(rec: dict, ins: Instance, prompt: str) -> bool:
    """A finished row whose prompt or gold answer is not what this run would use (its prompt hash is checked
    whenever the row carries one)."""
    sha = rec.get("prompt_sha256")
    return (sha is not None and sha != digest(prompt)[:len(sha)]) or rec.get("gold") != ins.answer
