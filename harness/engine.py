"""The evaluation engine: task → instances → prompts → backend → scores → run directory.

It knows nothing about any one model or task; both come in through their registries."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from evals import get_task
from evals.base import DataError, Instance, ToolSpec, read_utf8
from harness import hub
from harness.config import ConfigError, RunConfig, content_sha256, settings_hash
from harness.generation import GenRequest, common_prefix
from harness.prompting import PromptTemplate
from harness.results import format_markdown, git_hash, metrics_table, versions
from harness.stats import summarize
from harness.identity import awaits_download, describe_changes, model_identity
from harness.runlog import (ResumeMismatchError, RunDirError, RunLock, SampleLog, check_run_meta, move_aside,
                            write_atomic, write_run_meta)

log = logging.getLogger("harness")

MIN_SHARED_PREFIX = 16  # below this, copying a prefix state costs more than recomputing it


def model_spec(model: str, tokenizer: str | None = None):
    """The registry's spec for a model name, with ``tokenizer`` (a hub id or local folder) overriding the
    checkpoint's own or the registry's tokenizer."""
    from harness.models import resolve_model

    spec = resolve_model(model)
    if tokenizer:
        return dataclasses.replace(spec, tokenizer=str(Path(tokenizer).expanduser().resolve())
                                   if Path(tokenizer).expanduser().is_dir() else tokenizer)
    return spec


def load_backend(model: str, device: str = "auto", dtype: str = "auto", backend: str = "auto",
                 tokenizer: str | None = None, cuda_graphs: bool = False):
    """Resolve a model name through the registry and build its backend (``backend`` overrides the default,
    ``tokenizer`` the checkpoint's own or the registry's tokenizer)."""
    from harness.backends import backend_class
    from harness.backends.hf import TokenizerError

    spec = model_spec(model, tokenizer)
    if not tokenizer and spec.tokenizer and Path(spec.path).is_dir():
        log.info("%s has no tokenizer of its own; using %s's (--tokenizer chooses another)", spec.path, spec.tokenizer)
    name = spec.backend if backend == "auto" else backend
    if spec.backend == "phi-mamba" and name != "phi-mamba":
        raise ValueError(f"{model} is a Phi-Mamba checkpoint; only --backend phi-mamba (or auto) runs it")
    cls = backend_class(name)
    if cuda_graphs and name != "phi-mamba":
        raise ValueError(f"--cuda-graphs applies to the Phi-Mamba backend; {model} runs on the {name} backend")
    extra = {"cuda_graphs": True} if cuda_graphs else {}
    hub.require((spec.path, "model"), (spec.tokenizer, "tokenizer"))
    try:
        return cls(spec.path, tokenizer=spec.tokenizer, device=device, dtype=dtype, **extra)
    except OSError as e:
        tok = spec.tokenizer or spec.path
        hint = (f"\n{spec.path} carries no tokenizer of its own (goombalab's folders do not); its tokenizer is "
                f"{tok}'s. Pass --tokenizer with a local copy of it (a folder holding tokenizer.json), or fill the "
                "HF cache with it.") if Path(spec.path).is_dir() and spec.tokenizer else ""
        raise ModelLoadError(f"could not load model {model!r} (weights {spec.path}, tokenizer {tok}) through the "
                             f"{name} backend: {e}{hint}\nWhere the hub is unreachable, download once with "
                             f"`hf download {spec.path}` elsewhere and copy the HF cache (then HF_HUB_OFFLINE=1 "
                             "skips the network), or pass a local checkpoint directory to --model.") from e
    except (ImportError, TokenizerError):
        raise
    except Exception as e:  # a corrupt config, truncated weights, a tokenizer that does not parse, ...
        files = ", ".join(sorted(p.name for p in Path(spec.path).glob("*") if p.is_file())[:12]) \
            if Path(spec.path).is_dir() else spec.path
        raise ModelLoadError(f"could not load model {model!r} from {spec.path} ({files}) through the {name} backend: "
                             f"{type(e).__name__}: {e}\nCheck that the checkpoint files are complete (re-save or "
                             "re-download them); --verbose shows the full traceback.") from e


def _load_tokenizer(cfg: RunConfig):
    """The tokenizer the model will use, loaded before the model (a task builds its prompts with it)."""
    from harness.backends.hf import load_tokenizer

    spec = model_spec(cfg.model, cfg.tokenizer)
    name = spec.tokenizer or spec.path
    hub.require((name, "tokenizer"))
    try:
        return load_tokenizer(name)
    except OSError as e:
        raise ModelLoadError(f"task {cfg.task!r} needs the model's tokenizer and {name!r} could not be loaded "
                             f"({e}); pass --tokenizer with a local copy") from e


class ModelLoadError(ValueError):
    """A model's files exist but cannot be loaded; the message names the directory and its files."""


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


def plan_batches(lengths: Sequence[int], batch_size: int | str, token_budget: int, max_new: int) -> list[list[int]]:
    """Longest first (an out-of-memory shows at once); ``auto`` fills each batch up to a token budget."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if batch_size != "auto":
        bs = int(batch_size)
        return [order[i:i + bs] for i in range(0, len(order), bs)]
    batches, cur = [], []
    for i in order:
        width = lengths[cur[0]] + max_new if cur else lengths[i] + max_new
        if cur and (len(cur) + 1) * width > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _check_unique(instances: list[Instance], source: str | None) -> None:
    counts = Counter(i.key for i in instances)
    dup = sorted({k.rsplit("@", 1)[0] for k, n in counts.items() if n > 1})
    if dup:
        raise DataError(f"{len(dup)} question id(s) occur more than once in the data {source or ''} ({', '.join(dup[:5])}"
                        f"{', ...' if len(dup) > 5 else ''}); each would be counted twice and resume by id is "
                        "ambiguous. Give every row a unique _id.")


def _backend_settings(resolved: dict, backend) -> dict:
    """The dtype and device type a given backend really runs with override what the flags resolve to."""
    if backend is None:
        return resolved
    d = backend.describe()
    out = dict(resolved)
    if d.get("dtype"):
        out["dtype"] = d["dtype"]
    if d.get("device"):
        out["device_type"] = torch.device(d["device"]).type
    return out


def run_eval(cfg: RunConfig, backend=None, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) one evaluation and write its run directory; returns the results dict.

    Everything that can be checked is checked before anything is written: flags, data, the template on every
    prompt, the run directory's settings, and (for a new run) the model."""
    t0 = time.perf_counter()
    cfg.validate()
    spec_m = model_spec(cfg.model, cfg.tokenizer)  # an unknown name or a missing folder fails here, at once
    absent = hub.missing((spec_m.path, "model"), (spec_m.tokenizer, "tokenizer")) if backend is None else []
    task = get_task(cfg.task, data=cfg.data, split=cfg.split, **cfg.task_args)
    if cfg.retrieval and task.retrieval_template is None and not cfg.template:
        raise ConfigError(f"--retrieval: task {cfg.task!r} has no retrieval prompt; pass --template with one")
    template = PromptTemplate(cfg.template or (task.retrieval_template if cfg.retrieval else task.default_template))
    # Resolved once: the task's complete options, the template, the budget; run.json records this config.
    cfg = dataclasses.replace(cfg, task_args=dataclasses.asdict(task.options), template=cfg.template or template.name,
                              template_sha256=template.sha256,
                              max_new_tokens=cfg.max_new_tokens or task.default_max_new_tokens)
    stop = cfg.stop if cfg.stop is not None else task.stop
    answer_phrase = template.declared("answer_phrase")
    score_kw = {"answer_phrase": answer_phrase} if answer_phrase else {}
    spec = ToolSpec(enabled=cfg.retrieval, max_calls=cfg.max_tool_calls, timeout=cfg.tool_timeout,
                    max_chars=cfg.tool_max_chars)

    why = (f"{spec_m.path} carries no tokenizer of its own (goombalab's folders do not); its tokenizer is "
           f"{spec_m.tokenizer}'s (--tokenizer picks another)." if spec_m.tokenizer and Path(spec_m.path).is_dir()
           else "")
    try:
        all_rows = task.load()
    except DataError as e:  # offline, everything missing is named in one error
        raise (hub.unreachable_error(absent, also=str(e), why=why) if absent else e) from None
    if absent:
        raise hub.unreachable_error(absent, why=why)
    rows = select_rows(all_rows, cfg.ids, cfg.limit)
    if not rows:
        raise DataError(f"the selection is empty: {len(all_rows)} row(s) in the data, none selected by "
                        f"--limit/--ids ({cfg.ids or cfg.limit})")
    if task.needs_tokenizer:  # e.g. contexts measured in the model's tokens
        task.tokenizer = backend.tokenizer if backend is not None else _load_tokenizer(cfg)
    instances = task.instances(rows, seed=cfg.seed, pool_rows=all_rows)
    _check_unique(instances, cfg.data)
    tool_vars = spec.template_vars()
    prompts = {i.key: template.render(**task.template_vars(i), tool=tool_vars) for i in instances}
    empty = [k for k, p in prompts.items() if not p.strip()]
    if empty:
        names = ", ".join(task.template_vars(instances[0]))
        raise ConfigError(f"template {template.path} renders an empty prompt for {len(empty)} instance(s) (e.g. "
                          f"{empty[0]}); check that it writes the task's variables ({names})")
    selects = tuple(f.name for f in dataclasses.fields(task.Options) if f.metadata.get("selects"))
    identity = model_identity(spec_m.path, spec_m.tokenizer)
    dist = distributed_state()
    rank, world = (dist.process_index, dist.num_processes) if dist else (0, 1)
    if awaits_download(spec_m.path, spec_m.tokenizer, identity) and backend is None:
        # a hub model not in the HF cache: loading it downloads it, and then its commit is known
        backend = _load_model(cfg, dist)
        identity = model_identity(spec_m.path, spec_m.tokenizer)
    resolved = _backend_settings(cfg.resolved(content_sha256(all_rows), template.sha256, selects=selects), backend)
    resolved.update(identity)
    config_hash = settings_hash(resolved)
    run = RunContext(cfg=cfg, task=task, rows=rows, instances=instances, prompts=prompts, stop=stop,
                     score_kw=score_kw, tool_spec=spec, resolved=resolved, config_hash=config_hash, dist=dist,
                     rank=rank, world=world, progress=progress, t0=t0, template_variables=template.variables,
                     lock=RunLock(cfg.output) if rank == 0 else None)
    if run.lock is not None:
        run.lock.acquire()
    try:
        if cfg.overwrite and rank == 0:
            move_aside(Path(cfg.output), _run_files(Path(cfg.output)))
        return _run_locked(run, backend)
    finally:
        if run.lock is not None:
            run.lock.release()


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


def _load_model(cfg: RunConfig, dist):
    """The run's backend, on this rank's GPU when launched on several."""
    device = cfg.device
    if dist is not None and device == "auto" and torch.cuda.is_available():
        device = f"cuda:{dist.local_process_index}"
    return load_backend(cfg.model, device, cfg.dtype, cfg.backend, cfg.tokenizer, cfg.cuda_graphs)


@dataclasses.dataclass
class RunContext:
    """Everything one evaluation run has resolved before it writes: passed whole instead of a dozen arguments."""

    cfg: RunConfig
    task: Any
    rows: list
    instances: list[Instance]
    prompts: dict[str, str]
    stop: Any
    score_kw: dict
    tool_spec: ToolSpec
    resolved: dict
    config_hash: str
    dist: Any
    rank: int
    world: int
    progress: bool
    t0: float
    template_variables: set[str]
    lock: RunLock | None


def _run_locked(run: RunContext, backend) -> dict[str, Any]:
    cfg, task, instances, prompts, config_hash = run.cfg, run.task, run.instances, run.prompts, run.config_hash
    dist, rank, world = run.dist, run.rank, run.world
    out = Path(cfg.output)
    has_meta = check_run_meta(out, config_hash, run.resolved)
    samples = SampleLog(out, shard=f"rank{rank}" if world > 1 else None)
    foreign = Counter(str(r.get("config_hash")) for r in samples.records.values()
                      if r.get("config_hash") != config_hash)
    if foreign:
        raise ResumeMismatchError(
            f"{out}/samples.jsonl holds {sum(foreign.values())} row(s) made with other settings or with no settings "
            f"hash (hash {', '.join(foreign)} vs {config_hash} now); they would mix with this run's. Use a new "
            "--output, or --overwrite to start over (the old rows are moved aside, not deleted).")
    by_key = {i.key: i for i in instances}
    stale = [k for k, i in by_key.items() if k in samples and _is_stale(samples.records[k], i, prompts[k])]
    if stale:
        log.warning("%d finished row(s) were made from a prompt or gold answer that differs from what the data "
                    "and template give now (e.g. %s); they are regenerated", len(stale), stale[0])
    stale_set = set(stale)
    if dist:
        dist.wait_for_everyone()  # every rank has read the same "done" set before anyone writes
    todo = [ins for ins in instances if ins.key not in samples or ins.key in stale_set]
    log.info("task %s: %d questions x %d conditions (%s) = %d instances (%d already done in %s)", cfg.task,
             len(run.rows), len({i.condition for i in instances}), task.condition, len(instances),
             len(instances) - len(todo), cfg.output)
    n_todo = len(todo)
    todo = todo[rank::world]  # a fixed split of what is left, so any number of ranks can resume any run
    if world > 1:
        log.info("rank %d of %d: %d instances", rank, world, len(todo))

    t_load = time.perf_counter()
    if backend is None and (todo or not has_meta):
        backend = _load_model(cfg, dist)
        config_hash = _identity_after_loading(run, fresh=not has_meta and not samples.records)
    load_s = time.perf_counter() - t_load
    if backend is not None:
        d = backend.describe()
        log.info("model %s: backend=%s device=%s dtype=%s batch_size=%s", cfg.model, d.get("backend"),
                 d.get("device"), d.get("dtype"), cfg.batch_size)
    if not has_meta and rank == 0:
        write_run_meta(out, config_hash, run.resolved, cfg.to_dict())  # only now: model, data, template, flags work

    gen_s, new_tokens = _generate_all(run, backend, todo, samples)
    samples.close()
    if dist:
        dist.wait_for_everyone()
        if rank != 0:
            return {"rank": rank, "counts": {"generated": len(todo)}}
    run.lock.verify()  # the directory is still the one this run locked: its rows are this run's
    samples.merge([i.key for i in instances], config_hash)
    missing = [i.key for i in instances if i.key not in samples.records]
    if missing:
        raise RunDirError(f"{out}: {len(missing)} instance(s) have no record after the run ({', '.join(missing[:5])}"
                          f"{', ...' if len(missing) > 5 else ''}); rerun the same command to generate them")

    records = [samples.records[i.key] for i in instances]
    conditions = list(dict.fromkeys(i.condition for i in instances))
    by_pos = summarize(records, task.metrics, conditions, seed=cfg.seed)
    results = {
        "task": cfg.task, "task_summary": task.describe(run.template_variables), "condition": task.condition,
        "model": cfg.model,
        "config": cfg.to_dict(), "config_hash": config_hash,
        "resolved": run.resolved, "backend": backend.describe() if backend is not None else None,
        "metrics": by_pos,
        "counts": {"questions": len(run.rows), "instances": len(instances), "generated": n_todo,
                   "resumed": len(instances) - n_todo, "stale_regenerated": len(stale), "ranks": world,
                   "skipped_too_long": sum(m["skipped_too_long"] for m in by_pos.values())},
        "selection": {"ids": list(dict.fromkeys(i.id for i in instances)), "conditions": conditions},
        "timings": {"load_s": round(load_s, 3), "generate_s": round(gen_s, 3),
                    "total_s": round(time.perf_counter() - run.t0, 3), "new_tokens": new_tokens,
                    "tokens_per_s": round(new_tokens / gen_s, 2) if gen_s > 0 else None},
        "seed": cfg.seed, "versions": versions(), "git": git_hash(),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if cfg.audit:
        from harness.audit import audit_rows

        results["audit"] = audit_rows(run, backend if backend is not None else _load_model(cfg, dist), records,
                                      cfg.audit)
    df = metrics_table(by_pos, task.metrics, task.condition)
    results["table"] = format_markdown(df, task.metrics, id_cols=(task.condition,)) + audit_line(results)
    results["files"] = ["results.json", "samples.jsonl", *task.write_outputs(records, out, conditions), "table.md",
                        "table.csv"]
    write_atomic(out / "table.csv", df.to_csv(index=False))
    write_atomic(out / "table.md", results["table"] + "\n")
    run.lock.verify()
    write_atomic(out / "results.json", json.dumps(results, indent=2, default=str))  # last: it marks the run finished
    return results


def audit_line(results: dict) -> str:
    """The audit's verdict under a results table ("" without one)."""
    a = results.get("audit")
    if not a:
        return ""
    ref = a["reference"]
    return (f"\n\naudit: {a['agree']} of {a['rows']} rows generated again alone (batch 1, no prefix reuse, no CUDA "
            f"graphs, {ref['dtype']}) agree" + (f"; first difference: {a['differ'][0]['key']} at generated token "
                                                f"{a['differ'][0]['token']}" if a["differ"] else ""))


def _identity_after_loading(run: RunContext, fresh: bool) -> str:
    """The loaded files hashed again: a hub model can resolve to a newer commit once it is fetched (a new run
    takes the commit it loaded; a resumed one is refused), and a local checkpoint rewritten while it loaded may
    have been read half old, half new (refused). Returns the run's settings hash."""
    spec = model_spec(run.cfg.model, run.cfg.tokenizer)
    now = model_identity(spec.path, spec.tokenizer)
    before = {k: run.resolved.get(k) for k in now}
    if now != before:
        if not fresh or hub.is_local(spec.path) or (spec.tokenizer and hub.is_local(spec.tokenizer)):
            raise ResumeMismatchError(f"{run.cfg.output} holds a run made with other settings: "
                                      f"{describe_changes(before, now)} (the model was fetched or rewritten as it "
                                      "loaded). Use a new --output, or --overwrite to start over.")
        run.resolved.update(now)
        run.config_hash = settings_hash(run.resolved)
    return run.config_hash


def _is_stale(rec: dict, ins: Instance, prompt: str) -> bool:
    """A finished row whose prompt or gold answer is not what this run would use (its prompt hash is checked
    whenever the row carries one)."""
    sha = rec.get("prompt_sha256")
    return (sha is not None and sha != _sha(prompt)[:len(sha)]) or rec.get("gold") != ins.answer


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _generate_all(run: RunContext, backend, todo: list[Instance], samples: SampleLog) -> tuple[float, int]:
    cfg, task, config_hash, stop, score_kw, spec = (run.cfg, run.task, run.config_hash, run.stop, run.score_kw,
                                                    run.tool_spec)
    progress = run.progress and run.rank == 0
    if not todo:
        return 0.0, 0
    prompts_by_key = run.prompts
    prompts = [prompts_by_key[ins.key] for ins in todo]
    prompt_ids = [backend.tokenizer(p)["input_ids"] for p in prompts]
    limit = backend.max_context
    fits, too_long = [], []
    for i, ids in enumerate(prompt_ids):
        (too_long if limit is not None and len(ids) + cfg.max_new_tokens > limit else fits).append(i)
    if too_long:
        log.warning("%d prompt(s) do not fit the model's %d-token context with %d new tokens; they are skipped "
                    "and counted per position (never truncated)", len(too_long), limit, cfg.max_new_tokens)
        samples.write(_record(task, todo[i], prompts[i], len(prompt_ids[i]), None, None, config_hash,
                              skipped="prompt_too_long") for i in too_long)
    shared = common_prefix([prompt_ids[i] for i in fits]) if cfg.prefix_reuse and len(fits) > 1 else []
    if len(shared) < MIN_SHARED_PREFIX:
        shared = []
    log.info("shared prompt prefix: %d tokens%s", len(shared), " (prefilled once, copied into each batch)" if shared else "")
    bs = cfg.batch_size if cfg.batch_size == "auto" else int(cfg.batch_size)
    batches = plan_batches([len(prompt_ids[i]) for i in fits], bs, backend.token_budget(), cfg.max_new_tokens)
    if batches:
        sizes = [len(b) for b in batches]
        log.info("%d batches of %d-%d prompts (batch size %s)", len(batches), min(sizes), max(sizes), cfg.batch_size)
    gen_s, new_tokens = 0.0, 0
    bar = tqdm(total=len(todo), desc=f"{cfg.model} {cfg.task}", unit="sample", disable=not progress)
    bar.update(len(too_long))
    keep_stop = task.include_stop  # e.g. IsTree's verdict token is its stop string
    for batch in batches:
        idx = [fits[j] for j in batch]
        tools = [task.make_tool(todo[i], spec) for i in idx]
        reqs = [GenRequest(prompts[i], cfg.max_new_tokens, stop, tool, prompt_ids=prompt_ids[i])
                for i, tool in zip(idx, tools)]
        t = time.perf_counter()
        outs = backend.generate(reqs, shared_prefix=shared or None)
        gen_s += time.perf_counter() - t
        new_tokens += sum(o.new_tokens for o in outs)
        samples.write(_record(task, todo[i], prompts[i], o.prompt_tokens, o,
                              task.score(todo[i], o.text + (o.stop_string or "" if keep_stop else ""), **score_kw),
                              config_hash, tool=tool, state_bytes=backend.state_bytes(o.prompt_tokens))
                      for i, o, tool in zip(idx, outs, tools))
        bar.update(len(idx))
    bar.close()
    return gen_s, new_tokens


def _record(task, ins: Instance, prompt: str, prompt_tokens: int, out, scored: dict | None, config_hash: str,
            skipped: str | None = None, tool=None, state_bytes: int | None = None) -> dict:
    """One samples.jsonl line; ``state_bytes``: the model state the prompt left (the paper's memory axis)."""
    rec = {"key": ins.key, "id": ins.id, "condition": ins.condition, **task.record_fields(ins),
           "config_hash": config_hash, "prompt_sha256": _sha(prompt), "prompt_tokens": prompt_tokens,
           "state_bytes": state_bytes, "gold": ins.answer, "skipped": skipped, "prompt": prompt}
    if out is not None:
        rec.update(generation=out.text, finish_reason=out.finish_reason, new_tokens=out.new_tokens,
                   prediction=scored["prediction"], answer_found=scored["answer_found"],
                   scores={k: v for k, v in scored.items() if k not in ("prediction", "answer_found")})
        if tool is not None:
            rec["tool_calls"] = tool.log
            rec["tool_tokens"] = out.tool_tokens
    return rec
