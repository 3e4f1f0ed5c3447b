"""The trainer as users run it: ``python -m harness.train``'s marginal step with the parallel scan against the
step-by-step one, and the planner's projected step beside it, side by side in one run; or packed rows against
padded ones, through the CLI and then step by step on the same batches.

    python benchmarks/train_cli.py                       # CPU: 0.5M Mamba, n=32 retrieval, batch 8, 2 threads
    python benchmarks/train_cli.py --batch 64 --threads 0  # on a GPU
    python benchmarks/train_cli.py --compare packing --steps 3,6 --arch mamba        # runs of 24 and 48 samples
    python benchmarks/train_cli.py --compare packing --steps 3,6 --arch transformer

For each scan (``--scan auto``, the parallel scan the trainer runs, and ``--scan sequential``, the step-by-step
reference) the real CLI trains the cell twice in fresh directories, for ``--steps`` A and B optimizer steps; the
marginal step is the difference of their ``steps_seconds`` (result.json: the loop without its evaluations and
saves) over B - A, so start-up, warm-up and the final evaluation cancel. The projection is
``harness.training.grid.measure_cell`` (what ``--plan`` and ``benchmarks/train_throughput.py`` use) on the same
cell, in a fresh process. Both scans train to the same losses (checked).

With ``--compare packing`` the CLI's marginal steps carry the runs' inline data generation and differ by which
batches the last steps drew; the step table after them times the trainer's ``optimizer_step`` on the same
``--batches`` batches, padded and packed (two copies of one model, each batch stepped by both in alternating
order, ``--repeats`` rounds), and checks the two copies' losses equal batch by batch."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.procs import project_env
from harness.tools.bench import benchmark_parser

ROOT = Path(__file__).resolve().parent.parent


def cli_run(cell: list[str], steps: int, batch: int, out: Path) -> dict:
    args = [sys.executable, "-m", "harness.train", *cell, "--batch-size", str(batch), "--samples", str(steps * batch),
            "--eval-samples", str(batch), "--eval-every", str(steps * batch), "--no-live-eval", "--report-to", "none",
            "--no-progress", "--output", str(out)]
    res = subprocess.run(args, capture_output=True, text=True, env=project_env(), cwd=ROOT)
    if res.returncode:
        sys.exit(f"error: {' '.join(args[2:])} failed: {res.stderr.strip()[-1500:]}")
    return json.loads((out / "result.json").read_text())


def projection(cell: list[str], batch: int, steps: int) -> float:
    code = ("import json, sys, torch; from harness.train import build_parser; "
            "from harness.training.grid import measure_cell; "
            "cfg, _ = build_parser().parse_args_into_dataclasses(sys.argv[1:]); cfg = cfg.resolved(); "
            "cfg.threads and torch.set_num_threads(cfg.threads); "
            "dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu'); "
            f"print(json.dumps(measure_cell(cfg, dev, {batch}, {steps})))")
    res = subprocess.run([sys.executable, "-c", code, *cell, "--batch-size", str(batch), "--report-to", "none"],
                         capture_output=True, text=True, env=project_env(), cwd=ROOT)
    if res.returncode:
        sys.exit(f"error: the projection failed: {res.stderr.strip()[-1500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["step_s"]


def ratio(num: float, den: float, unit: str = "x") -> str:
    """``num / den`` of two measured steps, or why there is none: a marginal step at or below zero means the
    runs' noise exceeded the difference of their step counts (tiny runs, a loaded machine)."""
    if num <= 0 or den <= 0:
        return "not measured (a marginal step came out at or below zero: noise; use more --steps or --repeats)"
    return f"{num / den:.2f}{unit}"


def compare_packing(a, cell: list[str], short: int, long: int) -> None:
    """Packed against padded rows through the CLI: marginal steps side by side (the median of ``--repeats``
    pairs of runs, the order alternating), losses step by step."""
    rows = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.repeats):
            for packing in ("off", "on") if r % 2 == 0 else ("on", "off"):
                runs = [cli_run([*cell, "--packing", packing], n, a.batch, Path(d) / f"{packing}-{n}-{r}")
                        for n in (short, long)]
                marginal = (runs[1]["steps_seconds"] - runs[0]["steps_seconds"]) / (long - short)
                rows[packing].append({"marginal": marginal,
                                      "losses": [c["loss"] for c in runs[1]["curve"]],
                                      "share": runs[1]["packed_rows"]["packed_share"],
                                      "ran": runs[1]["packed_rows"]["ran"]})
                print(f"--packing {packing:3s} (ran {rows[packing][-1]['ran']}): harness.train marginal step "
                      f"{rows[packing][-1]['marginal']:.3f} s ({short} vs {long} steps)", flush=True)
    off, on = (statistics.median(x["marginal"] for x in rows[k]) for k in ("off", "on"))
    same = all(max(abs(x - y) / abs(y) for x, y in zip(p["losses"], q["losses"])) < 1e-5
               for p, q in zip(rows["on"], rows["off"]))
    print(f"\n{a.size} {a.arch}, n={a.nodes} {a.setup}, batch {a.batch}, float32, {a.threads or 'default'} threads, "
          f"median of {a.repeats}\n")
    print("| rows | seconds per step |\n|---|---|")
    print(f"| padded (--packing off) | {off:.3f} |")
    print(f"| packed (--packing on; {rows['on'][0]['share']:.0%} of the padded tokens) | {on:.3f} |")
    print(f"\npacked vs padded through the CLI: {ratio(off, on)}")
    print(f"packed and padded trained to the same losses, step by step: {same}")
    compare_packing_steps(a)


def compare_packing_steps(a) -> None:
    """Padded and packed ``optimizer_step`` on the same batches, side by side (module docstring)."""
    import contextlib

    import torch

    from harness.models.packing import one_row_on, pack
    from harness.training.config import TrainConfig
    from harness.training.data import PAD, TrainingBatches, TrainTask
    from harness.training.step import new_model, new_optimizer, optimizer_step

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = TrainConfig(arch=a.arch, size=a.size, nodes=a.nodes, setup=a.setup, report_to="none",
                      precision="fp32").resolved()
    task = TrainTask(cfg)
    source = TrainingBatches(task, a.batch, cfg.seed, 0)
    batches = [b for k in range(a.batches) for b in source.pool(k)]
    pad, one_row, cpu = task.vocab.index(PAD), one_row_on("cpu"), torch.device("cpu")
    packed = [pack(ids, mask, pad, one_row) for ids, mask in batches]
    runs = {}
    for name in ("padded", "packed"):
        torch.manual_seed(cfg.seed)
        model = new_model(cfg, task)
        runs[name] = {"model": model, "opt": new_optimizer(cfg, model, cpu), "seconds": [], "losses": []}
    for r in range(a.repeats):
        for (ids, mask), p in zip(batches, packed):
            for name in ("padded", "packed") if r % 2 == 0 else ("packed", "padded"):
                run = runs[name]
                t = time.perf_counter()
                loss = optimizer_step(run["model"], run["opt"], *((ids, mask) if name == "padded" else (p.ids, p.mask)),
                                      contextlib.nullcontext(), packed=None if name == "padded" else p)
                run["seconds"].append(time.perf_counter() - t)
                run["losses"].append(loss.item())
    share = sum(p.ids.numel() for p in packed) / sum(ids.numel() for ids, _ in batches)
    step = {k: statistics.median(v["seconds"]) for k, v in runs.items()}
    total = {k: sum(v["seconds"]) for k, v in runs.items()}
    apart = max(abs(x - y) / abs(y) for x, y in zip(runs["packed"]["losses"], runs["padded"]["losses"]))
    print(f"\nthe trainer's optimizer_step on the same {len(batches)} batches, {a.repeats} round(s) in alternating "
          f"order ({share:.0%} of the padded tokens packed)\n")
    print("| rows | median step (s) | all steps (s) |\n|---|---|---|")
    for k in ("padded", "packed"):
        print(f"| {k} | {step[k]:.3f} | {total[k]:.2f} |")
    print(f"\npacked vs padded, step by step: {total['padded'] / total['packed']:.2f}x (all steps)")
    print(f"packed and padded copies of one model, same losses batch by batch: {apart < 1e-5} (at most "
          f"{apart:.1e} apart over {len(runs['packed']['losses'])} steps)")


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--arch", default="mamba")
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--setup", default="retrieval")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", default="2,8", help="the two runs' optimizer steps, A,B (B > A)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every run (0: torch's default)")
    ap.add_argument("--size", default="0.5M")
    ap.add_argument("--repeats", type=int, default=3, help="with --compare packing: pairs of runs (median), and "
                                                            "rounds of the step table")
    ap.add_argument("--batches", type=int, default=8, help="with --compare packing: the step table's batches")
    ap.add_argument("--compare", choices=["scan", "packing"], default="scan",
                    help="scan: the parallel scan against the step-by-step one; packing: packed rows against "
                         "padded ones (--packing on / off), both on the parallel scan")
    a = ap.parse_args()
    short, long = map(int, a.steps.split(","))
    cell = ["--arch", a.arch, "--size", a.size, "--nodes", str(a.nodes), "--setup", a.setup, "--precision", "fp32"]
    cell += ["--threads", str(a.threads)] if a.threads else []
    if a.compare == "packing":
        return compare_packing(a, cell, short, long)
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for scan in ("auto", "sequential"):
            runs = [cli_run([*cell, "--scan", scan], n, a.batch, Path(d) / f"{scan}-{n}") for n in (short, long)]
            ran = sorted({s["scan"] for s in runs[1]["scans"]}) or ["(no Mamba layer)"]
            marginal = (runs[1]["steps_seconds"] - runs[0]["steps_seconds"]) / (long - short)
            rows[scan] = {"ran": "+".join(ran), "marginal": marginal,
                          "losses": [r["loss"] for r in runs[1]["curve"]]}
            print(f"{scan:10s} ({rows[scan]['ran']}): harness.train marginal step {marginal:.3f} s "
                  f"({short} vs {long} steps)", flush=True)
        projected = projection([*cell, "--scan", "auto"], a.batch, 3)
    par, seq = rows["auto"], rows["sequential"]
    same = max(abs(x - y) / abs(y) for x, y in zip(par["losses"], seq["losses"])) < 1e-4
    print(f"\n{a.size} {a.arch}, n={a.nodes} {a.setup}, batch {a.batch}, float32, "
          f"{a.threads or 'default'} threads\n")
    print("| | seconds per step |\n|---|---|")
    print(f"| harness.train, parallel scan ({par['ran']}) | {par['marginal']:.3f} |")
    print(f"| harness.train, sequential scan | {seq['marginal']:.3f} |")
    print(f"| planner's projection (measure_cell) | {projected:.3f} |")
    print(f"\nparallel vs sequential through the CLI: {ratio(seq['marginal'], par['marginal'])}")
    print(f"projection / CLI: {ratio(projected, par['marginal'], '')} (the goal: 0.85 ... 1.15)")
    print(f"both scans trained to the same losses: {same}")


if __name__ == "__main__":
    main()
