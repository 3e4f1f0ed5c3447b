"""``python -m harness.eval``: evaluate a model on a task, sweeping gold-paragraph positions in one run.

Example:
    python -m harness.eval --model phi-1.5 --task hotpotqa --distractors 10 --positions first,middle,last
"""
from __future__ import annotations

import argparse
import logging
import sys

from harness.config import ConfigError, RunConfig


def build_parser() -> argparse.ArgumentParser:
    from harness.models import REGISTRY

    ap = argparse.ArgumentParser(prog="python -m harness.eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help=f"registered name ({', '.join(REGISTRY)}), a hub id (org/name) or a local checkpoint dir")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer: a hub id or local folder (default: the checkpoint's own; microsoft/phi-1_5's "
                         "for goombalab-format folders, which carry none)")
    ap.add_argument("--backend", default="auto", choices=["auto", "transformers", "phi-mamba", "vllm"],
                    help="model backend (default: the registry's choice; vllm is an optional GPU extra)")
    ap.add_argument("--task", default="hotpotqa",
                    help="hotpotqa (default), istree, or a retrieval task: index, ar, cgram, counting")
    ap.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="task option (repeatable), e.g. --task-arg nodes=16 --task-arg setup=retrieval for istree; "
                         "for a checkpoint trained by harness.train they default to its training task")
    ap.add_argument("--data", default=None,
                    help="HotpotQA JSON/JSONL in the official schema, 'fixture' (bundled invented data) or "
                         "'hub' (datasets hotpot_qa/distractor; the default)")
    ap.add_argument("--split", default="validation", help="split when loading from the hub (default: validation)")
    ap.add_argument("--distractors", type=int, default=8,
                    help="distractor paragraphs per test context; >8 draws extra ones (seeded) from other "
                         "questions; 0 = oracle mode, gold paragraphs only (default: 8)")
    ap.add_argument("--positions", default=None,
                    help="where the two gold paragraphs go: first, middle, last, random, an index (0 = first), "
                         "or a comma list swept in one run (default: first,middle,last; not with --distractors 0)")
    ap.add_argument("--shots", type=int, default=4, help="few-shot exemplars shown (default: 4)")
    ap.add_argument("--template", default=None,
                    help="prompt template: a name in prompts/ or a path to a .j2 file (default: the task's)")
    ap.add_argument("--limit", type=int, default=None, help="evaluate only the first N questions")
    ap.add_argument("--ids", default=None, help="file of question ids (one per line, or a JSON list) to evaluate")
    ap.add_argument("--batch-size", default="auto",
                    help="prompts per batch, or 'auto' to fill batches up to a token budget (default: auto)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="generation budget (default: the task's)")
    ap.add_argument("--stop", action="append", default=None,
                    help="stop string (repeatable; default: the task's stop strings)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)")
    ap.add_argument("--seed", type=int, default=1234, help="seeds distractor drawing and random positions")
    ap.add_argument("--output", default=None,
                    help="run directory; rerunning with the same one resumes (default: runs/MODEL-TASK-kK)")
    ap.add_argument("--retrieval", action="store_true",
                    help="let the model call the in-context regex search tool (<search>PATTERN</search>)")
    ap.add_argument("--max-tool-calls", type=int, default=4, help="tool calls allowed per sample, >= 1 (default: 4)")
    ap.add_argument("--tool-timeout", type=float, default=1.0,
                    help="seconds before a regex search is stopped, > 0 (default: 1.0)")
    ap.add_argument("--tool-max-chars", type=int, default=300, help="cap on one tool result's length (default: 300)")
    ap.add_argument("--no-prefix-reuse", action="store_true",
                    help="recompute the shared few-shot prefix for every batch (outputs are identical either way)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return ap


def config_from_args(a: argparse.Namespace) -> RunConfig:
    from evals.hotpotqa import parse_positions

    if a.distractors == 0 and a.positions is not None:
        raise ConfigError(f"--positions {a.positions} has no effect with --distractors 0 (oracle mode: the gold "
                          "paragraphs alone, position 'oracle'); drop --positions or use --distractors 1 or more")
    task_args = _task_args(a.task_arg, a.model, a.task)
    from pathlib import Path

    local = Path(a.model).expanduser()
    safe = local.resolve().name if local.is_dir() else a.model.rstrip("/").replace("/", "_")
    output = a.output or f"runs/{safe}-{a.task}-k{a.distractors}{'-retrieval' if a.retrieval else ''}"
    return RunConfig(model=a.model, tokenizer=a.tokenizer, backend=a.backend, task=a.task, task_args=task_args, data=a.data, split=a.split, distractors=a.distractors,
                     positions=parse_positions(a.positions or "first,middle,last"), shots=a.shots, template=a.template, limit=a.limit,
                     ids=a.ids, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens, device=a.device,
                     dtype=a.dtype, seed=a.seed, output=output, stop=a.stop, retrieval=a.retrieval,
                     max_tool_calls=a.max_tool_calls, tool_timeout=a.tool_timeout, tool_max_chars=a.tool_max_chars,
                     prefix_reuse=not a.no_prefix_reuse)


def _task_args(pairs: list[str], model: str, task: str) -> dict:
    """KEY=VALUE pairs; a checkpoint written by harness.train supplies its own task's options as defaults."""
    import json
    from pathlib import Path

    out: dict = {}
    meta = Path(model) / "icr_task.json"
    if meta.is_file():
        saved = json.loads(meta.read_text())
        if saved.get("task") == task:
            out.update(saved.get("args", {}))
    known = task_options(task)
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--task-arg expects KEY=VALUE, got {pair!r}")
        k, v = pair.split("=", 1)
        if known is not None and k not in known:
            raise ConfigError(f"--task-arg {pair!r}: task {task!r} has no option {k!r}; its options: "
                              f"{', '.join(sorted(known)) or 'none'}")
        out[k] = int(v) if v.isdigit() else v
    return out


def task_options(task: str) -> set[str] | None:
    """The keyword options a task's constructor takes (data and split have flags of their own)."""
    import inspect

    from evals.registry import _tasks

    cls = _tasks().get(task)
    if cls is None:
        return None
    params = inspect.signature(cls).parameters.values()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"data", "split"}


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from harness.engine import run_eval
    from harness.runlog import RunDirError

    try:
        cfg = config_from_args(a)
        results = run_eval(cfg, progress=not a.no_progress)
    except (ValueError, KeyError, OSError, RunDirError) as e:  # DataError, ConfigError, TemplateError, ...
        if a.verbose:
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2
    if results.get("rank", 0) != 0:
        return 0  # rank 0 merges and reports
    print(f"\n{cfg.model} on {cfg.task}, {cfg.distractors} distractors, {cfg.shots}-shot "
          f"({results['counts']['instances']} instances, {results['counts']['resumed']} resumed)\n")
    print(results["table"])
    print(f"\nwrote {cfg.output}/{', '.join(results['files'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
