"""``python -m harness.train``: train the small IsTree models and evaluate them with the eval engine.

    python -m harness.train --task istree --arch mamba --size 0.5M --nodes 16 --setup retrieval --output runs/x
    python -m harness.train --grid smoke                       # CPU demo: 3 archs x 3 setups at n=4, ~6 min
    python -m harness.train --grid paper --plan                # the 81-run grid's GPU-hours, from measured steps
    accelerate launch -m harness.train --grid paper            # the 81-run grid, data parallel over GPUs

Defaults follow the paper's code: AdamW (weight decay 0), cosine schedule with a 10,000-sample warm-up, a
global batch of 64 (split over processes), lr 1e-3 for the Transformer and 3e-4 for Mamba and the hybrid,
fresh samples every step, mamba-ssm's initialisation. Every ``--eval-every`` samples the model is scored by
the paper's metric, teacher-forced exact match on held-out samples (every target token right, tool results
given); the best checkpoint is kept, written with ``save_pretrained`` next to its tokenizer and task, and
evaluated once more by live greedy generation through the eval engine (the retrieval tool live), so
``python -m harness.eval --model RUN_DIR --task istree`` reproduces that number.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from evals import istree
from harness.config import ConfigError, _f

log = logging.getLogger("harness")

DEFAULT_LR = {"transformer": 1e-3, "mamba": 3e-4, "hybrid": 3e-4}
# The paper's settings: what a flag left out means outside a grid.
PAPER_DEFAULTS = {"samples": 5_000_000, "batch_size": 64, "warmup": 10_000, "eval_every": 100_000,
                  "eval_samples": 5000, "eval_batch_size": 256}
TRACKERS = ("auto", "tensorboard", "wandb", "none")
# Settings that decide a finished run's numbers: a run directory is reused only with the same values.
RESULT_DECIDING = ("task", "length", "arch", "size", "d_model", "layers", "nodes", "setup", "graph", "samples",
                   "batch_size", "lr", "warmup", "seed", "eval_every", "eval_samples", "eval_max_new_tokens",
                   "precision", "bucket")


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of one training run, defined once: the parser is built from these fields and the
    resolved config is written into result.json. ``None`` means the paper's value (or the grid's)."""

    task: str = _f("istree", "IsTree, or any registered task with a token stream (trained on its answers)")
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
    eval_samples: int | None = _f(None, "held-out samples for both evaluations (default 5,000)")
    eval_batch_size: int | None = _f(None, "batch of the evaluations (default 256)")
    eval_max_new_tokens: int | None = _f(None, "live evaluation's generation budget (default: the task's)")
    live_eval: bool = _f(True, "after training, evaluate the best checkpoint by greedy generation (the tool live "
                               "for retrieval)")
    precision: str = _f("auto", "auto (bf16 autocast on CUDA, float32 elsewhere), fp32 or bf16",
                        choices=["auto", "fp32", "bf16"])
    workers: int | None = _f(None, "data-generation worker processes (default: 4 on CUDA, 0 on CPU)")
    bucket: int = _f(1, "length bucketing: draw this many batches, sort by length, train on them in random order "
                        "(less padding; 1 = off, as the paper)")
    threads: int | None = _f(None, "CPU threads for torch (default: torch's)")
    allow_slow_scan: bool = _f(False, "train Mamba or the hybrid on CUDA without mamba-ssm/causal-conv1d kernels "
                                      "(a Python-loop scan, tens of times slower)")
    report_to: str = _f("auto", "experiment tracker through accelerate (auto: TensorBoard when installed)",
                        choices=list(TRACKERS))
    output: str | None = _f(None, "run directory (default runs/NAME; a grid's root with --grid)")

    @property
    def name(self) -> str:
        shape = "".join([f"-d{self.d_model}" if self.d_model else "", f"-L{self.layers}" if self.layers else ""])
        if self.task == "istree":
            graph = "" if self.graph == "binary" else f"-{self.graph}"
            return f"{self.arch}-{self.size}{shape}-n{self.nodes}{graph}-{self.setup}"
        return f"{self.arch}-{self.size}{shape}-{self.task}-L{self.length}"

    def resolved(self, defaults: dict | None = None) -> "TrainConfig":
        """Every ``None`` filled from ``defaults`` (a grid's) and then the paper's; checked."""
        fill = {**PAPER_DEFAULTS, **(defaults or {})}
        values = {k: (fill[k] if getattr(self, k) is None and k in fill else getattr(self, k))
                  for k in (f.name for f in dataclasses.fields(self))}
        values["lr"] = values["lr"] or fill.get("lr") or DEFAULT_LR[self.arch]
        cfg = TrainConfig(**values)
        cfg = dataclasses.replace(cfg, output=cfg.output or f"runs/{cfg.name}")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(flag, value, need):
            raise ConfigError(f"{flag} {value!r}: {need}")

        for flag in ("samples", "batch_size", "eval_every", "eval_samples", "eval_batch_size", "bucket"):
            value = getattr(self, flag)
            if value is not None and value < 1:
                bad(f"--{flag.replace('_', '-')}", value, "use a positive number")
        if self.samples < self.batch_size:
            bad("--samples", self.samples, f"train on at least one batch ({self.batch_size} samples)")
        if self.task == "istree" and self.nodes < 4:
            bad("--nodes", self.nodes, "IsTree graphs need at least 4 nodes")
        if self.workers is not None and self.workers < 0:
            bad("--workers", self.workers, "use 0 (generate in the training process) or more")
        if self.eval_max_new_tokens is not None and self.eval_max_new_tokens < 1:
            bad("--eval-max-new-tokens", self.eval_max_new_tokens, "use a positive number of tokens")


class TrainTask:
    """What the trainer needs from a task: its vocabulary, a fresh-sample stream, a length bound, held-out
    samples, and the options under which the eval engine re-creates it (icr_task.json next to the checkpoint)."""

    def __init__(self, cfg: TrainConfig):
        from evals import get_task

        self.cfg = cfg
        if cfg.task == "istree":
            self.vocab = istree.vocabulary(cfg.nodes)
            self.max_len = {"direct": 4 * cfg.nodes, "cot": 8 * cfg.nodes, "retrieval": 64 * cfg.nodes}[cfg.setup]
            self.eval_args = {"nodes": cfg.nodes, "setup": cfg.setup, "graph": cfg.graph, "samples": cfg.eval_samples}
            self.impl = get_task("istree", **self.eval_args)
        else:  # any registered task with a token stream (vocabulary, stream, max_tokens)
            self.eval_args = {"length": cfg.length, "format": "tokens", "samples": cfg.eval_samples}
            self.impl = get_task(cfg.task, **self.eval_args)
            self.vocab = self.impl.vocabulary()
            self.max_len = self.impl.max_tokens() + 2

    def stream(self, seed: int):
        if self.cfg.task == "istree":
            return istree.stream(self.cfg.nodes, self.cfg.setup, self.cfg.graph, seed)
        return self.impl.stream(seed)

    def heldout(self) -> list[list[str]]:
        """The live evaluation's held-out samples as whole training sequences (gold trace and tool results
        included): what teacher-forced exact match is computed on."""
        rows = self.impl.load()
        if self.cfg.task == "istree":
            return [istree.sample_tokens(istree.Graph(self.cfg.nodes, [tuple(e) for e in r["edges"]]), self.cfg.setup)
                    for r in rows]
        return [r["prompt"].split() + r["answer"].split() for r in rows]

    def tokenizer(self):
        from evals.base import word_level_tokenizer

        return word_level_tokenizer(self.vocab)


def batch_from_tokens(samples: list[list[str]], vocab: dict[str, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and the loss mask (targets after the first [EOS], no tool results, no padding)."""
    width = max(len(s) for s in samples)
    pad = vocab[istree.PAD]
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.float32)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = torch.tensor([vocab[t] for t in s])
        mask[i, : len(s)] = torch.tensor(istree.loss_mask(s), dtype=torch.float32)
    return ids.to(device), mask.to(device)


class TrainingBatches(torch.utils.data.IterableDataset):
    """Endless batches of fresh samples. Each DataLoader worker draws from a stream seeded by (seed, process,
    worker), so generation runs off the training loop's critical path and no two workers repeat a sample."""

    def __init__(self, task: TrainTask, batch: int, seed: int, process: int, bucket: int = 1):
        self.task, self.batch, self.seed, self.process, self.bucket = task, batch, seed, process, bucket
        self.vocab = {t: i for i, t in enumerate(task.vocab)}

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        stream = self.task.stream(seed=self.seed * 1000 + self.process * 64 + worker)
        order = random.Random(f"bucket:{self.seed}:{self.process}:{worker}")
        while True:
            pool = [next(stream) for _ in range(self.batch * self.bucket)]
            if self.bucket > 1:
                pool.sort(key=len)
            groups = [pool[i:i + self.batch] for i in range(0, len(pool), self.batch)]
            order.shuffle(groups)
            for g in groups:
                yield batch_from_tokens(g, self.vocab, "cpu")


def lr_at(step: int, total: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to zero (a multiplier of the peak learning rate)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def masked_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the loss mask's targets (next-token prediction)."""
    logits, tgt, m = logits[:, :-1].float(), ids[:, 1:], mask[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    return (ce * m.reshape(-1)).sum() / m.sum().clamp_min(1)


@torch.no_grad()
def teacher_forced(model, batches, autocast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paper's metric on pre-built held-out batches: per batch, the summed loss, the number of samples whose
    every target token is the argmax, and the sample count (tensors: summed over processes by the caller)."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    loss = torch.zeros((), device=dev)
    right = torch.zeros((), device=dev)
    count = torch.zeros((), device=dev)
    for ids, mask in batches:
        ids, mask = ids.to(dev), mask.to(dev)
        with autocast():
            logits = model(input_ids=ids).logits
        ok = (logits[:, :-1].argmax(-1) == ids[:, 1:]) | (mask[:, 1:] == 0)
        right += ok.all(dim=1).sum()
        count += len(ids)
        loss += masked_loss(logits, ids, mask) * len(ids)
    model.train(was_training)
    return loss, right, count


def check_kernels(cfg: TrainConfig, device: torch.device) -> None:
    """On CUDA, Mamba without mamba-ssm and causal-conv1d falls back to a Python-loop scan: refuse unless asked."""
    if device.type != "cuda" or cfg.arch == "transformer" or cfg.allow_slow_scan:
        return
    missing = []
    for mod in ("mamba_ssm", "causal_conv1d"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod.replace("_", "-"))
    if missing:
        raise ConfigError(f"--arch {cfg.arch} on CUDA without {' and '.join(missing)}: training would use a "
                          "Python-loop scan, tens of times slower; pip install 'icr-harness[gpu]' or pass "
                          "--allow-slow-scan")


def _tracker(cfg: TrainConfig) -> str | None:
    import importlib.util

    if cfg.report_to == "auto":
        return "tensorboard" if importlib.util.find_spec("tensorboard") else None
    return None if cfg.report_to == "none" else cfg.report_to


def train_one(cfg: TrainConfig, progress: bool = True) -> dict:
    """Train one model (or return the finished result: runs are resumable), keep the best checkpoint by
    teacher-forced exact match, evaluate it live, save it."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from harness.models.istree import build_model, trainable_parameters

    if cfg.output is None or any(getattr(cfg, k) is None for k in PAPER_DEFAULTS):
        cfg = cfg.resolved()
    out = Path(cfg.output)
    done = out / "result.json"
    if done.exists():
        earlier = json.loads(done.read_text())
        changed = [k for k in RESULT_DECIDING if k in earlier and earlier[k] != getattr(cfg, k)]
        if changed:
            raise ConfigError(f"{out} holds a finished run with other settings ("
                              + ", ".join(f"{k}: {earlier[k]!r} there, {getattr(cfg, k)!r} now" for k in changed)
                              + "); use another --output or the same settings")
        log.info("%s: finished earlier, skipped", out)
        return earlier
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tracker = _tracker(cfg)
    acc = Accelerator(cpu=not torch.cuda.is_available(), log_with=tracker,
                      project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "tracker")))
    check_kernels(cfg, acc.device)
    if cfg.batch_size % acc.num_processes:
        raise ConfigError(f"--batch-size {cfg.batch_size} is the global batch and must split evenly over "
                          f"{acc.num_processes} processes")
    per_process = cfg.batch_size // acc.num_processes
    cuda = acc.device.type == "cuda"
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and cuda)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def autocast():
        return torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=bf16)

    torch.manual_seed(cfg.seed)
    task = TrainTask(cfg)
    vocab = {t: i for i, t in enumerate(task.vocab)}
    model = build_model(cfg.arch, cfg.size, len(task.vocab), max_positions=max(4096, 2 * task.max_len),
                        d_model=cfg.d_model, layers=cfg.layers)
    n_params = trainable_parameters(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    model, opt = acc.prepare(model, opt)
    steps = max(1, cfg.samples // cfg.batch_size)
    warm = max(1, cfg.warmup // cfg.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, warm))
    workers = cfg.workers if cfg.workers is not None else (4 if cuda else 0)
    loader = torch.utils.data.DataLoader(
        TrainingBatches(task, per_process, cfg.seed, acc.process_index, cfg.bucket), batch_size=None,
        num_workers=workers, pin_memory=cuda, prefetch_factor=4 if workers else None, persistent_workers=False)
    # held-out set: this process's share, batched once
    heldout = task.heldout()[acc.process_index::acc.num_processes]
    eval_batches = [batch_from_tokens(heldout[i:i + cfg.eval_batch_size], vocab, "cpu")
                    for i in range(0, len(heldout), cfg.eval_batch_size)]
    every = max(1, cfg.eval_every // cfg.batch_size)
    log_every = max(1, min(every, steps // 100))
    log.info("%s: %s trainable parameters, %d steps of %d (%d per process x %d), lr %g, %s, %s, %d data workers, "
             "teacher-forced eval every %d steps on %d samples", cfg.name, f"{n_params:,}", steps, cfg.batch_size,
             per_process, acc.num_processes, cfg.lr, acc.device, "bf16 autocast" if bf16 else "float32", workers,
             every, len(heldout) * acc.num_processes)
    out.mkdir(parents=True, exist_ok=True)
    if tracker:
        acc.init_trackers(cfg.name, config={k: v for k, v in dataclasses.asdict(cfg).items() if v is not None})
    curve: list[dict] = []
    best = {"em": -1.0, "samples": 0, "state": None}
    first_loss = None
    loss_sum = torch.zeros((), device=acc.device)  # summed on the device: one host sync per log line
    loss_n = 0
    data_s = 0.0
    t0 = time.perf_counter()
    model.train()
    bar = tqdm(total=steps, desc=cfg.name, disable=not (progress and acc.is_main_process))
    batches = iter(loader)
    with open(out / "train_log.jsonl", "w") as logf:
        for step in range(steps):
            t_data = time.perf_counter()
            ids, mask = next(batches)
            ids, mask = ids.to(acc.device, non_blocking=True), mask.to(acc.device, non_blocking=True)
            data_s += time.perf_counter() - t_data
            with autocast():
                logits = model(input_ids=ids).logits
            loss = masked_loss(logits, ids, mask)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            loss_n += 1
            bar.update(1)
            evaluate_now = (step + 1) % every == 0 or step == steps - 1
            if step % log_every and not evaluate_now:
                continue
            seen = (step + 1) * cfg.batch_size
            row = {"step": step, "samples": seen, "loss": round(float(acc.reduce(loss_sum, "mean")) / loss_n, 6),
                   "lr": sched.get_last_lr()[0]}
            first_loss = row["loss"] if first_loss is None else first_loss
            loss_sum.zero_()
            loss_n = 0
            if evaluate_now:
                tf_loss, right, count = (acc.reduce(t, "sum") for t in teacher_forced(model, eval_batches, autocast))
                row["eval_loss"] = round(float(tf_loss / count), 6)
                row["eval_em"] = int(right) / max(1, int(count))
                if row["eval_em"] >= best["em"]:  # ties go to the later, longer-trained checkpoint
                    best = {"em": row["eval_em"], "samples": seen, "state": {
                        k: v.detach().to("cpu", copy=True) for k, v in acc.unwrap_model(model).state_dict().items()}}
                bar.set_postfix(loss=f"{row['loss']:.4f}", em=f"{100 * row['eval_em']:.1f}%")
            else:
                bar.set_postfix(loss=f"{row['loss']:.4f}")
            curve.append(row)
            if tracker:
                acc.log({f"train/{k}" if k in ("loss", "lr") else k.replace("eval_", "eval/"): v
                         for k, v in row.items() if k not in ("step", "samples")}, step=seen)
            if acc.is_main_process:
                logf.write(json.dumps(row) + "\n")
                logf.flush()
    bar.close()
    train_s = time.perf_counter() - t0
    acc.wait_for_everyone()
    result = None
    if acc.is_main_process:
        model = acc.unwrap_model(model).eval()
        final = {"em": curve[-1]["eval_em"], "loss": curve[-1]["loss"]}
        model.load_state_dict(best["state"])  # the kept checkpoint is the best one
        tok = task.tokenizer()
        model.save_pretrained(out)
        tok.save_pretrained(out)
        (out / "icr_task.json").write_text(json.dumps({"task": cfg.task, "args": task.eval_args}, indent=2))
        plot_curves(curve, out / "curves.png", cfg.name)
        result = {**dataclasses.asdict(cfg), "trainable_parameters": n_params, "steps": steps,
                  "processes": acc.num_processes, "device": str(acc.device),
                  "compute_dtype": "bfloat16" if bf16 else "float32", "data_workers": workers,
                  "first_loss": first_loss, "final_loss": final["loss"],
                  "teacher_forced_em": best["em"], "best_samples": best["samples"],
                  "teacher_forced_em_final": final["em"],
                  "train_seconds": round(train_s, 2), "data_seconds": round(data_s, 2),
                  "samples_per_second": round(steps * cfg.batch_size / train_s, 1), "curve": curve}
        if cfg.live_eval:
            t1 = time.perf_counter()
            live = _only(evaluate(model, tok, out, cfg.task, task.eval_args, cfg.eval_batch_size,
                                  cfg.eval_max_new_tokens, progress)["metrics"])
            result.update(accuracy=live["accuracy"], accuracy_se=live["accuracy_se"],
                          eval_seconds=round(time.perf_counter() - t1, 2))
        done.write_text(json.dumps(result, indent=2))
    if tracker:
        acc.end_training()
    acc.wait_for_everyone()
    return result or {}


def _only(by_condition: dict) -> dict:
    """The metrics of a run with a single condition (a trained model is evaluated at its own size)."""
    (only,) = by_condition.values()
    return only


def evaluate(model, tok, run_dir: Path, task: str, task_args: dict, batch_size: int,
             max_new_tokens: int | None = None, progress: bool = False) -> dict:
    """Greedy evaluation on held-out samples through the eval engine (the tool live for retrieval)."""
    from harness.backends.hf import TransformersBackend
    from harness.config import RunConfig
    from harness.engine import run_eval

    backend = TransformersBackend(str(run_dir), model=model, tok=tok, device=str(next(model.parameters()).device),
                                  dtype="float32" if next(model.parameters()).dtype == torch.float32 else "bfloat16")
    cfg = RunConfig(model=str(run_dir), task=task, task_args=task_args, batch_size=str(batch_size),
                    max_new_tokens=max_new_tokens, output=str(run_dir / "eval"), seed=0, prefix_reuse=False)
    return run_eval(cfg, backend=backend, progress=progress)


def plot_curves(curve: list[dict], path: Path, title: str) -> None:
    """Training loss and teacher-forced exact match against samples seen: one PNG per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot([r["samples"] for r in curve], [r["loss"] for r in curve], color="tab:blue", label="train loss")
    ax.set_xlabel("training samples")
    ax.set_ylabel("loss", color="tab:blue")
    ax.set_yscale("log")
    em = [r for r in curve if "eval_em" in r]
    ax2 = ax.twinx()
    ax2.plot([r["samples"] for r in em], [100 * r["eval_em"] for r in em], "o-", color="tab:red",
             label="teacher-forced EM")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("teacher-forced EM (%)", color="tab:red")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def trainable_tasks() -> list[str]:
    """IsTree, and every registered task that can write token streams for the small models."""
    from evals import task_class, task_names

    return [n for n in task_names() if n == "istree" or hasattr(task_class(n), "stream")]


@dataclass
class TrainCliFlags:
    """Flags of the command line only: which runs to start and what to print, never a run's result."""

    grid: str | None = _f(None, "run a whole grid under --output, finished cells skipped: paper = 81 runs, smoke = "
                                "9 small CPU runs at n=4 (about 6 minutes on 2 cores)",
                          choices=["paper", "smoke"])
    jobs: int | None = _f(None, "grid cells trained at once, each in its own process with its share of the CPU "
                                "threads (default: one per CPU core without a GPU, 1 with one)")
    plan: bool = _f(False, "measure a few steps of every grid cell and print the grid's estimated hours; train "
                           "nothing")
    progress: bool = _f(True, "show progress bars")


def build_parser():
    from transformers import HfArgumentParser

    ap = HfArgumentParser((TrainConfig, TrainCliFlags), prog="python -m harness.train", description=__doc__,
                          formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    for action in ap._actions:  # the task choices come from the registry  # noqa: SLF001
        if action.dest == "task":
            action.choices = trainable_tasks()
    return ap


def main(argv=None) -> int:
    from harness import grid as grids

    cfg, flags = build_parser().parse_args_into_dataclasses(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        if flags.grid:
            root = Path(cfg.output or f"runs/grid-{flags.grid}")
            if flags.plan:
                print(grids.plan_grid(flags.grid, cfg, root))
                return 0
            t0 = time.perf_counter()
            grids.run_grid(flags.grid, cfg, root, jobs=flags.jobs, progress=flags.progress)
            table = grids.write_grid_report(root)
            print(f"\nIsTree grid '{flags.grid}' ({time.perf_counter() - t0:.0f} s)\n\n{table}\n\nwrote "
                  f"{root}/results.md, results.csv, istree_grid.png")
            return 0
        if flags.plan:
            raise ConfigError("--plan estimates a grid: give --grid paper or --grid smoke")
        cfg = cfg.resolved()
        res = train_one(cfg, flags.progress)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if res:
        live = (f"live greedy accuracy {100 * res['accuracy']:.1f}% ± {100 * res['accuracy_se']:.1f}; "
                if "accuracy" in res else "")
        print(f"\n{cfg.name}: teacher-forced EM {100 * res['teacher_forced_em']:.1f}% (best, at "
              f"{res['best_samples']:,} samples); {live}{cfg.eval_samples} held-out samples; "
              f"{res['trainable_parameters']:,} trainable parameters; loss {res['first_loss']:.3f} -> "
              f"{res['final_loss']:.3f}; wrote {cfg.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
