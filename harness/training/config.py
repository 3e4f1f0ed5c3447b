"""One training run's settings (``TrainConfig``): the trainer's flags are built from its fields, and the resolved
config is written into result.json."""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field

from evals import istree, task_class
from evals.base import OptionError, make_options
from harness.engine.config import ConfigError, _f
from harness.engine.runlog import RunDirError
from harness.ops.selective_scan import SCAN_HELP, SCANNED_ARCHS, SCANS, scan_choice_problem, scan_override
from harness.training.state import TrainingError

DEFAULT_LR = {"transformer": 1e-3, "mamba": 3e-4, "hybrid": 3e-4}
# The paper's settings: what a flag left out means outside a grid.
PAPER_DEFAULTS = {"samples": 5_000_000, "batch_size": 64, "warmup": 10_000, "eval_every": 100_000,
                  "eval_samples": 5000, "eval_batch_size": 256}
TRACKERS = ("auto", "tensorboard", "wandb", "none")
# What a training run reports as one ``error:`` line (a bad flag, a directory in use, a diverged loss, a full disk).
USER_ERRORS = (ConfigError, ValueError, OSError, RunDirError, TrainingError)
# Settings that decide a finished run's numbers: a run directory is reused only with the same values.
RESULT_DECIDING = ("task", "task_args", "length", "arch", "size", "d_model", "layers", "nodes", "setup", "graph", "samples",
                   "batch_size", "lr", "warmup", "seed", "eval_every", "eval_samples", "eval_max_new_tokens",
                   "precision", "bucket", "checkpoint", "store", "scan", "cuda_graphs", "packing")
# Result-deciding settings added after runs were made: a run directory that predates one ran with this value.
ADDED_SETTINGS = {"scan": "auto", "cuda_graphs": "off", "packing": "off"}
CHECKPOINTS = ("last", "best")


def graphs_setting(cfg: "TrainConfig", device_type: str, processes: int) -> str:
    """``--cuda-graphs`` as it applies to this run, for its identity: ``auto`` where graphs cannot run (not CUDA,
    several processes) is ``off``, as runs made before ``auto`` existed recorded it."""
    if cfg.cuda_graphs == "auto" and (device_type != "cuda" or processes > 1):
        return "off"
    return cfg.cuda_graphs

# How a grid's cells are run: processes on this machine, or submitit jobs (its local executor, or SLURM).
LAUNCHERS = ("processes", "submitit-local", "slurm")


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of one training run, defined once: the parser is built from these fields and the
    resolved config is written into result.json. ``None`` means the paper's value (or the grid's)."""

    task: str = _f("istree", "IsTree, or any registered task with a token stream (trained on its answers)")
    task_args: dict = field(default_factory=dict, metadata={"help": argparse.SUPPRESS})  # --task-arg KEY=VALUE
    length: int = _f(32, "size of a non-IsTree task: sequence length, key-value pairs (mqar), entries (needle)")
    arch: str = _f("transformer", "architecture", choices=["transformer", "mamba", "hybrid"])
    size: str = _f("0.5M", "parameter budget; architectures are matched within 10%% (smoke: a CPU demo size)",
                   choices=["0.5M", "1M", "2M", "smoke"])
    d_model: int | None = _f(None, "model width, overriding the size table")
    layers: int | None = _f(None, "layers, overriding the size table (the hybrid: its Mamba layers)")
    nodes: int = _f(16, "IsTree graph size n (paper: 16, 32, 64)")
    setup: str = _f("cot", "IsTree setup", choices=list(istree.SETUPS))
    graph: str = _f("binary", "IsTree graphs: binary (the paper's) or recursive (random recursive trees, half "
                              "with one edge moved to close a cycle)", choices=list(istree.GRAPHS))
    samples: int | None = _f(None, "training samples (default 5,000,000)")
    batch_size: int | None = _f(None, "global batch, split over the processes (default 64)")
    lr: float | None = _f(None, "peak lr (default 1e-3 Transformer, 3e-4 Mamba and hybrid)")
    warmup: int | None = _f(None, "warm-up samples (default 10,000)")
    seed: int = _f(42, "seeds the initialisation and the training streams")
    eval_every: int | None = _f(None, "samples between teacher-forced evaluations (default 100,000)")
    eval_samples: int | None = _f(None, "held-out samples of the reported test split, and of the validation split "
                                        "with --checkpoint best (default 5,000)")
    eval_batch_size: int | None = _f(None, "batch of the evaluations (default 256)")
    eval_max_new_tokens: int | None = _f(None, "live evaluation's generation budget (default: the task's)")
    checkpoint: str = _f("last", "the checkpoint kept and reported: last (the paper: the final weights, whose last "
                                 "validation is the number) or best (chosen by teacher-forced EM on a validation "
                                 "split, reported on the disjoint test split)", choices=list(CHECKPOINTS))
    live_eval: bool = _f(True, "after training, evaluate the kept checkpoint by greedy generation (the tool live "
                               "for retrieval)")
    precision: str = _f("auto", "auto (bf16 autocast on CUDA, float32 elsewhere), fp32 or bf16",
                        choices=["auto", "fp32", "bf16"])
    scan: str = _f("auto", SCAN_HELP + "; the environment's ICR_SCAN overrides it, with a log line",
                   choices=list(SCANS))
    cuda_graphs: str = _f("auto", "replay each training step (forward, loss, backward, AdamW) from a CUDA graph per "
                                  "batch shape (the small models' steps are bound by kernel launches). auto "
                                  "(default): in one process on CUDA, where 8 graphed steps of the run's cell equal "
                                  "eager ones at the run's start and are faster, else eagerly with the reason logged and in "
                                  "result.json (off elsewhere); on: without that check; off. A step that cannot be "
                                  "captured trains eagerly, logged", choices=["auto", "on", "off"])
    packing: str = _f("auto", "packed rows: a batch's samples laid end to end (the scan and convolution restart at "
                              "each sample, attention confined to it, positions restarting), so no padding is "
                              "computed; the same samples, loss and normalisation as padded rows. auto (default): "
                              "on a CPU, on where a cell's batches compute at least 10%% fewer tokens packed (there "
                              "a batch's samples go into one row), off on a GPU (slower there); on; off",
                      choices=["auto", "on", "off"])
    workers: int | None = _f(None, "data-generation worker processes (default: 4 on CUDA, 0 on CPU)")
    bucket: int = _f(1, "length bucketing: draw this many batches, sort by length, train on them in random order "
                        "(less padding; 1 = off, as the paper)")
    store: int | None = _f(None, "train on a fixed set of this many samples, generated once into a memory-mapped "
                                 "token store shared by every run with the same data and visited in a seeded "
                                 "order each epoch (the paper's code reuses 1,000,000); default: a fresh sample "
                                 "every step")
    store_dir: str | None = _f(None, "where token stores are kept (default: ~/.cache/icr-harness/stores, or "
                                     "$ICR_CACHE/stores)")
    threads: int | None = _f(None, "CPU threads for torch (default: torch's)")
    report_to: str = _f("auto", "experiment tracker through accelerate (auto: TensorBoard when installed)",
                        choices=list(TRACKERS))
    output: str | None = _f(None, "run directory (default runs/NAME; a grid's root with --grid)")

    @property
    def name(self) -> str:
        shape = "".join([f"-d{self.d_model}" if self.d_model else "", f"-L{self.layers}" if self.layers else ""])
        options = "".join(f"-{k}{v}" for k, v in sorted(self.task_args.items()))
        return f"{self.arch}-{self.size}{shape}-{task_class(self.task).training_tag(self)}{options}"

    def resolved(self, defaults: dict | None = None) -> "TrainConfig":
        """Every ``None`` filled from ``defaults`` (a grid's) and then the paper's; checked."""
        fill = {**PAPER_DEFAULTS, **(defaults or {})}
        values = {k: (fill[k] if getattr(self, k) is None and k in fill else getattr(self, k))
                  for k in (f.name for f in dataclasses.fields(self))}
        if values["lr"] is None:
            values["lr"] = fill.get("lr") or DEFAULT_LR[self.arch]
        values["task_args"] = self._typed_task_args()
        # the scan only where the model has one: a Transformer run's identity never holds a scan (an exported
        # ICR_SCAN would otherwise make it another run, unresumable)
        values["scan"] = scan_override(values["scan"]) if self.arch in SCANNED_ARCHS else "auto"
        cfg = TrainConfig(**values)
        cfg = dataclasses.replace(cfg, output=cfg.output or f"runs/{cfg.name}")
        cfg.validate()
        return cfg

    def _typed_task_args(self) -> dict:
        """``task_args`` as the task's option types (``"8"`` from the command line and ``8`` are one setting)."""
        cls = task_class(self.task)
        try:
            options = make_options(cls.Options, {**cls.training_options(self), **self.task_args}, self.task)
        except OptionError as e:
            raise ConfigError(str(e)) from None
        return {k: getattr(options, k) for k in self.task_args}

    def validate(self) -> None:
        """Every flag checked before anything is written; the first bad one is a ConfigError naming it."""
        def bad(flag, value, need):
            raise ConfigError(f"{flag} {value!r}: {need}")

        def flag(name):
            return f"--{name.replace('_', '-')}"

        for name in ("samples", "batch_size", "eval_every", "eval_samples", "eval_batch_size", "bucket", "length", "store",
                     "d_model", "layers", "threads", "eval_max_new_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                bad(flag(name), value, "use a positive whole number")
        if self.warmup is not None and (not isinstance(self.warmup, int) or self.warmup < 0):
            bad("--warmup", self.warmup, "use 0 or more samples")
        if self.lr is not None and not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            bad("--lr", self.lr, "use a positive, finite learning rate, e.g. 3e-4")
        if self.samples is not None and self.batch_size is not None and self.samples < self.batch_size:
            bad("--samples", self.samples, f"train on at least one batch ({self.batch_size} samples)")
        if self.nodes < 4:
            bad("--nodes", self.nodes, "IsTree graphs need at least 4 nodes")
        if self.workers is not None and self.workers < 0:
            bad("--workers", self.workers, "use 0 (generate in the training process) or more")
        if self.seed < 0:
            bad("--seed", self.seed, "use 0 or more")
        problem = scan_choice_problem(self.scan)
        if problem:
            raise ConfigError(problem)


