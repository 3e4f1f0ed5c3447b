"""The trainer's parallel Mamba scan against the step-by-step recurrence it replaced, side by side in one run.

    python benchmarks/scan.py                 # CPU: the scan alone, then whole 0.5M Mamba training steps
    python benchmarks/scan.py --batch 64      # on a GPU (CUDA is used when present)

Part 1 times one scan's forward+backward (one layer's shape: 128 channels, 16 states) at 48, 455 and 1,845
tokens, the IsTree n=16 direct, n=16 retrieval and n=64 retrieval lengths. Part 2 times whole training steps
(forward, backward, AdamW) of the 0.5M Mamba on real IsTree batches (n=16 direct, n=32 and n=64 retrieval),
each measurement in a fresh child process so that its peak memory (resident set on a CPU, allocated on a GPU)
is its own. Both scans train the same weights to the same loss, checked in every row. "parallel" is what the
trainer runs (``choose_scan``: the Triton kernels on a GPU where they pass their check, else the PyTorch
scan); on a GPU part 1 also times the PyTorch scan.

    python benchmarks/scan.py --tune --batch 64   # on a GPU: the Triton scan's chunk and channel-block sizes

``--tune`` times the Triton scan's forward+backward for each layout (chunked prefix scans, step by step), tile
and count of time splits run side by side (``TUNE_CONFIGS``) at each length, on
bf16 activations (what the trainer's autocast hands it), each configuration's output and gradients checked
against the PyTorch scan; the fastest per length is marked.

    python benchmarks/scan.py --memory --batch 64 --lengths 48,455,1845,2535      # on a GPU
    TRITON_INTERPRET=1 python benchmarks/scan.py --memory --batch 2 --channels 64 --lengths 512   # on a CPU

``--memory`` prints, per shape and precision, the bytes the Triton scan's forward and backward allocate (its
tensors outside the kernels: ``AllocatedBytes``) beside the bytes of what they return, and on a GPU their times
against the memory bound (the bytes they cannot avoid moving, inputs read and outputs written, at the copy
bandwidth measured in the same run) and against the PyTorch scan.

    python benchmarks/scan.py --profile --batch 64 --cells 64:retrieval           # on a GPU

``--profile`` profiles one training step of the 0.5M Mamba per cell (after a warm-up) and prints the share of
the step's device time in the scan's kernels, the convolution's and the rest, then the top kernels."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time

import torch

from harness.tools.bench import benchmark_parser

SCANS = ("parallel", "sequential")


def scan_only(length: int, batch: int, device: str, repeats: int) -> dict:
    from harness.ops.selective_scan import selective_scan, sequential_scan

    def pytorch_scan(*args, **kwargs):
        return selective_scan(*args, **kwargs, scan="torch")

    g = torch.Generator().manual_seed(0)
    d, n = 128, 16
    u, z = (torch.randn(batch, d, length, generator=g).to(device).requires_grad_() for _ in range(2))
    # step sizes after softplus in [0.001, 0.1], Mamba's initial range: larger ones (softplus of a standard
    # normal) drive states through subnormal floats, which cost both scans many times their normal speed on a CPU
    dt = (torch.rand(batch, d, length, generator=g) * 4.65 - 6.9).to(device).requires_grad_()
    B, C = (torch.randn(batch, n, length, generator=g).to(device).requires_grad_() for _ in range(2))
    A = -torch.arange(1, n + 1.0).expand(d, n).clone().to(device).requires_grad_()
    out = {}
    scans = [("parallel", selective_scan), ("sequential", sequential_scan)]
    if device == "cuda":
        scans.append(("pytorch", pytorch_scan))
    for name, fn in scans:
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            t = time.perf_counter()
            fn(u, dt, A, B, C, z=z, delta_softplus=True).square().sum().backward()
            _sync(device)
            best = min(best, time.perf_counter() - t)
        out[name] = best
    return out


# (layout, chunk, channel block, warps, splits) --tune times beside the default: each layout's best on an H100 at
# 128 and 256 channels, their neighbours, the former default (chunks of 32, 16 channels, 4 warps), and the two
# bests with time cut in 2, 4 and 8 splits (not yet timed on a GPU)
TUNE_CONFIGS = [("chunks", 64, 4, 1, 1), ("chunks", 32, 4, 1, 1), ("chunks", 64, 8, 1, 1), ("chunks", 128, 4, 1, 1),
                ("chunks", 32, 16, 4, 1), ("steps", 16, 16, 1, 1), ("steps", 8, 16, 1, 1), ("steps", 16, 8, 1, 1),
                ("steps", 32, 16, 1, 1), ("steps", 8, 8, 1, 1),
                *((layout, chunk, block, 1, k) for layout, chunk, block in (("chunks", 64, 4), ("steps", 16, 16))
                  for k in (2, 4, 8))]


def tune(lengths: list[int], batch: int, repeats: int, device: str = "cuda", configs=None, d: int = 128) -> None:
    """The Triton scan's layout and tile (``scan_triton.tiled``) on this GPU: seconds of forward+backward and the
    largest relative difference from the PyTorch scan (output and every gradient) per configuration and length."""
    from harness.ops import scan_triton
    from harness.ops.selective_scan import selective_scan

    n = 16
    default = scan_triton.current_tile(d)
    configs = list(dict.fromkeys([default, *(configs or TUNE_CONFIGS)]))
    print(f"Triton scan configurations, forward+backward, batch {batch}, {d} channels, bf16 activations "
          f"(default: {default[0]}, chunk {default[1]}, block {default[2]}, {default[3]} warps, {default[4]} splits)")
    print(f"{'tokens':>7s} {'layout':>7s} {'chunk':>6s} {'block':>6s} {'warps':>6s} {'splits':>7s} {'seconds':>9s} "
          f"{'vs default':>11s} {'max rel diff':>13s}")
    for length in lengths:
        inputs = [t.requires_grad_() for t in _scan_inputs(batch, d, n, length, torch.bfloat16, device, seed=length)]
        dy = torch.randn(batch, d, length, generator=torch.Generator().manual_seed(length + 1)).to(device).bfloat16()

        def run(scan):
            y = selective_scan(*inputs[:5], D=inputs[5], z=inputs[6], scan=scan)
            grads = torch.autograd.grad(y, inputs, dy)
            return [y.float(), *(x.float() for x in grads)]

        ref = run("torch")
        rows = []  # the default first: each row prints as it is timed (a cut-off run keeps what it measured)
        for config in configs:
            with scan_triton.tiled(*config):
                got = run("triton")  # compiles this configuration
                diff = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, ref))
                best = float("inf")
                for _ in range(repeats):
                    _sync(device)
                    t = time.perf_counter()
                    run("triton")
                    _sync(device)
                    best = min(best, time.perf_counter() - t)
            rows.append((config, best))
            layout, chunk, block, warp, splits = config
            print(f"{length:7d} {layout:>7s} {chunk:6d} {block:6d} {warp:6d} {splits:7d} {best:9.5f} "
                  f"{rows[0][1] / best:10.2f}x {diff:13.2e}", flush=True)
        config, best = min(rows, key=lambda r: r[1])
        print(f"fastest at {length} tokens: {':'.join(map(str, config))} ({rows[0][1] / best:.2f}x the default)\n",
              flush=True)


def _scan_inputs(batch: int, d: int, n: int, length: int, dtype: torch.dtype, device: str, seed: int = 0):
    """u, dt, A, B, C, D, z as the mixer hands them: activations in ``dtype`` laid out [b, l, k] (the scan takes
    transposed views), float32 step sizes and parameters."""
    g = torch.Generator().manual_seed(seed)
    u, z = (torch.randn(batch, length, d, generator=g).to(device, dtype).transpose(1, 2) for _ in range(2))
    dt = (torch.rand(batch, length, d, generator=g) * 0.1 + 0.001).to(device).transpose(1, 2)
    B, C = (torch.randn(batch, length, n, generator=g).to(device, dtype).transpose(1, 2) for _ in range(2))
    A = -torch.arange(1, n + 1.0).expand(d, n).contiguous().to(device)
    return u, dt, A, B, C, torch.ones(d, device=device), z


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def memory(lengths: list[int], batch: int, d: int, n: int, dtypes: list[str], device: str, repeats: int) -> None:
    """The Triton scan's allocations (and on a GPU its times) per shape against what it cannot avoid."""
    from harness.ops.scan_triton import TritonScan
    from harness.ops.selective_scan import SelectiveScan
    from harness.tools.bench import AllocatedBytes
    from harness.tools.checks import memory_bandwidth

    gpu = device == "cuda"
    bandwidth = memory_bandwidth(device) if gpu else None
    print(f"the Triton scan's memory, {batch} rows x {d} channels x {n} states"
          + (f"; copy bandwidth {bandwidth / 1e9:.0f} GB/s" if gpu else ""))
    print(f"{'tokens':>7s} {'dtype':>9s} {'fwd alloc MB':>13s} {'output MB':>10s} {'bwd alloc MB':>13s} "
          f"{'grads MB':>9s} {'bwd/grads':>10s}" + (f" {'fwd ms':>8s} {'bwd ms':>8s} {'bound ms':>9s} {'x bound':>8s} "
                                                    f"{'torch ms':>9s} {'speed-up':>9s}" if gpu else ""))
    for length in lengths:
        for dtype in dtypes:
            inputs = _scan_inputs(batch, d, n, length, getattr(torch, dtype), device, seed=length)
            leaves = [t.detach().requires_grad_() for t in inputs]
            with AllocatedBytes() as fwd:
                y = TritonScan.apply(*leaves)
            dy = torch.randn_like(y)
            with AllocatedBytes() as bwd:
                grads = torch.autograd.grad(y, leaves, dy)
            row = (f"{length:7d} {dtype:>9s} {fwd.bytes / 1e6:13.2f} {_nbytes(y) / 1e6:10.2f} {bwd.bytes / 1e6:13.2f} "
                   f"{_nbytes(*grads) / 1e6:9.2f} {bwd.bytes / _nbytes(*grads):9.2f}x")
            if gpu:
                moved = 2 * _nbytes(*inputs) + _nbytes(y) + _nbytes(dy) + _nbytes(*grads)  # read twice, written once
                fwd_s = _best(lambda: TritonScan.apply(*leaves), repeats)
                y = TritonScan.apply(*leaves)
                bwd_s = _best(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True), repeats)

                def torch_scan():
                    torch.autograd.grad(SelectiveScan.apply(*leaves), leaves, dy)

                torch_s = _best(torch_scan, repeats)
                bound = moved / bandwidth
                row += (f" {1e3 * fwd_s:8.2f} {1e3 * bwd_s:8.2f} {1e3 * bound:9.2f} {(fwd_s + bwd_s) / bound:7.1f}x "
                        f"{1e3 * torch_s:9.2f} {torch_s / (fwd_s + bwd_s):8.1f}x")
            print(row, flush=True)


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def profile(cells: list[tuple[int, str]], batch: int, device: str) -> None:
    """One 0.5M Mamba training step per cell under torch.profiler: the step's device time by kernel family."""
    from harness.tools.step_profile import profile_step
    from harness.training.config import TrainConfig

    for nodes, setup in cells:
        cfg = TrainConfig(arch="mamba", size="0.5M", nodes=nodes, setup=setup, report_to="none").resolved()
        p = profile_step(cfg, batch, device)
        total, families = p["total_ms"], p["families_ms"]
        print(f"\nn={nodes} {setup}, {p['tokens']} tokens, batch {batch}: {total:.1f} ms of "
              f"{'device' if device == 'cuda' else 'CPU'} time in one step ({p['scans'][0]['scan']} scan)")
        for name, ms in (*families.items(), ("the rest", total - sum(families.values()))):
            print(f"  {name:12s} {ms:9.2f} ms {100 * ms / total:6.1f}%")
        for key, ms, count in p["top"]:
            print(f"    {key[:70]:70s} {ms:9.2f} ms  x{count}")


def train_step(scan: str, nodes: int, setup: str, batch: int, device: str, steps: int) -> dict:
    """Seconds per training step of the 0.5M Mamba with ``scan``, and this process's peak memory."""
    from harness.models import istree
    from harness.training.config import TrainConfig
    from harness.training.data import TrainTask, batch_from_tokens
    from harness.training.step import masked_loss, new_optimizer

    cfg = TrainConfig(arch="mamba", nodes=nodes, setup=setup, report_to="none").resolved()
    task = TrainTask(cfg)
    vocab = {t: i for i, t in enumerate(task.vocab)}
    stream = task.stream(seed=0)
    torch.manual_seed(0)
    model = istree.build_model("mamba", "0.5M", len(task.vocab), scan="auto" if scan == "parallel" else scan).to(device)
    opt = new_optimizer(cfg, model, torch.device(device))  # the trainer's
    times, losses, tokens = [], [], 0
    for _ in range(steps + 1):
        ids, mask = batch_from_tokens([next(stream) for _ in range(batch)], vocab, device)
        tokens = ids.shape[1]
        _sync(device)
        t = time.perf_counter()
        loss = masked_loss(model(input_ids=ids).logits, ids, mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"step_s": min(times[1:]), "peak_bytes": peak, "losses": losses, "tokens": tokens}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _configs(text: str | None) -> list[tuple] | None:
    """--configs LAYOUT:CHUNK:BLOCK:WARPS[:SPLITS],... as ``scan_triton.tiled``'s tuples (None: TUNE_CONFIGS)."""
    if not text:
        return None
    try:
        configs = []
        for config in text.split(","):
            layout, *numbers = config.split(":")
            if len(numbers) not in (3, 4):
                raise ValueError(config)
            chunk, block, warps, splits = (*map(int, numbers), 1)[:4]
            configs.append((layout, chunk, block, warps, splits))
        return configs
    except ValueError:
        sys.exit(f"error: --configs {text!r}: write LAYOUT:CHUNK:BLOCK:WARPS[:SPLITS] separated by commas, e.g. "
                 "chunks:32:16:4,steps:16:16:1:4")


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="timed training steps per cell (after one warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="timed scans per length (the best is shown)")
    ap.add_argument("--lengths", default="48,455,1845", help="scan lengths of part 1")
    ap.add_argument("--cells", default="16:direct,32:retrieval,64:retrieval", help="IsTree NODES:SETUP of part 2")
    ap.add_argument("--tune", action="store_true", help="on a GPU: time the Triton scan's chunk and block sizes")
    ap.add_argument("--memory", action="store_true", help="the Triton scan's bytes (and on a GPU times) per shape")
    ap.add_argument("--channels", type=int, default=128, help="channels of --tune's and --memory's scans")
    ap.add_argument("--configs", default=None, help="--tune's configurations, LAYOUT:CHUNK:BLOCK:WARPS[:SPLITS] "
                                                    "separated by commas (default: TUNE_CONFIGS)")
    ap.add_argument("--dtypes", default=None, help="precisions of --memory (default: float32,bfloat16 on a GPU, "
                                                   "float32 under the interpreter)")
    ap.add_argument("--profile", action="store_true", help="one training step's time by kernel family per cell")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if (a.tune or a.memory) and importlib.util.find_spec("triton") is None:
        sys.exit(f"error: --{'tune' if a.tune else 'memory'} runs the Triton scan and Triton is not installed: "
                 "pip install triton (a CUDA build of torch brings it), or pip install -e \".[dev]\"")
    if a.tune:
        if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("error: --tune times the Triton scan's kernels: run it on a CUDA GPU (or, to check it at tiny "
                     "sizes, with TRITON_INTERPRET=1)")
        tune(list(map(int, a.lengths.split(","))), a.batch, a.repeats, device, _configs(a.configs), a.channels)
        return
    if a.memory:
        if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("error: --memory runs the Triton scan: run it on a CUDA GPU, or on a CPU with TRITON_INTERPRET=1")
        dtypes = a.dtypes or ("float32,bfloat16" if device == "cuda" else "float32")
        memory(list(map(int, a.lengths.split(","))), a.batch, a.channels, 16, dtypes.split(","), device, a.repeats)
        return
    if a.profile:
        profile([(int(c.split(":")[0]), c.split(":")[1]) for c in a.cells.split(",")], a.batch, device)
        return
    if a.child:
        print(json.dumps(train_step(**json.loads(a.child), device=device)))
        return
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}\n")
    from harness.ops.selective_scan import choose_scan

    ran = choose_scan((1, 1, 1), torch.device(device), torch.float32, 1).scan
    print(f"one scan, forward+backward (128 channels x 16 states); parallel = the {ran} scan")
    print(f"{'tokens':>7s} {'batch':>6s} {'parallel s':>11s} {'sequential s':>13s} {'speed-up':>9s}"
          + (f" {'PyTorch scan s':>15s}" if device == "cuda" else ""))
    for length in map(int, a.lengths.split(",")):
        t = scan_only(length, a.batch, device, a.repeats)
        print(f"{length:7d} {a.batch:6d} {t['parallel']:11.4f} {t['sequential']:13.4f} "
              f"{t['sequential'] / t['parallel']:8.1f}x" + (f" {t['pytorch']:15.4f}" if "pytorch" in t else ""),
              flush=True)
    print("\n0.5M Mamba training step (forward, backward, AdamW) on IsTree batches, each in its own process")
    print(f"{'cell':15s} {'tokens':>6s} {'parallel s':>11s} {'sequential s':>13s} {'speed-up':>9s} "
          f"{'parallel peak':>14s} {'sequential peak':>16s} {'memory':>7s}")
    for nodes, setup in (c.split(":") for c in a.cells.split(",")):
        nodes = int(nodes)
        rows = {}
        for scan in SCANS:
            spec = json.dumps({"scan": scan, "nodes": nodes, "setup": setup, "batch": a.batch, "steps": a.steps})
            res = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"error: the {scan} scan failed at n={nodes} {setup}: {res.stderr.strip()[-500:]}")
            rows[scan] = json.loads(res.stdout.strip().splitlines()[-1])
        p, s = rows["parallel"], rows["sequential"]
        same = max(abs(x - y) / abs(y) for x, y in zip(p["losses"], s["losses"]))
        if same > 1e-4:
            sys.exit(f"error: the scans trained to different losses at n={nodes} {setup}: {p['losses']} vs "
                     f"{s['losses']}")
        print(f"{f'n={nodes} {setup}':15s} {p['tokens']:6d} {p['step_s']:11.2f} {s['step_s']:13.2f} "
              f"{s['step_s'] / p['step_s']:8.1f}x {p['peak_bytes'] / 2**30:11.2f} GiB "
              f"{s['peak_bytes'] / 2**30:12.2f} GiB {s['peak_bytes'] / p['peak_bytes']:6.1f}x", flush=True)
    print(f"\n(losses of every step agree between the scans; batch {a.batch})")


if __name__ == "__main__":
    main()
