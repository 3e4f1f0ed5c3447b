"""The IsTree live evaluation's decode loop, on the traces of a model that solves the task.

    python benchmarks/live_eval.py [--arch mamba] [--nodes 64] [--samples 128] [--batch 64] [--repeats 2]

A trained retrieval cell's live evaluation generates every held-out sample greedily with the tool live (at
n = 64 ~1,500 tokens and ~240 tool calls a sample: a call every ~7 tokens, its answer one token). An untrained
model writes no such trace, so this runs the cell's fresh model (its real forward passes, batch, cache and
state) with each choice set to the sample's gold trace; the tool still answers every search, and a sample ends
with its right label only if every answer was the gold one. The samples run through the step backends' planner
(``--batch`` rows at a time, prompts prefilled whole), as the trainer's evaluation runs them. Side by side,
alternating, in one run:

  as it runs        the batching the planner chooses (continuous where the model's state is fixed-size; on a
                    CPU static for key/value states), one token a row a step (a tool's answer is fed the step
                    after its call), the searches in this process (IsTree's patterns come from a closed grammar)
  static batches    each batch of --batch samples decoded to its longest row before the next starts
  continuous batches
                    rows refilled as others finish (continuous batching), asked for
  blocks split      the loop feeding a step's answers as ragged blocks, which a recurrent model splits into a
                    call a token (the other rows idle in those calls)
  worker searches   the searches in killable worker processes, on threads (what a model-written pattern needs)
  as before         static batches, blocks split and worker searches: how the loop ran until these changes
  the loop alone    "as it runs" with a model that costs nothing: the decode loop's own share

Prints each row's seconds (median of ``--repeats``), model calls and steps, and its time over "as it runs"."""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

from evals.base import ToolSpec
from evals.istree import IsTree
from harness.backends.base import GenRequest
from harness.backends.hf import TransformersBackend
from harness.backends.planner import generate_all
from harness.tools.bench import benchmark_parser
from harness.training.config import TrainConfig
from harness.training.data import TrainTask
from harness.training.gold_trace import GoldTrace, gold_continuations
from harness.training.grid import grid_cells
from harness.training.step import new_model
from retrieval.search import shared_searcher


def main():
    ap = benchmark_parser(__doc__)
    ap.add_argument("--arch", default="mamba", choices=("mamba", "hybrid", "transformer"))
    ap.add_argument("--size", default="0.5M")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--samples", type=int, default=128, help="held-out samples")
    ap.add_argument("--batch", type=int, default=64, help="rows decoded at a time (the trainer's default: 256)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", default="all", help="the rows to run, by name, comma-separated (\"as it runs\" "
                                                     "always runs: the others are timed against it)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cell = next(c for c in grid_cells("paper", TrainConfig(), Path("unused"))
                if (c.arch, c.setup, c.nodes) == (a.arch, "retrieval", 64))
    cell = dataclasses.replace(cell, nodes=a.nodes, size=a.size)  # the paper grid's settings at any size
    train_task = TrainTask(cell)
    torch.manual_seed(cell.seed)
    tok = train_task.tokenizer()
    backend = TransformersBackend("fresh", model=new_model(cell, train_task), tok=tok, device="cpu",
                                  dtype="float32")
    calls = []  # the model's forward passes, a split block's included
    backend.model.register_forward_pre_hook(lambda *_: calls.append(1))
    task = IsTree(nodes=a.nodes, setup="retrieval", samples=a.samples)
    instances = task.instances(task.load())
    gold = gold_continuations(task, tok)
    continuations = list(gold.values())
    print(f"{cell.name} ({sum(p.numel() for p in backend.model.parameters()):,} parameters), {a.samples} samples "
          f"at batch {a.batch}: {statistics.mean(map(len, continuations)):.0f} tokens and "
          f"{statistics.mean(c.count(tok.convert_tokens_to_ids('[ENDSEARCH]')) for c in continuations):.0f} "
          f"tool calls a sample (gold traces), {a.threads} threads")

    def run(model, blocks_whole, worker_searches, batching):
        tools = [task.make_tool(i, ToolSpec(enabled=True, max_calls=None)) for i in instances]  # as the engine's
        for t in tools:
            if worker_searches:
                t.searcher, t.waits = shared_searcher(1.0), True
        requests = [GenRequest(prompt=i.text, max_new_tokens=task.max_new_tokens(True), stop=task.stop, tool=t)
                    for i, t in zip(instances, tools)]
        stepper = GoldTrace(model, gold, tok, blocks_whole)
        calls.clear()
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = generate_all(stepper, requests, a.batch, prefix_reuse="none", batching_asked=batching)
            out = gen.results(len(requests))
        seconds = time.perf_counter() - t0
        assert batching == "auto" or gen.plan.batching == batching, gen.plan.batching_reason
        right = all(r.stop_string == i.answer for r, i in zip(out, instances))
        return seconds, len(calls), stepper.stats["decode_steps"], right, [r.token_ids for r in out], \
            gen.plan.batching

    configs = {"as it runs": (backend, False, False, "auto"), "static batches": (backend, False, False, "static"),
               "continuous batches": (backend, False, False, "continuous"),
               "blocks split": (backend, True, False, "auto"), "worker searches": (backend, False, True, "auto"),
               "as before": (backend, True, True, "static"), "the loop alone": (None, False, False, "auto")}
    if a.batch >= a.samples:  # one batch: nothing to refill
        configs = {k: v for k, v in configs.items() if v[3] == "auto" or k == "as before"}
    if a.rows != "all":
        wanted = {"as it runs", *(r.strip() for r in a.rows.split(","))}
        if wanted - set(configs):
            ap.error(f"--rows: {', '.join(sorted(wanted - set(configs)))} is not a row; rows: {', '.join(configs)}")
        configs = {k: v for k, v in configs.items() if k in wanted}
    measured = {name: [] for name in configs}
    for rep in range(a.repeats):
        for name, setup in (configs.items() if rep % 2 == 0 else reversed(configs.items())):
            measured[name].append(run(*setup))
            print(f"  [{rep + 1}/{a.repeats}] {name}: {measured[name][-1][0]:.2f} s", flush=True)
    base = statistics.median(r[0] for r in measured["as it runs"])
    print("\n| loop | batching | seconds (median) | model calls | steps | over 'as it runs' | samples right |")
    print("|---|---|--:|--:|--:|--:|---|")
    for name, runs in measured.items():
        s = statistics.median(r[0] for r in runs)
        print(f"| {name} | {runs[0][5]} | {s:.2f} | {runs[0][1]:,} | {runs[0][2]:,} | {s / base:.2f}x | "
              f"{all(r[3] for r in runs)} |")
    same = len({repr(r[4]) for runs in measured.values() for r in runs}) == 1
    print(f"\nevery row wrote the same tokens: {same}")


if __name__ == "__main__":
    main()
