"""Training throughput per architecture x setup x graph size on this machine, the share of a step that data
generation would take inline, and the projected hours of the paper's 81-run grid.

    python benchmarks/train_throughput.py --sizes 0.5M                     # CPU: 0.5M models, batch 8 measured
    python benchmarks/train_throughput.py --measure-batch 64 --steps 5 --side-by-side 4   # on a GPU

Each cell is measured side by side in one run with ``harness.training.grid.measure_cell`` (the planner's own
measurement): one warm-up step, then ``--steps`` timed optimizer steps (forward, backward, AdamW) on real
batches of the cell, and the time to generate those samples in Python. A step measured at ``--measure-batch``
samples is scaled linearly to the paper's batch of 64. Sizes not measured are projected from the measured
size by trainable parameters (stated in the output). Data generation runs in DataLoader workers during
training, so its share is what workers must hide, not time added; "store share" is the same for batches read
from a built token store (``--store``), which replaces generation while training. ``--side-by-side K`` then trains 1, 2, 4 ...
K copies of a short and a long cell at once in separate processes on the same device, released together by one
barrier for one fixed window, and prints their aggregate samples/s against one alone and the CPU cores they and
their data need: what ``--cells-per-gpu K`` gains where one small cell cannot fill a GPU."""
from __future__ import annotations

import math
import time

import torch

from harness.training.config import TrainConfig
from harness.training.grid import ARCH_ORDER, GRID_DEFAULTS, cell_parameters, device_name, measure_cell
from harness.training.sharing import sharing_table, supported_gain
from harness.tools.bench import benchmark_parser


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--sizes", default="0.5M,2M", help="sizes to measure (others are projected from the measured "
                                                        "size nearest in trainable parameters)")
    ap.add_argument("--nodes", default="16,32,64")
    ap.add_argument("--setups", default="direct,cot,retrieval")
    ap.add_argument("--archs", default=",".join(ARCH_ORDER))
    ap.add_argument("--measure-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--side-by-side", type=int, default=0, metavar="K",
                    help="also measure 1, 2, 4 ... up to K cells at once (harness.training.sharing)")
    ap.add_argument("--window", type=float, default=5.0, help="seconds every side-by-side cell trains at once")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes, archs = a.sizes.split(","), a.archs.split(",")
    paper = GRID_DEFAULTS["paper"]
    batch = 64
    print(f"device: {device_name(device)}; step measured at batch {a.measure_batch} over {a.steps} step(s), scaled to batch {batch}\n")
    print(f"{'setup':10s} {'n':>3s} {'size':5s} {'arch':12s} {'padded tok':>10s} {'samples/s':>10s} "
          f"{'vs transformer':>15s} {'data share':>11s} {'store share':>12s} {'5M samples (h)':>15s}")
    hours: dict[tuple, float] = {}
    t_all = time.perf_counter()
    for setup in a.setups.split(","):
        for n in map(int, a.nodes.split(",")):
            for size in sizes:
                base, read = None, 0.0  # read: the token store's time per sample, measured at the first arch
                for arch in archs:
                    cell = TrainConfig(arch=arch, size=size, nodes=n, setup=setup, report_to="none").resolved()
                    m = measure_cell(cell, device, a.measure_batch, a.steps)
                    step64 = m["step_s"] * batch / a.measure_batch
                    rate = batch / step64
                    base = base or rate
                    share = m["gen_s_per_sample"] * batch / (step64 + m["gen_s_per_sample"] * batch)
                    read = _store_read_s(cell, a.measure_batch) if arch == archs[0] else read
                    store_share = read * batch / (step64 + read * batch)
                    evals = paper["samples"] // paper["eval_every"] * paper["eval_samples"] / a.measure_batch \
                        * m["forward_s"]
                    h = (paper["samples"] / batch * step64 + evals) / 3600
                    hours[setup, n, size, arch] = h
                    print(f"{setup:10s} {n:3d} {size:5s} {arch:12s} {m['tokens']:10.0f} {rate:10.1f} "
                          f"{rate / base:14.2f}x {100 * share:10.1f}% {100 * store_share:11.2f}% {h:15.2f}",
                          flush=True)
    total, projected = 0.0, []
    for setup in a.setups.split(","):
        for n in map(int, a.nodes.split(",")):
            for size in ("0.5M", "1M", "2M"):
                for arch in archs:
                    if (setup, n, size, arch) in hours:
                        total += hours[setup, n, size, arch]
                        continue
                    ref = min(sizes, key=lambda m: abs(math.log(cell_parameters(arch, m, n) / cell_parameters(arch, size, n))))
                    ratio = cell_parameters(arch, size, n) / cell_parameters(arch, ref, n)
                    total += hours[setup, n, ref, arch] * ratio
                    projected.append(size)
    how = (f"; sizes {', '.join(sorted(set(projected)))} projected from the nearest measured size by trainable "
           "parameters" if projected else "")
    print(f"\npaper grid ({len(a.setups.split(',')) * len(a.nodes.split(',')) * 3 * len(archs)} runs of 5M samples, "
          f"teacher-forced eval of 5,000 samples every 100k): about {total:.0f} hours on this device, one run at a "
          f"time{how}; live greedy evaluation not included. Measured in {time.perf_counter() - t_all:.0f} s.")
    if a.side_by_side > 1:
        side_by_side(a, sizes[0], total)


def _store_read_s(cell, batch: int) -> float:
    """Seconds per sample to make batches from a built token store (``--store``), the data path that replaces
    generating samples in Python while training."""
    import tempfile
    from pathlib import Path

    from harness.training.data import TrainTask
    from harness.training.store import ensure_store

    with tempfile.TemporaryDirectory() as d:
        store = ensure_store(TrainTask(cell), 4 * batch, Path(d))
        t = time.perf_counter()
        for k in range(4):
            store.batch(list(range(k * batch, (k + 1) * batch)))
        return (time.perf_counter() - t) / (4 * batch)


def side_by_side(a, size: str, hours: float) -> None:
    """K copies of a short and a long cell (the smallest ``--nodes`` direct, the largest retrieval) trained at once
    (``harness.training.sharing``: one barrier after their warm-up, one fixed window, their CPU and their data's
    counted), K from 1 to ``--side-by-side``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    nodes = sorted(map(int, a.nodes.split(",")))  # the shortest and the longest cell of those measured above
    cells = {f"short (mamba n={nodes[0]} direct)": {"arch": "mamba", "size": size, "nodes": nodes[0], "setup": "direct"},
             f"long (mamba n={nodes[-1]} retrieval)": {"arch": "mamba", "size": size, "nodes": nodes[-1],
                                                       "setup": "retrieval"}}
    ks = [k for k in (1, 2, 4, 8) if k <= a.side_by_side] + ([a.side_by_side] if a.side_by_side not in (1, 2, 4, 8)
                                                             else [])
    print(f"\ncells side by side on {device} ({size}, batch {a.measure_batch}, a {a.window:g} s window after one "
          "barrier):")
    print(f"{'cell':28s} {'K':>2s} {'samples/s':>10s} {'vs one':>7s} {'overlap':>8s} {'CPU cores':>10s}")

    def show(r):
        print(f"{r['cell']:28s} {r['K']:2d} {r['samples_per_s']:10.1f} {r['gain_over_one']:6.2f}x "
              f"{r['windows_overlap']:8.0%} {r['cpu_cores_needed']:5.1f} of {r['cores']}", flush=True)

    best = sharing_table(cells, ks, device, a.measure_batch, a.window, show)
    if best and supported_gain(best):
        k, gain = supported_gain(best)
        print(f"with --cells-per-gpu {k} the grid above would take about "
              f"{hours / max(gain, 1e-9):.0f} hours (every cell at the smaller of the two gains, {gain:.2f}x)")
    else:
        print("no K fits this machine's cores: one cell at a time")


if __name__ == "__main__":
    main()
