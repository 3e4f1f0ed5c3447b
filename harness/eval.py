"""``python -m harness.eval``: evaluate a model on a task, sweeping the task's conditions in one run.

Example:
    python -m harness.eval --model phi-1.5 --task hotpotqa --distractors 10 --positions first,middle,last
    python -m harness.eval --model state-spaces/mamba-130m-hf --task mqar --task-arg pairs=64
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from evals import task_class, task_names
from evals.base import options_help
from evals.sweep import checked_options
from harness.engine.config import ConfigError, RunConfig, task_arg_pairs, word_negative_flags
from harness.engine.runlog import RunDirError, SampleLog
from harness.procs import stop_on_sigterm


@dataclasses.dataclass
class CliFlags:
    """Flags of the command line only: they change what is printed, never a result."""

    task_arg: list[str] = dataclasses.field(default_factory=list, metadata={
        "help": "the task's options as KEY=VALUE (repeatable); for a checkpoint trained by harness.train they "
                "default to its training task's", "action": "extend", "metavar": "KEY=VALUE"})
    progress: bool = dataclasses.field(default=True, metadata={"help": "show a progress bar"})
    verbose: bool = dataclasses.field(default=False, metadata={"help": "debug logging, full tracebacks",
                                                               "aliases": ["-v"]})


def task_flags() -> dict[str, list]:
    """Task options with a flag of their own (``metadata={"flag": True}``): the option's name → its fields, one
    per task that declares it."""
    flags: dict[str, list] = {}
    for name in task_names():
        for f in dataclasses.fields(task_class(name).Options):
            if f.metadata.get("flag"):
                flags.setdefault(f.name, []).append((name, f))
    return flags


def build_parser() -> argparse.ArgumentParser:
    from transformers import HfArgumentParser

    names = task_names()
    tasks_help = "\n".join(f"  {n:10s} {options_help(task_class(n).Options) or 'no options'}" for n in names)
    ap = HfArgumentParser((RunConfig, CliFlags), prog="python -m harness.eval",
                          description=__doc__ + "\ntasks and their --task-arg options:\n" + tasks_help,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    for action in ap._actions:  # noqa: SLF001  (argparse has no public way to edit an added flag)
        if action.dest == "task":  # the task choices come from the registry
            action.choices = names
        elif action.dest in SET_BY_HARNESS:  # fields of the recorded config, never flags
            action.type = _refuse(action.dest)
    word_negative_flags(ap)
    ap.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_const", const="none",
                    help="the same as --prefix-reuse none: every prompt prefilled whole")
    group = ap.add_argument_group("task options with flags of their own (also --task-arg KEY=VALUE)")
    for name, declared in task_flags().items():
        tasks, f = [t for t, _ in declared], declared[0][1]
        group.add_argument(f"--{name}", default=None, type=int if f.type in (int, "int") else str,
                           help=f"{'/'.join(tasks)}: {f.metadata.get('help', '')}")
    return ap


# RunConfig fields that HfArgumentParser turns into flags but that are filled in by the harness itself.
SET_BY_HARNESS = {"task_args": "the task's options are given with --task-arg KEY=VALUE",
                  "template_sha256": "the template's hash is computed by the engine"}


def _refuse(dest: str):
    def parse(_value):
        raise argparse.ArgumentTypeError(f"not a flag: {SET_BY_HARNESS[dest]}")
    return parse


def config_from_args(a: argparse.Namespace) -> RunConfig:
    """The RunConfig of a parsed command line: task options checked against the task's Options."""
    cls = task_class(a.task)
    pairs = _task_args(a.task_arg, a.model, a.task)
    for name, declared in task_flags().items():
        value = getattr(a, name)
        if value is None:
            continue
        if a.task not in [t for t, _ in declared]:
            raise ConfigError(f"--{name} is an option of {', '.join(t for t, _ in declared)}, not of task {a.task!r}; "
                              "its options go in --task-arg KEY=VALUE (see --help)")
        if name in pairs and str(pairs[name]) != str(value):
            raise ConfigError(f"--{name} {value} and --task-arg {name}={pairs[name]} disagree; give one")
        pairs[name] = value
    try:
        cls.check_given(pairs)
        options = checked_options(cls.Options, pairs, a.task)  # a swept option stays a list of checked values
    except ValueError as e:
        raise ConfigError(str(e)) from None
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    values = {k: v for k, v in vars(a).items() if k in fields}
    values["task_args"] = options
    if not values.get("output"):
        local = Path(a.model).expanduser()
        safe = local.resolve().name if local.is_dir() else a.model.rstrip("/").replace("/", "_")
        values["output"] = f"runs/{safe}-{a.task}{cls.output_tag(options)}{'-retrieval' if a.retrieval else ''}"
    return RunConfig(**values)


def _task_args(pairs: list[str], model: str, task: str) -> dict:
    """KEY=VALUE pairs; a checkpoint written by harness.train supplies its own task's options as defaults."""
    out: dict = {}
    meta = Path(model) / "icr_task.json"
    if meta.is_file():
        saved = json.loads(meta.read_text())
        if saved.get("task") == task:
            out.update(saved.get("args", {}))
    out.update(task_arg_pairs(pairs))
    return out


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    cfg = None
    try:
        with stop_on_sigterm():
            cfg = config_from_args(a)
            from harness.engine.run import (
                run_eval,  # lazy: start-up time (--help and flag errors load no model code)
            )

            results = run_eval(cfg, progress=a.progress)
    except (ValueError, KeyError, OSError, RunDirError) as e:  # DataError, ConfigError, TemplateError, ...
        if a.verbose:
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: {_kept(cfg)}", file=sys.stderr)
        return 130
    if results.get("rank", 0) != 0:
        return 0  # rank 0 merges and reports
    print(f"\n{cfg.model} on {cfg.task}, {results['task_summary']} ({results['counts']['instances']} instances, "
          f"{results['counts']['resumed']} resumed)\n")
    print(results["table"])
    print(f"\nwrote {results['config']['output']}/{', '.join(results['files'])}")
    return 0


def _kept(cfg) -> str:
    """What an interrupted run leaves, in one line."""
    if cfg is None or not Path(cfg.output).is_dir():
        return "nothing was written"
    n = len(SampleLog(cfg.output, read_only=True).records)
    return (f"{n} finished row(s) are kept in {cfg.output}; rerun the same command to resume (finished rows are "
            "not generated again)")


if __name__ == "__main__":
    sys.exit(main())
