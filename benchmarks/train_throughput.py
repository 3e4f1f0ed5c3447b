"""Training throughput per architecture x setup x graph size on this machine, the share of a step that data
generation would take inline, and the projected hours of the paper's 81-run grid.

    python benchmarks/train_throughput.py                                  # CPU: 0.5M models, batch 8 measured
    python benchmarks/train_throughput.py --sizes 0.5M,1M,2M --measure-batch 64 --steps 5   # on a GPU

Each cell is measured side by side in one run with ``harness.training.grid.measure_cell`` (the planner's own
measurement): one warm-up step, then ``--steps`` timed optimizer steps (forward, backward, AdamW) on real
batches of the cell, and the time to generate those samples in Python. A step measured at ``--measure-batch``
samples is scaled linearly to the paper's batch of 64. Sizes not measured are projected from the measured
size by trainable parameters (stated in the output). Data generation runs in DataLoader workers during
training, so its share is what workers must hide, not time added."""
from __future__ import annotations

import argparse
import functools
import time

import torch

from harness.models.istree import build_model, trainable_parameters
from harness.training.config import TrainConfig
from harness.training.grid import ARCH_ORDER, GRID_DEFAULTS, device_name, measure_cell


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.5M", help="sizes to measure (others are projected)")
    ap.add_argument("--nodes", default="16,32,64")
    ap.add_argument("--setups", default="direct,cot,retrieval")
    ap.add_argument("--archs", default=",".join(ARCH_ORDER))
    ap.add_argument("--measure-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes, archs = a.sizes.split(","), a.archs.split(",")
    paper = GRID_DEFAULTS["paper"]
    batch = 64
    print(f"device: {device_name(device)}; step measured at batch {a.measure_batch} over {a.steps} step(s), scaled to batch {batch}\n")
    print(f"{'setup':10s} {'n':>3s} {'size':5s} {'arch':12s} {'tok/sample':>10s} {'samples/s':>10s} "
          f"{'vs transformer':>15s} {'data share':>11s} {'5M samples (h)':>15s}")
    hours: dict[tuple, float] = {}
    t_all = time.perf_counter()
    for setup in a.setups.split(","):
        for n in map(int, a.nodes.split(",")):
            for size in sizes:
                base = None
                for arch in archs:
                    cell = TrainConfig(arch=arch, size=size, nodes=n, setup=setup, report_to="none").resolved()
                    m = measure_cell(cell, device, a.measure_batch, a.steps)
                    step64 = m["step_s"] * batch / a.measure_batch
                    rate = batch / step64
                    base = base or rate
                    share = m["gen_s_per_sample"] * batch / (step64 + m["gen_s_per_sample"] * batch)
                    evals = paper["samples"] // paper["eval_every"] * paper["eval_samples"] / a.measure_batch \
                        * m["forward_s"]
                    h = (paper["samples"] / batch * step64 + evals) / 3600
                    hours[setup, n, size, arch] = h
                    print(f"{setup:10s} {n:3d} {size:5s} {arch:12s} {m['tokens']:10.0f} {rate:10.1f} "
                          f"{rate / base:14.2f}x {100 * share:10.1f}% {h:15.2f}", flush=True)
    total, projected = 0.0, []
    for setup in a.setups.split(","):
        for n in map(int, a.nodes.split(",")):
            for size in ("0.5M", "1M", "2M"):
                for arch in archs:
                    if (setup, n, size, arch) in hours:
                        total += hours[setup, n, size, arch]
                        continue
                    ref = sizes[0]
                    ratio = _params(arch, size, n) / _params(arch, ref, n)
                    total += hours[setup, n, ref, arch] * ratio
                    projected.append(size)
    how = (f"; sizes {', '.join(sorted(set(projected)))} projected from {sizes[0]} by trainable parameters"
           if projected else "")
    print(f"\npaper grid ({len(a.setups.split(',')) * len(a.nodes.split(',')) * 3 * len(archs)} runs of 5M samples, "
          f"teacher-forced eval of 5,000 samples every 100k): about {total:.0f} hours on this device, one run at a "
          f"time{how}; live greedy evaluation not included. Measured in {time.perf_counter() - t_all:.0f} s.")


@functools.cache
def _params(arch: str, size: str, n: int) -> int:
    vocab = n + 17
    return trainable_parameters(build_model(arch, size, vocab))


if __name__ == "__main__":
    main()
