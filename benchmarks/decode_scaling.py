"""Decode cost against context length: Phi-Mamba (constant state) vs Phi attention (growing KV cache).

    python benchmarks/decode_scaling.py [--lengths 512,2048,8192] [--hidden 128 --layers 4]

Both models are random-weight and the same width/depth, on the CPU. For each context length: prefill, then
time ``--steps`` single-token decode steps through the engine's own steppers, and measure the decoding
state (KV cache or conv+SSM state) in bytes, which is the memory that grows, or not, with context.
Ratios are to the shortest length, so a flat model prints ~1.0x."""
from __future__ import annotations

import tempfile

from harness.tools.checks import decode_cost
from harness.backends.loading import load_backend
from harness.tiny import build_tokenizer, make_tiny_model
from harness.tools.bench import benchmark_parser


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    tok = build_tokenizer()
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for arch in ("phi-mamba", "phi"):
            path = make_tiny_model(f"{d}/{arch}", arch, tokenizer=tok, hidden=a.hidden, layers=a.layers,
                                   max_positions=max(lengths) + a.steps + 16)
            backend = load_backend(str(path), "cpu", "float32")
            rows[arch] = [decode_cost(backend, n, a.steps) for n in lengths]
    print(f"random models d={a.hidden}, {a.layers} layers, CPU float32, {a.steps} decode steps per length\n")
    print(f"{'model':10s} {'context':>8s} {'ms/token':>9s} {'vs first':>9s} {'state MiB':>10s} {'vs first':>9s}")
    for arch, res in rows.items():
        t0, m0 = res[0]
        for n, (t, m) in zip(lengths, res):
            print(f"{arch:10s} {n:8d} {1e3 * t:9.2f} {t / t0:8.2f}x {m / 2**20:10.3f} {m / m0:8.2f}x")
    (tm, mm), (tp, mp) = rows["phi-mamba"][-1], rows["phi"][-1]
    print(f"\nat {lengths[-1]} tokens: Phi/Phi-Mamba decode time {tp / tm:.2f}x, decode-state memory {mp / mm:.1f}x")


if __name__ == "__main__":
    main()
