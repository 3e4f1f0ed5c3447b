"""Sweeps through each prefill plan: the default (``--prefix-reuse auto``), the prefix tree prefilling below its
snapshots row by row (``tree-rows``) or in blocks (``tree-block``), ``batch`` and ``none`` (and lm-eval's hf
model, which shares nothing), side by side in one run, through the engine (``run_eval``), same models, prompts.

    python benchmarks/prefix_tree.py [--questions 4] [--samples 4] [--hidden 256 --layers 6] [--models phi,llama,...]

Sweeps: HotpotQA with 10 distractors and the gold pair at every slot (0..10) and at first/middle/last; the
phone-book needle over 3 lengths x 5 depths. Random-weight models of the given size on CPU (``phi`` at the
defaults is the mid-size Phi, d 256, 6 layers). Prints prompt tokens, the tokens each mode prefilled (prefixes
included, pads included), the tree's distinct tokens, generation seconds (model loading excluded), whether
every mode's generations equal ``none``'s, and whether the snapshots stayed within their memory budget."""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from harness.backends.loading import load_backend
from harness.engine import run_eval
from harness.engine.config import RunConfig
from harness.tiny import build_tokenizer, make_tiny_model
from harness.tools.bench import benchmark_parser

MODES = ("auto", "tree-rows", "tree-block", "batch", "none")
HF_ARCHS = ("phi", "llama", "mamba")  # what lm-eval's hf model loads (Phi-Mamba is this project's own class)


def sweeps(a) -> dict[str, dict]:
    return {
        "hotpotqa k=10, gold at every slot + first/middle/last": dict(
            task="hotpotqa", data="fixture", limit=a.questions,
            task_args={"distractors": 10, "positions": [str(p) for p in range(11)] + ["first", "middle", "last"]}),
        f"needle {len(a.lengths.split(','))} lengths x 5 depths": dict(
            task="needle", task_args={"lengths": [int(x) for x in a.lengths.split(",")],
                                      "depths": [0.0, 0.25, 0.5, 0.75, 1.0], "samples": a.samples}),
    }


def run_mode(backend, model_dir, out: Path, sweep: dict, mode: str, a) -> tuple[dict, dict]:
    cfg = RunConfig(model=model_dir, device="cpu", dtype="float32", output=str(out), batch_size=str(a.batch_size),
                    max_new_tokens=a.max_new_tokens, prefix_reuse=mode, **sweep)
    res = run_eval(cfg, backend=backend, progress=False)
    rows = [json.loads(l) for l in open(out / "samples.jsonl")]
    return res, {r["key"]: r for r in rows}


def lm_eval_hf(model_dir: str, rows: dict, stop, a) -> tuple[dict | None, float | None]:
    """The same prompts through lm-eval's hf model (generate_until; model time only)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import run_lm_eval

    keys = sorted(rows)
    texts, seconds = run_lm_eval(model_dir, [rows[k]["prompt"] for k in keys], a.max_new_tokens, str(a.batch_size),
                                 stop=stop)
    return (None, None) if texts is None else (dict(zip(keys, texts)), seconds)


def main(argv=None) -> None:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--models", default="phi,llama,mamba,phi-mamba,hybrid-phi-mamba")
    ap.add_argument("--questions", type=int, default=4, help="HotpotQA questions (14 prompts each)")
    ap.add_argument("--samples", type=int, default=4, help="needle samples (15 prompts each)")
    ap.add_argument("--lengths", default="256,512,1024", help="needle book lengths in tokens")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--no-lm-eval", action="store_true", help="skip lm-eval's hf model")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("harness").setLevel(logging.WARNING)
    tok = build_tokenizer()
    print(f"CPU, {torch.get_num_threads()} threads; random models d={a.hidden} L={a.layers}; batch {a.batch_size}, "
          f"{a.max_new_tokens} new tokens\n")
    print("| sweep | model | mode | prompt tokens | prefilled | prefilled / tree | prefilled / batch's | generate s | "
          "speedup vs batch | same as none | snapshots within budget |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    goals = []
    with tempfile.TemporaryDirectory() as d:
        for arch in a.models.split(","):
            model_dir = str(make_tiny_model(Path(d) / arch, arch, tokenizer=tok, hidden=a.hidden, layers=a.layers,
                                            init_std=0.2))
            backend = load_backend(model_dir, "cpu", "float32")
            for s_name, sweep in sweeps(a).items():
                warm = dict(sweep, limit=1) if sweep["task"] == "hotpotqa" else \
                    dict(sweep, task_args=dict(sweep["task_args"], samples=1))
                warm_dir = Path(d) / f"warm-{arch}-{sweep['task']}"
                run_mode(backend, model_dir, warm_dir, warm, "none", a)  # first-call costs out of the timings
                got = {m: run_mode(backend, model_dir, Path(d) / f"{arch}-{s_name[:6]}-{m}", sweep, m, a)
                       for m in MODES}
                t = {m: r["timings"] for m, (r, _) in got.items()}
                ref = {k: r["generation"] for k, r in got["none"][1].items()}
                for m in MODES:
                    x = t[m]
                    same = {k: r["generation"] for k, r in got[m][1].items()} == ref
                    within = x.get("prefix_snapshot_peak_bytes", 0) <= x.get("prefix_memory_bytes", 0) \
                        if x["prefix_reuse"] == "tree" else "-"
                    used = _ran(x) + (f" (asked {m})" if _ran(x) != m else "")
                    print(f"| {s_name} | {arch} | {used} | {x['prompt_tokens']} | {x['prefill_tokens']} | "
                          f"{x['prefill_tokens'] / x['tree_tokens']:.2f} | "
                          f"{x['prefill_tokens'] / t['batch']['prefill_tokens']:.2f} | {x['generate_s']:.2f} | "
                          f"{t['batch']['generate_s'] / x['generate_s']:.2f}x | {same} | {within} |", flush=True)
                if arch in HF_ARCHS and not a.no_lm_eval:
                    rows = got["none"][1]
                    stop = got["none"][0]["config"]["stop"] or _task_stop(sweep["task"])
                    texts, seconds = lm_eval_hf(model_dir, rows, stop, a)
                    if texts is not None:
                        agree = sum(texts[k].strip() == ref[k].strip() for k in ref)
                        print(f"| {s_name} | {arch} | lm-eval hf | {t['none']['prompt_tokens']} | (all, padded) | | | "
                              f"{seconds:.2f} | {t['batch']['generate_s'] / seconds:.2f}x | {agree}/{len(ref)} agree "
                              "(stripped) | - |", flush=True)
                tree, batch = t["tree-rows"], t["batch"]
                forced = {m: t[m]["generate_s"] for m in MODES if m != "auto" and _ran(t[m]) == m}
                fastest = min(forced, key=forced.get)
                print(f"|  |  | auto ran {_ran(t['auto'])}; fastest forced plan: {fastest} |  |  |  |  |  |  |  |  |",
                      flush=True)
                if tree["prefix_reuse"] == "tree":
                    goals.append((s_name, arch, tree, batch, _ran(t["auto"]), fastest, forced))
    print("\nGoals (met / missed):")
    for s_name, arch, tree, batch, auto, fastest, forced in goals:
        ratio_tree = tree["prefill_tokens"] / tree["tree_tokens"]
        ratio_batch = tree["prefill_tokens"] / batch["prefill_tokens"]
        if s_name.startswith("hotpotqa"):
            line = (f"prefilled {ratio_tree:.2f}x the tree's tokens (goal <= 1.05: {_met(ratio_tree <= 1.05)}), "
                    f"{ratio_batch:.2f}x batch's (goal <= 0.55: {_met(ratio_batch <= 0.55)})")
            if arch == "phi":
                speed = batch["generate_s"] / tree["generate_s"]
                line += f", {speed:.2f}x faster than batch (goal >= 1.6 on the mid-size Phi: {_met(speed >= 1.6)})"
        else:
            fewer = batch["prefill_tokens"] / tree["prefill_tokens"]
            line = f"{fewer:.2f}x fewer prefilled tokens than batch (goal >= 3: {_met(fewer >= 3)})"
        close = forced.get(auto, float("inf")) <= 1.1 * forced[fastest]
        line += f"; auto ran {auto}, the fastest measured is {fastest} (goal: auto within 10%: {_met(close)})"
        print(f"- {s_name}, {arch}: {line}")


def _ran(timings: dict) -> str:
    return f"tree-{timings['tree_prefill']}" if timings.get("tree_prefill") else timings["prefix_reuse"]


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _task_stop(task: str):
    from evals import get_task

    return get_task(task).stop


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - t0:.0f} s)")
