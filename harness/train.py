"""``python -m harness.train``: train the small IsTree models and evaluate them with the eval engine.

    python -m harness.train --task istree --arch mamba --size 0.5M --nodes 16 --setup retrieval --output runs/x
    python -m harness.train --grid smoke                       # CPU demo: 3 archs x 3 setups at n=6
    accelerate launch -m harness.train --grid paper            # the 81-run grid, data parallel over GPUs

Defaults follow the paper's code: AdamW (weight decay 0), cosine schedule with a 10,000-sample warm-up, batch
64, lr 1e-3 for the Transformer and 3e-4 for Mamba and the hybrid, fresh samples every step. The checkpoint
is written with ``save_pretrained`` next to its tokenizer and task, so
``python -m harness.eval --model RUN_DIR --task istree`` evaluates it; the trainer itself evaluates through
the same engine (greedy decoding, the retrieval tool live for the retrieval setup).
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from evals import istree

log = logging.getLogger("harness")

DEFAULT_LR = {"transformer": 1e-3, "mamba": 3e-4, "hybrid": 3e-4}
GRIDS = {
    "paper": {"arch": ["transformer", "mamba", "hybrid"], "size": ["0.5M", "1M", "2M"], "nodes": [16, 32, 64],
              "setup": ["direct", "cot", "retrieval"]},
    "smoke": {"arch": ["transformer", "mamba", "hybrid"], "size": ["smoke"], "nodes": [6],
              "setup": ["direct", "cot", "retrieval"]},
}
GRID_DEFAULTS = {"paper": {"samples": 5_000_000, "eval_samples": 5000},
                 # a CPU demo: 150 steps, so a hotter lr than the paper's 5M-sample runs
                 "smoke": {"samples": 4800, "eval_samples": 200, "batch_size": 32, "warmup": 480, "lr": 3e-3}}


@dataclass
class TrainConfig:
    task: str = "istree"  # or one of the retrieval tasks: index, ar, cgram, counting
    length: int = 32  # sequence length for the retrieval tasks
    arch: str = "transformer"
    size: str = "0.5M"
    nodes: int = 16
    setup: str = "cot"
    graph: str = "binary"
    samples: int = 5_000_000
    batch_size: int = 64
    lr: float | None = None
    warmup: int = 10_000  # samples
    seed: int = 42
    eval_samples: int = 5000
    eval_batch_size: int = 256
    output: str = "runs/istree"

    @property
    def name(self) -> str:
        if self.task == "istree":
            return f"{self.arch}-{self.size}-n{self.nodes}-{self.setup}"
        return f"{self.arch}-{self.size}-{self.task}-L{self.length}"


class TrainTask:
    """What the trainer needs from a task: its vocabulary, a fresh-sample stream, a length bound, and the
    options under which the eval engine re-creates it (written to icr_task.json next to the checkpoint)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        if cfg.task == "istree":
            self.vocab = istree.vocabulary(cfg.nodes)
            self.max_len = {"direct": 4 * cfg.nodes, "cot": 8 * cfg.nodes, "retrieval": 64 * cfg.nodes}[cfg.setup]
            self.eval_args = {"nodes": cfg.nodes, "setup": cfg.setup, "graph": cfg.graph, "samples": cfg.eval_samples}
        else:  # any registered task with a token stream (vocabulary, stream, max_tokens)
            from evals import get_task

            self.eval_args = {"length": cfg.length, "format": "tokens", "samples": cfg.eval_samples}
            self.impl = get_task(cfg.task, **self.eval_args)
            self.vocab = self.impl.vocabulary()
            self.max_len = self.impl.max_tokens() + 2

    def stream(self, seed: int):
        if self.cfg.task == "istree":
            return istree.stream(self.cfg.nodes, self.cfg.setup, self.cfg.graph, seed)
        return self.impl.stream(seed)

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


def lr_at(step: int, total: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to zero (a multiplier of the peak learning rate)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_one(cfg: TrainConfig, progress: bool = True, accelerator=None) -> dict:
    """Train one model (or return the finished result: runs are resumable), evaluate it, save it."""
    from accelerate import Accelerator

    from harness.istree_models import build_model, trainable_parameters

    out = Path(cfg.output)
    done = out / "result.json"
    if done.exists():
        log.info("%s: finished earlier, skipped", out)
        return json.loads(done.read_text())
    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(cfg.seed)
    task = TrainTask(cfg)
    vocab = {t: i for i, t in enumerate(task.vocab)}
    model = build_model(cfg.arch, cfg.size, len(task.vocab), max_positions=max(4096, 2 * task.max_len))
    n_params = trainable_parameters(model)
    lr = cfg.lr or DEFAULT_LR[cfg.arch]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model, opt = acc.prepare(model, opt)
    steps = max(1, cfg.samples // (cfg.batch_size * acc.num_processes))
    warm = max(1, cfg.warmup // (cfg.batch_size * acc.num_processes))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, warm))
    data = task.stream(seed=cfg.seed * 1000 + acc.process_index)
    log.info("%s: %s trainable parameters, %d steps of %d, lr %g, on %s x%d", cfg.name, f"{n_params:,}", steps,
             cfg.batch_size, lr, acc.device, acc.num_processes)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    losses = []
    model.train()
    bar = tqdm(range(steps), desc=cfg.name, disable=not (progress and acc.is_main_process))
    with open(out / "train_log.jsonl", "w") as logf:
        for step in bar:
            ids, mask = batch_from_tokens([next(data) for _ in range(cfg.batch_size)], vocab, acc.device)
            logits = model(input_ids=ids).logits[:, :-1].float()
            tgt, m = ids[:, 1:], mask[:, 1:]
            loss = (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
                    * m.reshape(-1)).sum() / m.sum().clamp_min(1)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step % 20 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{loss.item():.4f}")
                logf.write(json.dumps({"step": step, "samples": (step + 1) * cfg.batch_size * acc.num_processes,
                                       "loss": round(loss.item(), 6), "lr": sched.get_last_lr()[0]}) + "\n")
                logf.flush()
    train_s = time.perf_counter() - t0
    acc.wait_for_everyone()
    result = None
    if acc.is_main_process:
        model = acc.unwrap_model(model).eval()
        tok = task.tokenizer()
        model.save_pretrained(out)
        tok.save_pretrained(out)
        (out / "icr_task.json").write_text(json.dumps({"task": cfg.task, "args": task.eval_args}, indent=2))
        t1 = time.perf_counter()
        acc_eval = evaluate(model, tok, out, cfg.task, task.eval_args, cfg.eval_batch_size, progress)
        result = {**asdict(cfg), "lr": lr, "trainable_parameters": n_params, "steps": steps,
                  "final_loss": float(sum(losses[-20:]) / len(losses[-20:])), "first_loss": losses[0],
                  "train_seconds": round(train_s, 2), "eval_seconds": round(time.perf_counter() - t1, 2),
                  "samples_per_second": round(steps * cfg.batch_size * acc.num_processes / train_s, 1),
                  "accuracy": _only(acc_eval["metrics"])["accuracy"],
                  "accuracy_se": _only(acc_eval["metrics"])["accuracy_se"], "device": str(acc.device)}
        done.write_text(json.dumps(result, indent=2))
    acc.wait_for_everyone()
    return result or {}


def _only(by_condition: dict) -> dict:
    """The metrics of a run with a single condition (a trained model is evaluated at its own size)."""
    (only,) = by_condition.values()
    return only


def evaluate(model, tok, run_dir: Path, task: str, task_args: dict, batch_size: int, progress: bool) -> dict:
    """Greedy evaluation on held-out samples through the eval engine (the tool live for retrieval)."""
    from harness.backends.hf import TransformersBackend
    from harness.config import RunConfig
    from harness.engine import run_eval

    backend = TransformersBackend(str(run_dir), model=model, tok=tok, device=str(next(model.parameters()).device),
                                  dtype="float32" if next(model.parameters()).dtype == torch.float32 else "bfloat16")
    cfg = RunConfig(model=str(run_dir), task=task, task_args=task_args, batch_size=str(batch_size),
                    output=str(run_dir / "eval"), seed=0, prefix_reuse=False)
    return run_eval(cfg, backend=backend, progress=progress)


def run_grid(name: str, base: TrainConfig, root: Path, progress: bool) -> list[dict]:
    grid = GRIDS[name]
    results = []
    combos = list(itertools.product(grid["setup"], grid["nodes"], grid["size"], grid["arch"]))
    for i, (setup, nodes, size, arch) in enumerate(combos, 1):
        cfg = TrainConfig(**{**asdict(base), "arch": arch, "size": size, "nodes": nodes, "setup": setup})
        cfg.output = str(root / cfg.name)
        log.info("grid %s: run %d/%d %s", name, i, len(combos), cfg.name)
        results.append(train_one(cfg, progress))
    write_grid_report(root)
    return results


def write_grid_report(root: Path) -> str:
    """Collect every finished run under ``root`` into results.csv / results.md and the paper-style figure."""
    import pandas as pd

    rows = [r for r in (json.loads(p.read_text()) for p in sorted(root.glob("*/result.json"))) if r.get("task") == "istree"]
    if not rows:
        return ""
    df = pd.DataFrame(rows)[["setup", "nodes", "size", "arch", "trainable_parameters", "accuracy", "accuracy_se",
                             "final_loss", "samples_per_second", "train_seconds"]]
    df = df.sort_values(["setup", "nodes", "size", "arch"])
    df.to_csv(root / "results.csv", index=False)
    table = df.assign(accuracy=[f"{100 * a:.1f} ± {100 * s:.1f}" for a, s in zip(df.accuracy, df.accuracy_se)]) \
        .drop(columns=["accuracy_se"]).to_markdown(index=False, floatfmt=".3f")
    (root / "results.md").write_text(table + "\n")
    plot_grid(df, root / "istree_grid.png")
    return table


def plot_grid(df, path: Path) -> None:
    """Accuracy bars per architecture, one panel per (setup, graph size), sizes side by side: the paper's layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = [s for s in istree.SETUPS if s in set(df.setup)]
    nodes = sorted(set(df.nodes))
    sizes = list(dict.fromkeys(df["size"]))
    archs = [a for a in ("transformer", "mamba", "hybrid") if a in set(df.arch)]
    fig, axes = plt.subplots(len(setups), len(nodes), figsize=(3.2 * len(nodes), 2.6 * len(setups)), squeeze=False,
                             sharey=True)
    width = 0.8 / len(archs)
    for r, setup in enumerate(setups):
        for c, n in enumerate(nodes):
            ax = axes[r][c]
            sub = df[(df.setup == setup) & (df.nodes == n)]
            for k, arch in enumerate(archs):
                vals = [sub[(sub["size"] == s) & (sub.arch == arch)].accuracy for s in sizes]
                ys = [100 * float(v.iloc[0]) if len(v) else 0.0 for v in vals]
                ax.bar([i + k * width for i in range(len(sizes))], ys, width, label=arch)
            ax.set_xticks([i + width * (len(archs) - 1) / 2 for i in range(len(sizes))], sizes)
            ax.set_ylim(0, 100)
            ax.axhline(50, color="grey", lw=0.6, ls=":")
            ax.set_title(f"{setup}, n={n}", fontsize=9)
            if c == 0:
                ax.set_ylabel("accuracy (%)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def trainable_tasks() -> list[str]:
    """IsTree, and every registered task that can write token streams for the small models."""
    from evals import task_class, task_names

    return [n for n in task_names() if n == "istree" or hasattr(task_class(n), "stream")]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m harness.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="istree", choices=trainable_tasks(),
                    help="IsTree, or any task with a token stream (trained on direct answers)")
    ap.add_argument("--length", type=int, default=32,
                    help="size of a non-IsTree task: sequence length, key-value pairs (mqar), entries (needle)")
    ap.add_argument("--arch", default="transformer", choices=["transformer", "mamba", "hybrid"])
    ap.add_argument("--size", default="0.5M", choices=["0.5M", "1M", "2M", "smoke"],
                    help="parameter budget; architectures are matched within 10%% (smoke: a CPU demo size)")
    ap.add_argument("--nodes", type=int, default=16, help="graph size n (paper: 16, 32, 64)")
    ap.add_argument("--setup", default="cot", choices=list(istree.SETUPS))
    ap.add_argument("--graph", default="binary", choices=list(istree.GRAPHS))
    ap.add_argument("--samples", type=int, default=None, help="training samples (default 5,000,000; smoke 4,800)")
    ap.add_argument("--batch-size", type=int, default=None, help="per-process batch (default 64)")
    ap.add_argument("--lr", type=float, default=None, help="peak lr (default 1e-3 Transformer, 3e-4 others)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up samples (default 10,000)")
    ap.add_argument("--eval-samples", type=int, default=None, help="held-out samples (default 5,000)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--grid", choices=list(GRIDS), default=None,
                    help="run a whole grid under --output (finished runs are skipped): paper = 81 runs, "
                         "smoke = 9 small CPU runs at n=6 (about 5 minutes on 2 cores)")
    ap.add_argument("--output", default=None, help="run directory (a grid's root with --grid)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    defaults = {"samples": 5_000_000, "batch_size": 64, "warmup": 10_000, "eval_samples": 5000, "lr": None}
    if a.grid:
        defaults.update(GRID_DEFAULTS[a.grid])
    pick = lambda k: getattr(a, k) if getattr(a, k) is not None else defaults[k]  # noqa: E731
    base = TrainConfig(task=a.task, length=a.length, arch=a.arch, size=a.size, nodes=a.nodes, setup=a.setup, graph=a.graph,
                       samples=pick("samples"), batch_size=pick("batch_size"), lr=pick("lr"), warmup=pick("warmup"),
                       seed=a.seed, eval_samples=pick("eval_samples"))
    if a.grid:
        root = Path(a.output or f"runs/grid-{a.grid}")
        t0 = time.perf_counter()
        run_grid(a.grid, base, root, not a.no_progress)
        table = write_grid_report(root)
        print(f"\nIsTree grid '{a.grid}' ({time.perf_counter() - t0:.0f} s)\n\n{table}\n\nwrote {root}/results.md, "
              f"results.csv, istree_grid.png")
        return 0
    base.output = a.output or f"runs/{base.name}"
    res = train_one(base, not a.no_progress)
    if res:
        print(f"\n{base.name}: accuracy {100 * res['accuracy']:.1f}% ± {100 * res['accuracy_se']:.1f} on "
              f"{base.eval_samples} held-out samples; {res['trainable_parameters']:,} trainable parameters; "
              f"loss {res['first_loss']:.3f} -> {res['final_loss']:.3f}; wrote {base.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
