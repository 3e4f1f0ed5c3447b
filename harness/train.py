"""``python -m harness.train``: train the small IsTree models and evaluate them with the eval engine.

    python -m harness.train --task istree --arch mamba --size 0.5M --nodes 16 --setup retrieval --output runs/x
    python -m harness.train --grid smoke                       # CPU demo: 3 archs x 3 setups at n=4, ~6 min
    python -m harness.train --grid paper --plan                # the 81-run grid's GPU-hours, from measured steps
    python -m harness.train --grid paper --launcher slurm      # one SLURM job per cell (submitit), one report
    accelerate launch -m harness.train --grid paper            # the 81-run grid, data parallel over GPUs

The settings are ``harness.training.config.TrainConfig``; the loop is ``harness.training.trainer``; grids are
``harness.training.grid``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from evals import task_class, task_names
from evals.synthetic import SyntheticTask
from harness.engine.config import ConfigError, _f, task_arg_pairs, word_negative_flags
from harness.ops.selective_scan import SCANNED_ARCHS, scan_choice_problem, scan_override
from harness.procs import stop_on_sigterm
from harness.training.config import LAUNCHERS, USER_ERRORS, TrainConfig


def trainable_tasks() -> list[str]:
    """Every registered task that writes token streams for the small models (``evals.synthetic``)."""
    return [n for n in task_names() if issubclass(task_class(n), SyntheticTask)]


@dataclasses.dataclass
class TrainCliFlags:
    """Flags of the command line only: which runs to start and what to print, never a run's result."""

    grid: str | None = _f(None, "run a whole grid under --output, finished cells skipped: paper = 81 runs, smoke = "
                                "9 small CPU runs at n=4 (about 6 minutes on 2 cores)",
                          choices=["paper", "smoke"])
    jobs: int | None = _f(None, "grid cells trained at once, each in its own process with its share of the CPU "
                                "threads (default: one per CPU core without a GPU, 1 with one)")
    cells_per_gpu: int = _f(1, "grid cells trained at once on each GPU (a 0.5M model leaves most of one idle; "
                               "benchmarks/train_throughput.py measures what k cells side by side reach)")
    launcher: str = _f("processes", "where a grid's cells run: processes on this machine, slurm (one job per cell "
                                    "through submitit, requeued on preemption), or submitit-local (submitit's "
                                    "local executor)", choices=list(LAUNCHERS))
    slurm_partition: str | None = _f(None, "SLURM partition for --launcher slurm (default: the cluster's)")
    timeout_min: int = _f(72 * 60, "a scheduler job's time limit in minutes; a cell stopped by it is requeued and "
                                   "resumes from its last evaluation")
    plan: bool = _f(False, "measure a few steps of every grid cell and print the grid's estimated hours; train "
                           "nothing")
    task_arg: list[str] = dataclasses.field(default_factory=list, metadata={
        "help": "the task's own options as KEY=VALUE (repeatable), e.g. --task-arg symbols=8 (see python -m "
                "harness.eval --help for each task's)", "action": "extend", "metavar": "KEY=VALUE"})
    overwrite: bool = _f(False, "start over in --output even if it holds a run (finished, killed, or of other "
                                "settings): its files are moved to OUTPUT/replaced-TIMESTAMP/, never deleted")
    progress: bool = _f(True, "show progress bars")


def build_parser():
    from transformers import HfArgumentParser

    ap = HfArgumentParser((TrainConfig, TrainCliFlags), prog="python -m harness.train", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    for action in ap._actions:  # the task choices come from the registry  # noqa: SLF001
        if action.dest == "task":
            action.choices = trainable_tasks()
    return word_negative_flags(ap)


GRID_ONLY = ("jobs", "cells_per_gpu", "launcher", "slurm_partition", "timeout_min")  # TrainCliFlags for --grid


def launch_checks(flags: TrainCliFlags, cfg: TrainConfig | None = None) -> None:
    """What can be known before anything is created: grid options given to one run, a scheduler that is not
    here, CUDA graphs asked for where no CUDA device trains (every cell of a grid would fail alike)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainCliFlags)}
    given = [f"--{k.replace('_', '-')}" for k in GRID_ONLY if getattr(flags, k) != defaults[k]]
    if given and not flags.grid:
        raise ConfigError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to grids only (--grid paper "
                          "or --grid smoke); a single run takes none of them")
    if flags.grid and flags.launcher != "processes" and not flags.plan:
        if importlib.util.find_spec("submitit") is None:
            raise ConfigError(f"--launcher {flags.launcher} needs submitit: pip install 'icr-harness[cluster]'")
        if flags.launcher == "slurm" and not (shutil.which("sbatch") and shutil.which("srun")):
            raise ConfigError("--launcher slurm: SLURM is not here (no sbatch or srun on PATH); run on a SLURM "
                              "login node, or use --launcher processes (this machine) or submitit-local")
    if cfg is not None and cfg.cuda_graphs == "on" and not flags.plan and flags.launcher != "slurm":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--cuda-graphs on replays training steps on a CUDA device, and this machine has none "
                              f"(torch {torch.__version__}); use --cuda-graphs off")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("--cuda-graphs on replays steps in one process; under accelerate launch (data "
                              "parallel) use --cuda-graphs off")


def main(argv=None) -> int:
    parser = build_parser()
    cfg, flags, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if unknown:  # argparse's own usage line and message, naming the flag (HfArgumentParser would raise)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        cfg = dataclasses.replace(cfg, task_args=task_arg_pairs(flags.task_arg))
        launch_checks(flags, cfg)
        if flags.grid or cfg.arch in SCANNED_ARCHS:  # a grid's cells are resolved later: asked here
            problem = scan_choice_problem(scan_override(cfg.scan))
            if problem:
                raise ConfigError(problem)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = Path(cfg.output or f"runs/grid-{flags.grid}") if flags.grid else None
    from harness.training import (
        grid as grids,  # lazy: start-up time (--help and flag errors load no model code)
    )
    from harness.training.trainer import train_one  # lazy: start-up time, as above

    try:
        with stop_on_sigterm():
            if flags.grid:
                if flags.plan:
                    print(grids.plan_grid(flags.grid, cfg, root, jobs=flags.jobs, cells_per_gpu=flags.cells_per_gpu))
                    return 0
                t0 = time.perf_counter()
                grids.run_grid(flags.grid, cfg, root, jobs=flags.jobs, progress=flags.progress,
                               overwrite=flags.overwrite, launcher=flags.launcher, cells_per_gpu=flags.cells_per_gpu,
                               partition=flags.slurm_partition, timeout_min=flags.timeout_min)
                table = grids.write_grid_report(root)
                print(f"\nIsTree grid '{flags.grid}' ({time.perf_counter() - t0:.0f} s)\n\n{table}\n\nwrote "
                      f"{root}/results.md, results.csv, istree_grid.png")
                return 0
            if flags.plan:
                raise ConfigError("--plan estimates a grid: give --grid paper or --grid smoke")
            cfg = cfg.resolved()
            res = train_one(cfg, flags.progress, overwrite=flags.overwrite)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if flags.plan:
            print("\ninterrupted: the projection was stopped; it trains nothing and wrote nothing", file=sys.stderr)
            return 130
        where = root or cfg.output
        print(f"\ninterrupted: what finished is kept in {where} (finished runs whole, a run in progress up to its "
              "last evaluation); rerun the same command to continue from there", file=sys.stderr)
        return 130
    if res:
        live = (f"live greedy accuracy {100 * res['accuracy']:.1f}% ± {100 * res['accuracy_se']:.1f}; "
                if "accuracy" in res else "")
        print(f"\n{cfg.name}: teacher-forced EM {100 * res['teacher_forced_em']:.1f}% ({res['reported']}); "
              f"{live}{res['trainable_parameters']:,} trainable parameters; loss {res['first_loss']:.3f} -> "
              f"{res['final_loss']:.3f}; wrote {cfg.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
