"""The paper's effect at toy scale, on a CPU, in a few minutes: ``python -m harness.demo``.

Tiny Transformer, Mamba and hybrid models (the trainer's ``smoke`` size, about 30k trainable parameters each)
are trained by the project's trainer on the paper's index task (a sequence of L random symbols, then a position
i: answer the symbol at position i), one model per architecture and length, as the paper trains one per size;
each checkpoint is then evaluated by greedy generation through the eval engine on 500 held-out sequences. The
table and ``demo.png`` show accuracy against context length next to the decoding state each model holds.

Everything is seeded (same numbers on every run of one machine and torch version) and cached: trained cells
are skipped on a second run, so it only redraws the report. ``--out`` keeps several demos apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import textwrap
import time
from pathlib import Path

import torch

from evals import task_class
from harness.files import write_atomic
from harness.reports.runs import load_run
from harness.reports.paired import paired
from harness.reports.plotting import pyplot, save
from harness.training.config import USER_ERRORS, TrainConfig
from harness.procs import forks, process_started

ARCHS = ("transformer", "hybrid", "mamba")
LENGTHS = (4, 8, 16)
BATCH = 32
SYMBOLS = 16  # the index task's default alphabet: chance is 1/16


def default_steps(length: int) -> int:
    """Optimizer steps of 32 samples for one cell: the same for every architecture at a length, more for longer
    contexts (1,000 at L=4, 1,500 at L=8, 2,000 at L=16)."""
    return max(100, round(500 * math.log2(length)))


LIMITS = """\
What it does not show: the paper's result is a limit (a fixed-size state cannot hold an arbitrarily long
context); at this scale Mamba's numbers also depend on how long it trains, and the tiny Transformer learns
position lookup in a sudden jump whose timing depends on the seed (--seed picks another; docs/demo.md lists the
seeds measured). Pretrained models and HotpotQA: `python -m harness.eval --model phi-mamba --task hotpotqa`."""


def demo_cells(root: Path, lengths=LENGTHS, steps: int | None = None, seed: int = 42) -> list[TrainConfig]:
    """One training run per (architecture, length), resolved: the trainer's own config, so the cells are
    ordinary runs (``python -m harness.eval --model CELL --task index`` re-scores one)."""
    cells = []
    for length in lengths:
        n = steps or default_steps(length)
        for arch in ARCHS:
            cfg = TrainConfig(task="index", length=length, arch=arch, size="smoke", samples=n * BATCH,
                              batch_size=BATCH, lr=3e-3, warmup=min(100, n // 10) * BATCH,
                              eval_every=max(1, n // 4) * BATCH, eval_samples=500, eval_batch_size=250, seed=seed,
                              threads=1, report_to="none", output=None)
            cfg = cfg.resolved()  # the directory names every setting that differs between demo cells
            cells.append(dataclasses.replace(cfg, output=str(root / f"{cfg.name}-seed{seed}-steps{n}")))
    return cells


def _cost(cell: TrainConfig) -> float:
    """Relative CPU seconds, for starting the longest cells first (a recurrent step is ~4x an attention step)."""
    return (1.0 if cell.arch == "transformer" else 4.0) * (cell.length + 6) * cell.samples


def collect(cells: list[TrainConfig]) -> list[dict]:
    """One row per finished cell: accuracy (live greedy through the engine, with its standard error) and the
    decoding state the model held at the end of the prompts (the engine's per-row measurement, averaged)."""
    rows = []
    for cell in cells:
        res = json.loads((Path(cell.output) / "result.json").read_text())
        (live,) = json.loads((Path(cell.output) / "eval" / "results.json").read_text())["metrics"].values()
        rows.append({"arch": cell.arch, "length": cell.length, "accuracy": live["accuracy"],
                     "accuracy_se": live["accuracy_se"], "n": live["n"], "prompt_tokens": live["prompt_tokens"],
                     "state_bytes": live["state_bytes"], "teacher_forced_em": res["teacher_forced_em"],
                     "reported": res.get("reported", "the best checkpoint on the reported samples (an old run)"),
                     "parameters": res["trainable_parameters"], "samples": res["samples"],
                     "train_seconds": res["train_seconds"]})
    return rows


def gaps(cells: list[TrainConfig]) -> str:
    """Each attention model's lead over Mamba at the longest length, paired on the same held-out sequences
    (``harness.reports.paired``): "significant" only where the interval and McNemar's test say so."""
    hi = max(c.length for c in cells)
    at = {c.arch: c for c in cells if c.length == hi}
    rows = {a: load_run(Path(c.output) / "eval")[1] for a, c in at.items()}
    out = []
    for arch in ("transformer", "hybrid"):
        d = paired(rows[arch], rows["mamba"], "accuracy", key=lambda r: r["key"], cluster=lambda r: r["id"],
                   a=arch, b="mamba", condition=f"L={hi}",
                   binary="accuracy" in task_class(at[arch].task).binary_metrics)
        if d is not None:
            verdict = "significant" if d.significant else "not significant"
            out.append(f"{arch.capitalize()} − Mamba at L={hi}: {100 * d.diff:+.0f} pts, 95% CI "
                       f"[{100 * d.ci_low:+.0f}, {100 * d.ci_high:+.0f}] over {d.pairs} paired sequences, McNemar "
                       f"p = {d.mcnemar_p:.2g} ({verdict} at 5%).")
    return " ".join(out)


def findings(rows: list[dict]) -> str:
    """What this run's numbers say, in words, from the numbers (never a canned sentence)."""
    acc = {(r["arch"], r["length"]): r["accuracy"] for r in rows}
    state = {(r["arch"], r["length"]): r["state_bytes"] for r in rows}
    lo, hi = min(r["length"] for r in rows), max(r["length"] for r in rows)

    def pct(arch):
        return " -> ".join(f"{100 * acc[arch, n]:.0f}%" for n in sorted({r["length"] for r in rows}))

    attention_holds = all(acc[a, hi] >= 0.9 for a in ("transformer", "hybrid"))
    mamba_falls = acc["mamba", lo] - acc["mamba", hi] >= 0.1
    if attention_holds and mamba_falls:
        head = ("What this shows: trained alike at each length, the models with attention retrieve at every "
                f"length (Transformer {pct('transformer')}, hybrid {pct('hybrid')}), while Mamba falls as the "
                f"context grows ({pct('mamba')}).")
    else:
        head = ("This run does not show the expected pattern (attention models near 100% at every length, "
                f"Mamba falling): Transformer {pct('transformer')}, hybrid {pct('hybrid')}, Mamba {pct('mamba')}.")
    kib = {a: state[a, hi] / 1024 for a in ARCHS}
    compare = "more than" if kib["mamba"] > kib["transformer"] else "less than"
    return (f"{head} At L={hi} Mamba carries {kib['mamba']:.1f} KiB of state, {compare} the Transformer's whole "
            f"KV cache ({kib['transformer']:.1f} KiB): a cache keeps every token, a recurrent state must compress "
            "them.")


def which(rows: list[dict]) -> str:
    """Which checkpoint and which samples the accuracies come from, as each cell's result.json says."""
    reported = sorted({r["reported"] for r in rows})
    if all(r.startswith("last validation") for r in reported):
        return (f"Accuracy: greedy generation through the eval engine on {rows[0]['n']} held-out sequences (the "
                "test split) by each cell's final weights, the paper's protocol: no checkpoint was chosen on "
                "these sequences.")
    return ("Accuracy: greedy generation through the eval engine on the test split by each cell's kept "
            f"checkpoint: {'; '.join(reported)}.")


def table(rows: list[dict]) -> str:
    import pandas as pd

    df = pd.DataFrame(rows)
    acc = df.pivot(index="arch", columns="length", values="accuracy").reindex(list(ARCHS))
    se = df.pivot(index="arch", columns="length", values="accuracy_se").reindex(list(ARCHS))
    state = df.pivot(index="arch", columns="length", values="state_bytes").reindex(list(ARCHS))
    samples = df.groupby("length")["samples"].first()
    shown = pd.DataFrame({f"L={n} ({samples[n] // 1000}k samples)":
                          [f"{100 * a:.0f} ± {100 * s:.0f}%  ({b / 1024:.1f} KiB)" for a, s, b in zip(acc[n], se[n], state[n])]
                          for n in acc.columns}, index=acc.index)
    params = df.groupby("arch")["parameters"].first().reindex(list(ARCHS))
    shown.insert(0, "parameters", [f"{p:,}" for p in params])
    return shown.to_markdown()


def plot(rows: list[dict], path: Path) -> None:
    """Accuracy against context length (chance dotted), and the decoding state each model holds there."""
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    lengths = sorted({r["length"] for r in rows})
    # distinct markers, line styles and sizes: two architectures at 100% must both stay visible
    styles = {"transformer": ("s", "-", 9), "hybrid": ("o", "--", 6), "mamba": ("^", "-", 7)}
    for k, arch in enumerate(ARCHS):
        mine = sorted((r for r in rows if r["arch"] == arch), key=lambda r: r["length"])
        xs = [r["length"] for r in mine]
        marker, line, size = styles[arch]
        kw = dict(marker=marker, ls=line, ms=size, color=f"C{k}", label=arch,
                  mfc="none" if arch == "transformer" else None)
        ax.errorbar(xs, [100 * r["accuracy"] for r in mine], yerr=[100 * r["accuracy_se"] for r in mine],
                    capsize=3, **kw)
        ax2.plot(xs, [r["state_bytes"] / 1024 for r in mine], **kw)
    ax.axhline(100 / SYMBOLS, color="grey", lw=0.8, ls=":", label="chance")
    ax.set(xscale="log", ylim=(0, 105), xlabel="context length L (symbols before the question)",
           ylabel=f"accuracy (%), greedy, {rows[0]['n']} held-out", title="index task: the symbol at position i")
    ax2.set(xscale="log", xlabel="context length L", ylabel="state at the end of the prompt (KiB)",
            title="what each model carries to its answer (float32)", ylim=(0, None))
    for a in (ax, ax2):
        a.set_xticks(lengths, [str(n) for n in lengths])
        a.minorticks_off()
    ax.legend(fontsize=8, loc="lower left")
    save(fig, path, dpi=130)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="the trained cells and the report (default %(default)s)")
    p.add_argument("--jobs", type=int, default=None, help="cells trained at once (default: one per CPU core, up to 3)")
    p.add_argument("--steps", type=int, default=None, help="training steps of 32 samples per cell (default: 1,000 "
                                                          "at L=4, 1,500 at L=8, 2,000 at L=16; other values train "
                                                          "other cells)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="context lengths (default %(default)s)")
    p.add_argument("--seed", type=int, default=42, help="initialisation and data (default: the trainer's, "
                                                        "%(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    root = Path(args.out)
    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
        if min(lengths) < 2 or len(set(lengths)) < len(lengths):
            raise ValueError
    except ValueError:
        print(f"error: --lengths {args.lengths!r}: use a comma list of distinct lengths >= 2, e.g. 4,8,16",
              file=sys.stderr)
        return 2
    for flag, value in (("--steps", args.steps), ("--jobs", args.jobs)):
        if value is not None and value < 1:
            print(f"error: {flag} {value}: use 1 or more", file=sys.stderr)
            return 2
    from harness.training.grid import train_in_processes  # lazy: start-up time (--help loads no model code)
    from harness.training.trainer import finished_result  # lazy, as above

    t0 = time.perf_counter()
    try:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the cells' processes: no kernel-fallback notices
        cells = demo_cells(root, lengths, args.steps, args.seed)
        todo = [c for c in cells if finished_result(c) is None]  # a cell of other settings is refused, not read
        jobs = args.jobs or max(1, min(3, os.cpu_count() or 1, len(todo) or 1))
        if todo:
            expected, how = estimate_seconds(todo, jobs)
            print(f"training {len(todo)} of {len(cells)} cells ({len(cells) - len(todo)} cached) under {root}/, "
                  f"{jobs} at a time: about {_duration(expected)} on this machine ({how})", flush=True)
            train_in_processes("demo", sorted(todo, key=_cost, reverse=True), jobs, 1, args.progress, False,
                               cost=_cost, expected_s=expected)
        rows = collect(cells)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished cells are kept under {root}/; run the same command to continue",
              file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    words = "\n\n".join(textwrap.fill(w, 110) for w in (findings(rows), gaps(cells), which(rows)) if w)
    text, words = table(rows), f"{words}\n\n{LIMITS}"
    plot(rows, root / "demo.png")
    write_atomic(root / "demo.md", f"{text}\n\n{words}\n")
    print(f"\nindex task, accuracy (± standard error) and the model's state at the end of its prompt, "
          f"{time.perf_counter() - t0:.0f} s\n\n{text}\n\n{words}\n\nwrote {root}/demo.png, {root}/demo.md")
    return 0


def estimate_seconds(cells: list[TrainConfig], jobs: int) -> tuple[float, str]:
    """What the cells will take on this machine as it is now, from a short measurement rather than a constant
    (the old constant held on a quiet machine and read 4 minutes for 18 on a loaded one): each architecture's
    optimizer step at the longest length, timed here on one thread as a cell trains (so other load counts),
    scaled to each cell's length and steps, plus its evaluations as forward passes and the processes' start-up,
    in units of this process's own (imports included). On a CPU the cells fork from one server that imports as
    much once, and each cell's own overhead (its model, its live evaluation's engine) was a quarter of it on 2
    loaded cores; a fresh interpreter a cell (CUDA) imports again: twice it a cell, measured the same way.
    Returns the seconds and what was measured, in words."""
    from harness.training.grid import measure_cell  # lazy: start-up time (--help loads no model code)

    startup = max(1.0, time.perf_counter() - process_started())
    forked = forks(cuda=torch.cuda.device_count() > 0)  # as train_in_processes starts them
    per_cell = (0.25 if forked else 2.0) * startup
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per_token, longest = {}, {}
        for arch in dict.fromkeys(c.arch for c in cells):
            cell = longest[arch] = max((c for c in cells if c.arch == arch), key=lambda c: c.length)
            m = measure_cell(cell, torch.device("cpu"), BATCH, steps=2, draws=4)
            per_token[arch] = (m["step_s"] / (cell.length + 6), m["forward_s"] / (cell.length + 6))
    finally:
        torch.set_num_threads(before)
    total = 0.0
    for c in cells:
        step, forward = per_token[c.arch]
        evals = (c.samples // c.eval_every + 2) * -(-c.eval_samples // c.eval_batch_size)  # + the live one
        total += (c.samples // c.batch_size) * step * (c.length + 6) + evals * forward * (c.length + 6) + per_cell
    how = ", ".join(f"a {arch} step at L={longest[arch].length} takes {1000 * step * (longest[arch].length + 6):.0f} ms"
                    for arch, (step, _) in per_token.items())
    started = (f"the cells' process server starts in about {startup:.0f} s, a cell in about {per_cell:.1f} s"
               if forked else f"a cell's process starts in about {per_cell:.0f} s")
    return (total / max(1, min(jobs, len(cells))) + (startup if forked else 0.0),
            f"measured just now on one thread: {how}; {started}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


if __name__ == "__main__":
    sys.exit(main())
