"""Decode tokens/s against the memory-bandwidth bound of the device it runs on.

    python benchmarks/decode_bound.py                     # CPU: tiny random models
    python benchmarks/decode_bound.py --size real         # a GPU: Phi-Mamba / Phi at 1.3B scale (random weights)

Measures the device's copy bandwidth, then batch-1 greedy decode steps after 512 / 2k / 8k-token prompts for
Phi-Mamba and the hybrid (eager, and replayed from CUDA graphs on a GPU; at ``real`` size with the released
checkpoints' head shapes) and Phi, through the harness's own backends. The bound
is bandwidth / (weight bytes + decoding-state bytes): a step reads every weight and the state at least once.
The same table as ``python -m harness.doctor``'s decode section."""
from __future__ import annotations


import torch

from harness.tools.checks import decode_table, memory_bandwidth
from harness.training.grid import device_name
from harness.tools.bench import benchmark_parser


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--size", choices=["tiny", "real"], default=None, help="default: real on CUDA, tiny on CPU")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = a.size or ("real" if device == "cuda" else "tiny")
    print(f"{device_name(torch.device(device))}: copy bandwidth {memory_bandwidth(device) / 1e9:.1f} GB/s; {size} random models, batch 1\n")
    print(f"{'model':26s} {'context':>8s} {'tokens/s':>9s} {'bound/s':>9s} {'of bound':>9s} {'state MiB':>10s}")
    for r in decode_table(device, size, tuple(int(x) for x in a.lengths.split(",")), a.steps):
        print(f"{r['model']:26s} {r['context']:8d} {r['tokens_per_s']:9.1f} {r['bound_tokens_per_s']:9.1f} "
              f"{100 * r['of_bound']:8.1f}% {r['state_mib']:10.3f}")


if __name__ == "__main__":
    main()
