"""A CPU's attention over a block of queries after cached keys, by each path the transformers backend has: the
flash kernel (``harness/ops/cpu_flash.py``), oneDNN's products (``chunked_attention.onednn_attention``) and SDPA
as transformers calls it, side by side in one run, on the shapes of the HotpotQA
prefill's segments (a whole prompt, a prompt's rest after a shared front, a short tail); and a decoding step of
the prefix tree's merged rows (``--step rows:front:keys``: one query a row, a shared front, each row's own pads
after it) by the flash kernel's decoding pass (``cpu_flash.decode``), PyTorch's flash kernel over the front once
and each row's rest (``chunked_attention.front_once_attention``) and SDPA.

    python benchmarks/cpu_attention.py [--shapes 0:2300,774:1600,1500:1000,2000:100] [--step 24:774:2500]
                                       [--heads 4 --dim 64]

Each shape is ``past:queries`` (one row, float32, the harness's own mask: ``additive_mask``); the paths run in
turn, ``--repeats`` rounds, medians compared, and each path's output against SDPA in float64 (the largest
difference over the outputs' largest value)."""
from __future__ import annotations

import time
from statistics import median

import torch
import torch.nn.functional as F

from harness.backends import onednn_linear
from harness.backends.additive_mask import BuiltMask, additive_mask
from harness.backends.chunked_attention import front_once_attention, onednn_attention
from harness.ops import cpu_flash
from harness.tools.bench import benchmark_parser


def paths(query, key, value, seen, queries):
    """Each path as a call of no arguments; its output [1, q, heads, d]."""
    mask = additive_mask(seen, queries, torch.float32)
    if mask.dim() == 2:  # what transformers passes SDPA where no mask is needed: its causal flag
        mask = torch.where(torch.ones(queries, queries, dtype=torch.bool).tril(), 0.0,
                           torch.finfo(torch.float32).min)[None, None]
    built = BuiltMask(mask, seen)
    scale = query.shape[-1] ** -0.5
    past = key.shape[2] - queries

    def sdpa():  # as transformers calls it: its causal flag where no mask is needed, else the mask, in one call
        if past == 0 and bool(seen.all()):
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale).transpose(1, 2)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale).transpose(1, 2)

    out = {"SDPA, one call": sdpa}
    if onednn_linear.choice().onednn and past:  # after no cached keys SDPA takes its causal flag instead
        out["oneDNN products"] = lambda: onednn_attention(query, key, value, mask, scale, built)
    if cpu_flash.available(query.shape[-1]):
        out["flash kernel"] = lambda: cpu_flash.attention(query, key, value, mask, [built.pad_runs(0)], scale)
    exact = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=mask.double(),
                                           scale=scale).transpose(1, 2)
    return out, exact


def step_paths(rows: int, front: int, keys: int, heads: int, dim: int, g):
    """A decoding step of ``rows`` merged rows: their calls, each one's output [rows, 1, heads, d], and SDPA's in
    float64."""
    query = torch.randn(rows, heads, 1, dim, generator=g) * 2
    key, value = (torch.randn(rows, heads, keys, dim, generator=g) for _ in range(2))
    for x in (key, value):
        x[:, :, :front] = x[:1, :, :front]
    seen = torch.ones(rows, keys, dtype=torch.long)
    for row in range(rows):
        seen[row, front:front + (37 * row) % 300] = 0  # each row's pads after the front
    mask = additive_mask(seen, 1, torch.float32)
    scale = dim ** -0.5
    calls = {"SDPA, one call": lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                                       scale=scale).transpose(1, 2),
             "front once": lambda: front_once_attention(query, key, value, mask, front, scale)}
    if cpu_flash.available(dim):
        calls["flash kernel"] = lambda: cpu_flash.decode(query, key, value, mask, front, scale)
    exact = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=mask.double(),
                                           scale=scale).transpose(1, 2)
    return calls, exact


def compare(label: str, calls: dict, exact: torch.Tensor, repeats: int) -> None:
    """The calls in turn, ``repeats`` rounds after one to warm up; a line each: median, ratio, error."""
    times = {name: [] for name in calls}
    for r in range(repeats + 1):
        for name, call in (calls.items() if r % 2 else reversed(list(calls.items()))):
            t0 = time.perf_counter()
            call()
            if r:
                times[name].append(time.perf_counter() - t0)
    flash = median(times["flash kernel"]) if "flash kernel" in times else None
    for name, call in calls.items():
        error = float((call().double() - exact).abs().max() / exact.abs().max())
        ms = median(times[name]) * 1e3
        ratio = f"{ms / (flash * 1e3):8.2f}x" if flash else f"{'-':>9s}"
        print(f"{label:>13s} {name:>16s} {ms:8.2f} {ratio} {error:9.1e}  {error < 1e-5}")


def main(argv=None) -> None:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--shapes", default="0:2300,774:1600,1500:1000,2000:100")
    ap.add_argument("--step", default="24:774:2500", help="rows:front:keys of a decoding step ('' for none)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    print(f"{a.heads} heads of {a.dim}, float32, {torch.get_num_threads()} threads; medians of {a.repeats} rounds "
          "in turn; blocks: one row")
    print(f"{'shape':>13s} {'path':>16s} {'ms':>8s} {'vs flash':>9s} {'error':>9s}")
    for shape in a.shapes.split(","):
        past, queries = (int(x) for x in shape.split(":"))
        query = torch.randn(1, a.heads, queries, a.dim, generator=g) * 2
        key, value = (torch.randn(1, a.heads, past + queries, a.dim, generator=g) for _ in range(2))
        calls, exact = paths(query, key, value, torch.ones(1, past + queries, dtype=torch.long), queries)
        compare(shape, calls, exact, a.repeats)
    if a.step:
        rows, front, keys = (int(x) for x in a.step.split(":"))
        compare(f"step {a.step}", *step_paths(rows, front, keys, a.heads, a.dim, g), a.repeats)


if __name__ == "__main__":
    main()
