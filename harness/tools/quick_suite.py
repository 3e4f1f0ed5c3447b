"""``python -m harness.doctor --suite gpu --quick``: the decisive GPU numbers in one call of at most
``BUDGET_S`` seconds (a lent GPU gives 10 minutes a command), the most decisive first.

Each step runs in a child process under a hard time limit, the smaller of its own cap and what is left of the
budget (less a reserve for the table); a step that would not get ``MIN_STEP_S`` is skipped with that reason, a
step stopped at its limit keeps the rows it wrote, and the report (``report.json``, ``report.md``) is rewritten
after every step, so a call cut off still leaves what it measured. On a GPU the models have the paper's and the
released checkpoints' shapes; without one the same steps run at tiny sizes on the CPU (the tests run them, so
the suite cannot rot between GPU sessions) and the goals are marked as not applicable.

The steps: (a) the trainer's Triton scan against its PyTorch scan, forward and backward, at the IsTree lengths
in float32 and in bf16 (the trainer's autocast), times and largest differences, then where one 0.5M Mamba
training step at n=64 retrieval spends its time (the scan's and the convolution's kernels); (b) training steps of the 0.5M
Transformer, Mamba and hybrid at n=16 direct and n=64 retrieval through the trainer's own step and data
(``measure_cell``) and the paper grid's projected hours from them; (c) K copies of a short and a long cell trained
at once on one device (``harness.training.sharing``), the K each supports, and the grid's planned hours with it;
(d) the all-slot HotpotQA sweep under the planner's ``auto`` and every forced plan on Phi- and Phi-Mamba-shaped
models, 3 times in alternating order, outputs compared and auto's regret against the fastest forced plan judged;
(e) decode tokens/s against the memory-bandwidth bound at batch 1 and 64 with a 2k context, eager, from graphs
and from graphs of the inductor-compiled step (``--cuda-graphs compiled``), and one batch-1 step of the graphed
and compiled ones profiled (kernels a step, the top ones, the attention kernel)."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from harness.files import write_atomic
from harness.procs import project_env
from harness.ops.selective_scan import SelectiveScan
from harness.tiny import build_tokenizer
from harness.tools.checks import check_cuda_graphs, decode_rows, environment
from harness.tools.fixture_prompts import fixture_prompts
from harness.tools.gpu_suite import model_path, plan_sweep
from harness.tools.step_profile import profile_decode, profile_step
from harness.training.config import TrainConfig
from harness.training.data import TrainingBatches, TrainTask
from harness.training.grid import GRID_DEFAULTS, GRIDS, cell_parameters, measure_cell, measure_live_eval
from harness.training.sharing import sharing_table, supported_gain
from harness.training.step_graphs import check_graphed_steps

BUDGET_S = 510  # the whole call on an H100, start-up and model building included: 10-minute calls, with margin
MIN_STEP_S = 20  # a step given less than this is skipped: it could not start its models and measure
RESERVE_S = 10  # kept back from the last step for the table
# Steps in the order they decide things, each with its cap in seconds (a GPU's; on a CPU the sizes are tiny).
# decode: eager and graphed steps first, then the compiled ones (their first steps compile: ~minutes on a GPU);
# scan: 15 s more for the splits' side passes (four compiles) and their timings, 10 more for the profiled step's
# tiles timed (scan_tuning: the step-by-step layout's split kernels compile there)
STEPS = {"scan": 100, "trainer": 240, "sharing": 100, "sweep": 110, "decode": 330}
# what a call runs unless --part names steps: the sweep only when asked (by its own timings no plan reaches 1.3x
# over ``batch`` for Phi on a GPU; its minutes go to the trainer's graphed cells)
DEFAULT_STEPS = ["scan", "trainer", "sharing", "decode"]
GOALS = {"scan_conv_ms": 30.0, "grid_h100_hours": 24.0, "grid_h100_hours_1m": 5.0, "auto_regret": 0.05,
         "decode_of_bound_b1": 0.5, "decode_of_bound_b64": 0.7}
PAPER_RUNS = 81


def sizes(cuda: bool) -> dict:
    """What each step measures: the real shapes on a GPU, tiny ones on a CPU."""
    if cuda:
        # the scan at the paper models' channels (0.5M: 128; 1M, 2M: 256) and its cells' lengths
        # (each channel count's table tile timed again at its longest length in bf16 with time cut in splits)
        return {"scan": {"lengths": [48, 615, 2535], "batch": 64, "channels": [128, 256], "states": 16, "repeats": 3,
                         "splits": [2, 4, 8],
                         # the 0.5M Mamba: d 64, expand 2, so 128 channels
                         "profile": {"size": "0.5M", "nodes": 64, "setup": "retrieval", "batch": 64}},
                # each paper size measured (smallest, largest, then the middle): small models' steps are bound by
                # kernel launches, so step time does not scale with parameters
                # each cell: 2 warm-up steps (and 1 a further power of two of length), then 2 passes over 5
                # batches (the spread between passes: the noise)
                "trainer": {"sizes": ["0.5M", "2M", "1M"], "cells": [(16, "direct"), (64, "retrieval")], "batch": 64,
                            "steps": 5, "passes": 2, "graph_steps": 8,
                            "graph_cells": [("transformer", 16, "direct"), ("mamba", 16, "direct"),
                                            ("hybrid", 16, "direct"), ("transformer", 64, "retrieval"),
                                            ("hybrid", 64, "retrieval")],
                            "draws": 8,
                            # packed rows against the padded steps above, the scan in its timed tile, attention
                            # in one varlen call (a GPU's --packing auto pads: packed ran slower before both)
                            "packed": [(arch, "0.5M", 64, "retrieval") for arch in ("mamba", "hybrid", "transformer")],
                            # one evaluation batch of a retrieval cell's live evaluation on gold traces, timed last
                            "live": {"arch": "mamba", "size": "0.5M", "nodes": 64, "setup": "retrieval"}},
                # the long cell the hours go to, then a launch-bound short one, K copies after one barrier (the
                # long first: on an H100 the short cell's K = 1, 4, 8 took the step's 100 s, graphed and gaining
                # nothing, 1.00x at K = 4 and 8)
                "sharing": {"cells": {"long": {"arch": "mamba", "size": "0.5M", "nodes": 64, "setup": "retrieval"},
                                      "short": {"arch": "transformer", "size": "0.5M", "nodes": 16,
                                                "setup": "direct"}},
                            "ks": [1, 4, 8], "batch": 64, "window_s": 5.0},
                "sweep": {"questions": 4, "slots": 11, "size": "real", "new": 16, "repeats": 3},
                "decode": {"context": 2048, "batches": [1, 64], "steps": 8, "size": "real"}}
    return {"scan": {"lengths": [24], "batch": 1, "channels": [16], "states": 4, "repeats": 1,  # interpreted: slow
                     "splits": [2],
                     "profile": {"size": "smoke", "nodes": 4, "setup": "direct", "batch": 1}},
            "trainer": {"sizes": ["smoke"], "cells": [(4, "direct"), (6, "retrieval")], "batch": 2, "steps": 1,
                        "graph_steps": 5, "graph_cells": [("mamba", 4, "direct")],
                        "draws": 2, "live": {"arch": "mamba", "size": "smoke", "nodes": 4, "setup": "retrieval"},
                        "live_settings": {"eval_batch_size": 4}, "packed": [("mamba", "smoke", 6, "retrieval")]},
            "sharing": {"cells": {"short": {"arch": "mamba", "size": "smoke", "nodes": 4, "setup": "direct"}},
                        "ks": [1, 2], "batch": 2, "window_s": 0.5},
            "sweep": {"questions": 2, "slots": 3, "size": "tiny", "new": 8, "repeats": 3},
            "decode": {"context": 64, "batches": [1, 4], "steps": 2, "size": "tiny"}}


# -- the steps (each runs in its own child process; ``emit`` saves its rows as it goes) ---------------------------
def scan_step(device: str, spec: dict, emit) -> None:
    """The Triton scan against the PyTorch scan, forward and backward, per channel count, length and precision:
    the tile ``scan_triton.TILES`` gives those channels and the table's tile of the other layout, timed side by
    side (the best of ``repeats`` after a warm-up on a GPU), and the largest relative difference of each over the
    output and every gradient. At each channel count's longest length in bf16, the table's tile again with time
    cut in each of ``splits`` (a row each, named "splits: ...")."""
    from harness.ops import scan_triton  # lazy: imports triton, which a CPU install may lack

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    n, b = spec["states"], spec["batch"]
    for d, length in ((d, length) for d in spec["channels"] for length in spec["lengths"]):
        tile = scan_triton.current_tile(d)
        other = (scan_triton.table_tiles(d)[1:] or [tile])[0]
        for dtype in ("float32", "bfloat16"):
            g = torch.Generator().manual_seed(length)
            act = getattr(torch, dtype)  # the activations autocast hands the scan; step sizes stay float32
            u, z = (torch.randn(b, d, length, generator=g).to(device, act) for _ in range(2))
            dt = (torch.rand(b, d, length, generator=g) * 0.1 + 0.001).to(device)
            B, C = (torch.randn(b, n, length, generator=g).to(device, act) for _ in range(2))
            A = (-torch.arange(1, n + 1.0).expand(d, n)).contiguous().to(device)
            D = torch.ones(d, device=device)
            weight = torch.randn(b, d, length, generator=g).to(device)
            out, secs = {}, {}
            runs = [("triton", scan_triton.TritonScan, tile), ("other", scan_triton.TritonScan, other),
                    ("torch", SelectiveScan, tile)]
            if dtype == "bfloat16" and length == max(spec["lengths"]):
                runs += [(k, scan_triton.TritonScan, (*tile[:4], k)) for k in spec["splits"]]
            for name, scan, run_tile in runs:
                best = math.inf
                with scan_triton.tiled(*run_tile):
                    for _ in range(spec["repeats"] + (device == "cuda")):
                        leaves = [t.detach().requires_grad_() for t in (u, dt, A, B, C, D, z)]
                        sync()
                        t = time.perf_counter()
                        y = scan.apply(*leaves)
                        grads = torch.autograd.grad((y.float() * weight).sum(), leaves)
                        sync()
                        best = min(best, time.perf_counter() - t)
                out[name], secs[name] = [y.detach().float(), *(x.float() for x in grads)], best
            worst = {name: max(((x - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
                               for x, r in zip(out[name], out["torch"])) for name in out if name != "torch"}
            tolerance = scan_triton.TOLERANCE[dtype]
            emit({"channels": d, "tokens": length, "batch": b, "dtype": dtype, "tile": scan_triton.tile_name(tile),
                  "triton_ms": round(1e3 * secs["triton"], 2), "torch_ms": round(1e3 * secs["torch"], 2),
                  "speedup": round(secs["torch"] / secs["triton"], 2),
                  "max_rel_diff": float(f"{worst['triton']:.2e}"), "tolerance": tolerance,
                  "other_tile": scan_triton.tile_name(other), "other_ms": round(1e3 * secs["other"], 2),
                  "other_max_rel_diff": float(f"{worst['other']:.2e}"),
                  "tile_over_other": round(secs["other"] / secs["triton"], 2),
                  "ok": worst["triton"] <= tolerance and worst["other"] <= tolerance})
            for k in (name for name in out if isinstance(name, int)):
                _, split_count = scan_triton.splits_of(math.ceil(length / tile[1]), k)
                emit({"name": f"splits: {d} channels {length} tokens {dtype}", "tile": scan_triton.tile_name(tile),
                      "channels": d, "splits": split_count, "ms": round(1e3 * secs[k], 2),
                      "over_table_tile": round(secs["triton"] / secs[k], 2),
                      "max_rel_diff": float(f"{worst[k]:.2e}"), "tolerance": tolerance, "ok": worst[k] <= tolerance})
    # where a Mamba training step's time goes: the scan's and the convolution's kernels against the rest, the
    # scan in the tile its launch class takes (on a GPU the fastest there, timed: scan_tuning)
    emit(_profile_row(spec["profile"], device))


def _profile_row(cell: dict, device: str) -> dict:
    """One profiled training step of the Mamba ``cell`` (``profile_step``) as the scan step's row."""
    cfg = TrainConfig(arch="mamba", size=cell["size"], nodes=cell["nodes"], setup=cell["setup"],
                      report_to="none").resolved()
    p = profile_step(cfg, cell["batch"], device)
    fam = p["families_ms"]
    return {"name": f"profile: mamba {cell['size']} n={cell['nodes']} {cell['setup']}, batch {cell['batch']}, "
                    f"{p['tokens']} tokens", "scan": p["scans"][0]["scan"], "tile": p["scans"][0].get("tile"),
            "conv": p["scans"][0].get("conv", "torch"), "step_ms": round(p["total_ms"], 2),
            "scan_ms": round(fam["scan"], 2), "conv_ms": round(fam["convolution"], 2),
            "scan_conv_ms": round(fam["scan"] + fam["convolution"], 2),
            "top": "; ".join(f"{k[:40]} {ms:.1f}" for k, ms, _ in p["top"][:5])}


def trainer_step(device: str, spec: dict, emit) -> None:
    """First the gate: training steps from CUDA graphs against eager ones under a moving learning rate (on a CPU:
    the same code with capture off). Then steps of each architecture at two cells per size through the trainer's
    own step and data, eager and as ``--cuda-graphs auto`` would run them, and after each size the paper grid's
    projected hours from what is measured so far (a row with ``projection``; the last one counts), so a step
    cut at its limit still projects. Then the ``packed`` cells' steps on packed rows against their padded ones.
    Last, one evaluation batch of a retrieval cell's live evaluation (``measure_live_eval``), scaled to the grid's
    retrieval cells."""
    dev = torch.device(device)
    for arch, nodes, setup in spec["graph_cells"]:
        cell = TrainConfig(arch=arch, size=spec["sizes"][0], nodes=nodes, setup=setup, report_to="none").resolved()
        emit({"name": f"graphed training steps == eager ({cell.name})",
              **check_graphed_steps(cell, dev, spec["batch"], steps=spec["graph_steps"])})
    measured = {"off": {}, "auto": {}}  # padded eager steps, and the steps the run takes (its default plan)
    for size in spec["sizes"]:
        for arch in ("transformer", "mamba", "hybrid"):
            for nodes, setup in spec["cells"]:
                row = {"arch": arch, "size": size, "cell": f"n={nodes} {setup}", "batch": spec["batch"]}
                key = arch, size, nodes, setup
                for plan in ("off", "auto"):
                    cell = TrainConfig(arch=arch, size=size, nodes=nodes, setup=setup, report_to="none",
                                       cuda_graphs=plan, packing=plan).resolved()
                    m = measure_cell(cell, dev, spec["batch"], spec["steps"], draws=spec["draws"],
                                     busy=plan == "off", passes=spec.get("passes", 1))
                    if plan == "off":
                        row.update(padded_tokens=round(m["tokens"]), step_s=round(m["step_s"], 4),
                                   spread=round(m["spread"], 2), samples_per_s=round(spec["batch"] / m["step_s"], 1),
                                   **({"busy_s": round(m["busy_s"], 4)} if m["busy_s"] is not None else {}))
                        measured["off"][key] = measured["auto"][key] = m
                        continue
                    how = "graphs" if m["graphs"] else "packed" if m["packing"] == "on" else "eager"
                    # cores of data generation the planned step rate needs (a run gives a cell 4 workers)
                    data = spec["batch"] / m["step_s"] * m["gen_s_per_sample"]
                    row.update(plan=how, plan_step_s=round(m["step_s"], 4), speedup=round(row["step_s"] / m["step_s"], 2),
                               data_cores=round(data, 2), data_binds=data > 4)
                    if m["step_s"] < row["step_s"]:  # auto keeps a cell whose graphs are slower eager
                        measured["auto"][key] = m
                emit(row)
        hours, how = grid_projection(measured["off"], spec, dev)
        planned, _ = grid_projection(measured["auto"], spec, dev)
        busy = (grid_projection(measured["off"], spec, dev, "busy_s")[0]
                if all(m["busy_s"] is not None for m in measured["off"].values()) else None)
        spread = max(m["spread"] for m in (*measured["off"].values(), *measured["auto"].values()))
        emit({"projection": True, "grid_hours": round(hours, 1), "planned_grid_hours": round(planned, 1),
              **({"busy_grid_hours": round(busy, 1)} if busy is not None else {}),
              "planned_grid_hours_1m": round(planned / 5, 1), "spread": round(spread, 2),
              "how": how + "; planned: each cell's step as the run takes it by default (CUDA graphs where its "
                           "batch shapes repeat and the graphed step is faster, packed rows on a CPU where they save "
                           "10% of the tokens; --cuda-graphs auto also needs graphs exact: the graph gates)"})
    for arch, size, nodes, setup in spec.get("packed", []):  # what packed rows gain where a run does not pack
        cell = TrainConfig(arch=arch, size=size, nodes=nodes, setup=setup, report_to="none", packing="on").resolved()
        m = measure_cell(cell, dev, spec["batch"], spec["steps"], draws=spec["draws"], passes=spec.get("passes", 1))
        padded = measured["off"][arch, size, nodes, setup]
        emit({"name": f"packed rows: {arch} {size} n={nodes} {setup}", "batch": spec["batch"],
              "padded_step_s": round(padded["step_s"], 4), "packed_step_s": round(m["step_s"], 4),
              "packed_over_padded": round(padded["step_s"] / m["step_s"], 2),
              "spread": round(max(m["spread"], padded["spread"]), 2), "packing": m["packing"],
              "scans": "; ".join(f"{r['scan']} {r.get('tile') or ''}".strip() for r in m["scans"])})
    if spec.get("live"):  # last: the part whose length is least known
        cell = TrainConfig(**spec["live"], report_to="none", **spec.get("live_settings", {})).resolved()
        m = measure_live_eval(cell, dev, spec.get("live_samples"))
        paper = GRID_DEFAULTS["paper"]
        retrieval_cells = PAPER_RUNS // len(GRIDS["paper"]["setup"])
        emit({"live": True, "cell": cell.name, **{k: round(v, 4) for k, v in m.items()},
              "retrieval_cells_hours": round(m["s_per_sample"] * paper["eval_samples"] * retrieval_cells / 3600, 2),
              "static_retrieval_cells_hours": round(m["static_run_s"] / m["run_s"] * m["s_per_sample"]
                                                    * paper["eval_samples"] * retrieval_cells / 3600, 2),
              "how": f"{m['samples']} test samples of {cell.name} at batch {m['batch']}, its fresh model writing "
                     f"each sample's gold trace (a trained model's lengths and tool calls; the tool live); the "
                     f"whole evaluation's decode steps replayed over its test samples' traces (rows refilled as "
                     f"they finish; static: each batch to its longest row) at the timed seconds a step, for "
                     f"{retrieval_cells} retrieval cells"})


def grid_projection(measured: dict, spec: dict, device: torch.device, key: str = "step_s") -> tuple[float, str]:
    """The paper grid's hours, one run at a time at batch 64: each cell's step from its architecture and size's
    two measured cells by the floor-or-proportional rule (scaled to batch 64; a size not measured is scaled from
    the nearest measured one by trainable parameters), times 5M/64 steps, plus 50 teacher-forced evaluations of
    5,000 samples (a forward pass taken as a third of a step). A run of 1M samples (the paper's stated minimum)
    takes a fifth of that: its steps and its evaluations every 100k both scale with the samples.

    The rule: a cell of mean padded length x takes max(s0, s1 * x / l1), the short measured cell's step as a
    floor (a small step is bound by kernel launches, not tokens) and the long one's scaled in proportion above
    it. A straight line between the two would put the middle cells on the line from a launch-bound floor to a
    token-bound step, above both (measured: 140 h against 155 h for one H100 grid). ``key``: the step's
    seconds to project (``busy_s``: its kernels' time, the GPU-busy hours)."""

    paper, grid = GRID_DEFAULTS["paper"], GRIDS["paper"]
    batch, scale = 64, 64 / spec["batch"]
    tokens = {}
    for nodes in grid["nodes"]:
        for setup in grid["setup"]:
            cfg = TrainConfig(nodes=nodes, setup=setup, report_to="none").resolved()
            source = TrainingBatches(TrainTask(cfg), spec["batch"], cfg.seed, 0)
            tokens[nodes, setup] = sum(source.pool(k)[0][0].shape[1] for k in range(spec["draws"])) / spec["draws"]
    sizes = list(dict.fromkeys(size for _, size, *_ in measured))
    order = list(grid["size"])
    total, scaled = 0.0, set()
    for arch in grid["arch"]:
        for size in grid["size"]:
            have = size if size in sizes else min(sizes, key=lambda s: abs(order.index(s) - order.index(size))
                                                  if s in order else 0)
            if have != size:
                scaled.add(size)
            (l0, s0), (l1, s1) = sorted((m["tokens"], m[key]) for (a, z, *_), m in measured.items()
                                        if a == arch and z == have)
            for nodes in grid["nodes"]:
                for setup in grid["setup"]:
                    x = tokens[nodes, setup]
                    step = max(s0, s1 * x / max(l1, 1e-9)) * scale
                    ratio = cell_parameters(arch, size, nodes) / cell_parameters(arch, have, nodes)
                    steps = paper["samples"] / batch
                    evals = paper["samples"] // paper["eval_every"] * paper["eval_samples"] / batch
                    total += max(step, 0.0) * ratio * (steps + evals / 3) / 3600
    where = "" if device.type == "cuda" else " (CPU, tiny models: not the paper's sizes)"
    scaled_note = f"; {', '.join(sorted(scaled))} scaled by parameters from a measured size" if scaled else ""
    return total, (f"{PAPER_RUNS} runs of 5M samples at batch 64, one at a time (1M samples: a fifth), each cell's "
                   f"step from its architecture and size's two measured cells: the shorter one's step as a floor, "
                   f"the longer one's in proportion to padded tokens above it{scaled_note}{where}")


def sharing_step(device: str, spec: dict, emit) -> None:
    """K copies of a short and a long cell trained at once (``harness.training.sharing``: one barrier after their
    warm-up, one fixed window, their CPU and their data's counted); last, the K each cell supports."""
    best = sharing_table(spec["cells"], spec["ks"], device, spec["batch"], spec["window_s"], emit,
                         ways=("streams", "processes"))
    emit({"supported": True, "best": best})


SWEEP_PLANS = ("auto", "tree-rows", "tree-block", "batch", "none")


def sweep_step(device: str, spec: dict, emit) -> None:
    """The all-slot HotpotQA sweep through ``auto`` and every forced plan on Phi and Phi-Mamba shapes, repeated
    in alternating order: auto's regret against the fastest forced plan."""

    slots = ",".join(str(k) for k in range(spec["slots"]))
    prompts = fixture_prompts(spec["slots"] - 1, spec["questions"], positions=slots)
    dtype = "bfloat16" if device == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as d:
        tok = build_tokenizer()
        for arch in ("phi", "phi-mamba"):
            path = model_path(Path(d), arch, spec["size"], tok)
            for row in plan_sweep(path, arch, device, dtype, prompts, spec["new"], plans=SWEEP_PLANS,
                                  repeats=spec["repeats"]):
                emit(row)


def decode_step(device: str, spec: dict, emit) -> None:
    """Decode tokens/s of Phi (transformers) and Phi-Mamba against the memory-bandwidth bound, eager and from
    CUDA graphs (Phi's also attending over the filled positions only), after the graphs' parity with the eager
    step (a speed of a wrong step decides nothing); then the compiled step's parity and speed, last: its first
    steps compile, and a cut-off leaves the rows before."""
    cuda = device == "cuda"
    for compiled in (False, True) if cuda else (False,):
        checks = [("compiled step", dict(compiled=True))] if compiled else \
            [("", {}), ("filled positions", dict(attention="filled"))]
        for what, how in checks if cuda else ():
            try:
                emit(check_cuda_graphs(device, **how))
            except Exception as e:  # the check's failure is a row; the timings after it still run
                emit({"name": f"CUDA graphs == eager{f' ({what})' if what else ''}", "same_tokens": False,
                      "ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})
        # the filled positions' attention (graphs reading the cache's filled part only) beside the capacity's
        modes = ("compiled",) if compiled else ("off", "on", "filled") if cuda else ("off",)
        for row in decode_rows(device, spec["size"], (spec["context"],), spec["steps"], tuple(spec["batches"]),
                               archs=("phi", "phi-mamba"), then=lambda arch, b: [decode_profile(arch, b, spec)],
                               modes=modes):
            emit(row)


def decode_profile(arch: str, backend, spec: dict) -> dict:
    """One batch-1 decode step as a run decodes by default (graphs where they are on), profiled: kernels a
    step, the top ones by time, the attention kernel that ran."""
    p = profile_decode(backend, spec["context"], batch=1)
    how = backend.describe().decode or "eager"
    return {"name": f"decode profile: {arch}, batch 1, {spec['context']} tokens, {how}",
            "kernels_per_step": p["kernels_per_step"], "ms_per_step": p["ms_per_step"],
            "attention": ", ".join(p["attention"]) or "none",
            "top": "; ".join(f"{name} {ms} ms x{n:g}" for name, ms, n in p["top"][:5])}


STEP_FUNCTIONS = {"scan": scan_step, "trainer": trainer_step, "sharing": sharing_step, "sweep": sweep_step,
                  "decode": decode_step}


def child(name: str, rows_path: str) -> None:
    """One step, its rows rewritten to ``rows_path`` after each (what a kill at the limit leaves)."""
    cuda = torch.cuda.is_available()
    rows: list = []

    def emit(row: dict) -> None:
        rows.append(row)
        write_atomic(Path(rows_path), json.dumps(rows, default=str))

    STEP_FUNCTIONS[name]("cuda" if cuda else "cpu", sizes(cuda)[name], emit)


# -- the parent: budget, report --------------------------------------------------------------------------------------
def run_quick(out: Path, budget: float = BUDGET_S, steps: list[str] | None = None,
              started: float | None = None) -> int:
    """The steps (``steps``, in that order; default ``DEFAULT_STEPS``, most decisive first) within ``budget`` seconds counted
    from ``started`` (a ``time.perf_counter()`` value: the process's start, so its imports count; default now);
    exit status 1 if a comparison failed."""
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ValueError(f"--budget {budget}: give a positive, finite number of seconds")
    t0 = time.perf_counter() if started is None else started
    cuda = torch.cuda.is_available()
    out.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(), "device": "cuda" if cuda else "cpu", "budget_s": budget,
              "sizes": sizes(cuda), "asked": list(steps or DEFAULT_STEPS), "steps": {}}

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - t0, 1)
        write_atomic(out / "report.json", json.dumps(report, indent=2, default=str))
        write_atomic(out / "report.md", render(report))

    for name in steps or DEFAULT_STEPS:
        cap = STEPS[name]
        left = budget - (time.perf_counter() - t0) - RESERVE_S
        limit = min(cap, left)
        if limit < MIN_STEP_S:
            report["steps"][name] = {"status": "skipped", "rows": [],
                                     "reason": f"{max(left, 0):.0f} s left of the {budget:.0f} s budget; it needs at "
                                               f"least {MIN_STEP_S} s"}
            save()
            continue
        report["steps"][name] = run_child(name, out / f"{name}.rows.json", limit)
        step = report["steps"][name]
        print(f"[{time.perf_counter() - t0:5.0f}s] {name}: {step['status']} ({step['seconds']} s, "
              f"{len(step['rows'])} rows)" + (f": {step['reason']}" if step.get("reason") else ""), flush=True)
        save()
    report["summary"] = summary(report)
    save()
    print(render(report))
    print(f"wrote {out / 'report.json'}, {out / 'report.md'}")
    failed = [r for s in report["steps"].values() for r in s["rows"] if r.get("ok") is False]
    return 1 if failed else 0


def run_child(name: str, rows_path: Path, limit: float) -> dict:
    """One step in a child process, killed at ``limit`` seconds: its status, time and the rows it wrote."""
    rows_path.unlink(missing_ok=True)
    # a CPU runs the Triton scan in Triton's interpreter (tiny sizes)
    env = project_env(**({} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}))
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "harness.tools.quick_suite", name, str(rows_path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=limit)
        status = "done" if proc.returncode == 0 else "failed"
        reason = None if proc.returncode == 0 else f"exit {proc.returncode}: {err.strip()[-800:]}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        status, reason = "stopped", f"stopped at its limit of {limit:.0f} s; the rows before are kept"
    rows = json.loads(rows_path.read_text()) if rows_path.exists() else []
    return {"status": status, "seconds": round(time.perf_counter() - t, 1), "limit_s": round(limit),
            "reason": reason, "rows": rows}


def grid_rows(steps: dict, gpu: bool, goal, rows: list) -> None:
    """The summary's grid numbers: hours eager and as planned (5M and 1M samples), with cells sharing the device,
    and whether data generation keeps up (``goal``: the summary's judge of one number)."""
    proj = [r for r in steps.get("trainer", {}).get("rows", []) if r.get("projection")]
    spread = proj[-1].get("spread", 0.0) if proj else 0.0
    goal("paper grid, H100-hours (81 runs)" if gpu else "paper grid, hours on this CPU (81 runs; the goal is an "
         "H100's, not judged here)", proj[-1]["grid_hours"] if proj else None, GOALS["grid_h100_hours"], higher=False,
         spread=spread)
    if proj and "busy_grid_hours" in proj[-1]:
        goal("paper grid, GPU-busy hours (the eager steps' kernel time: every launch gap removed)",
             proj[-1]["busy_grid_hours"], GOALS["grid_h100_hours"], higher=False, spread=spread)
    if proj and "planned_grid_hours" in proj[-1]:
        goal("paper grid, hours as runs take their steps by default (graphs where faster and exact, packed rows)",
             proj[-1]["planned_grid_hours"], GOALS["grid_h100_hours"], higher=False, spread=spread)
        goal("the same at 1M samples a run (the paper's stated minimum)", proj[-1].get("planned_grid_hours_1m"),
             GOALS["grid_h100_hours_1m"], higher=False, spread=spread)
        shared = [r["best"] for r in steps.get("sharing", {}).get("rows", []) if r.get("supported")]
        for way, how in (("processes", "processes"), ("streams", "CUDA streams of one process")):
            supported = supported_gain(shared[0], way) if shared and shared[0] else None
            if supported:
                k, gain = supported
                goal(f"paper grid, {'H100-' if gpu else 'CPU '}hours as planned with K={k} cells sharing the device "
                     f"in {how} (every cell taken at the smallest measured gain, {gain}x)",
                     round(proj[-1]["planned_grid_hours"] / gain, 1), GOALS["grid_h100_hours"], higher=False,
                     spread=spread)
    live = [r for r in steps.get("trainer", {}).get("rows", []) if r.get("live")]
    if live:
        rows.append({"number": f"live evaluation, hours for the paper grid's retrieval cells ({live[0]['how']}; "
                               "not in the hours above)", "value": live[0]["retrieval_cells_hours"], "goal": "in the 24",
                     "met": "n/a"})
    packed = [r for r in steps.get("trainer", {}).get("rows", []) if "packed_over_padded" in r]
    if packed and gpu:  # reported, not judged: whether a GPU's --packing auto should pack (harness/training/data.py)
        rows.append({"number": "packed rows over padded rows, eager (x faster; a GPU's --packing auto pads): "
                               + ", ".join(r["name"].removeprefix("packed rows: ") for r in packed),
                     "value": ", ".join(f"{r['packed_over_padded']:g} (spread {r['spread']:.0%})" for r in packed),
                     "goal": "measured", "met": "n/a: where > 1 beyond the spread, pack on a GPU too"})
    fed = [r for r in steps.get("trainer", {}).get("rows", []) if "data_binds" in r]
    if fed:
        worst = max(fed, key=lambda r: r["data_cores"])
        rows.append({"number": "data generation keeps up with the planned steps, 4 workers a cell (most needed: "
                               f"{worst['data_cores']} cores, {worst['arch']} {worst['size']} {worst['cell']})",
                     "value": f"{sum(not r['data_binds'] for r in fed)}/{len(fed)}", "goal": "all",
                     "met": ("yes" if not any(r["data_binds"] for r in fed) else "no") if gpu else "n/a"})


def tile_rows(scan: list[dict]) -> list[dict]:
    """On a GPU's scan rows: whether ``scan_triton.TILES`` still picks the faster layout and split count at each
    channel count's longest bf16 length (measured, not assumed)."""
    rows = []
    longest = {}  # per channel count, its longest bf16 row: the table's tile against the other layout's
    for r in (r for r in scan if r.get("dtype") == "bfloat16"):
        if r["tokens"] >= longest.get(r["channels"], r)["tokens"]:
            longest[r["channels"]] = r
    if longest:
        rows.append({"number": "the scan's tile (scan_triton.TILES) over the other layout's, bf16 at "
                               + ", ".join(f"{d} channels {r['tokens']} tokens" for d, r in longest.items())
                               + " (x faster)",
                     "value": ", ".join(f"{r['tile_over_other']:g}" for r in longest.values()), "goal": ">= 1 each",
                     "met": "yes" if all(r["tile_over_other"] >= 1 for r in longest.values())
                     else "no: retune TILES (benchmarks/scan.py --tune)"})
    split = {}  # per channel count, its fastest split count against the table's tile
    for r in (r for r in scan if "splits" in r):
        if r["name"] not in split or r["over_table_tile"] > split[r["name"]]["over_table_tile"]:
            split[r["name"]] = r
    if split:  # what time splits gain; a run need not be told: it times them (scan_tuning)
        rows.append({"number": "the scan's table tile in its fastest count of time splits over one split, bf16 at "
                               + ", ".join(n.removeprefix("splits: ").removesuffix(" bfloat16") for n in split)
                               + " (x faster)",
                     "value": ", ".join(f"{r['over_table_tile']:g} ({r['splits']} splits)" for r in split.values()),
                     "goal": "measured", "met": "n/a: a run on a GPU times its tiles, splits included, and takes "
                                                "the fastest (harness/ops/scan_tuning.py)"})
    return rows


def summary(report: dict) -> list[dict]:
    """The decisive numbers against their goals (judged on a GPU only: a CPU's tiny sizes decide nothing)."""
    steps, gpu = report["steps"], report["device"] == "cuda"
    rows = []

    def goal(name: str, value, target: float, higher: bool = True, spread: float = 0.0, margin: float = 0.0) -> None:
        """``spread``: the measurement's relative spread, ``margin`` its absolute one; a margin to the goal
        inside either decides nothing."""
        met = None if value is None or not gpu else (value >= target if higher else value <= target)
        label = {None: "n/a" if value is not None else "not measured", True: "yes", False: "no"}[met]
        if met is not None and abs(value - target) <= max(spread * abs(value), margin):
            label = f"not decided (within the measured spread of {spread:.0%})"
        rows.append({"number": name, "value": value, "goal": f"{'>=' if higher else '<='} {target:g}", "met": label})

    scan_rows, whole = steps.get("scan", {}).get("rows", []), steps.get("scan", {}).get("status") == "done"
    scan = [r for r in scan_rows if "name" not in r or r["name"].startswith("splits")]
    rows.append({"number": "Triton scan == PyTorch scan (every length, float32 and bf16; both layouts, in splits)",
                 "value": f"{sum(r['ok'] for r in scan)}/{len(scan)}" if scan else None, "goal": "all",
                 "met": ("no" if not all(r["ok"] for r in scan) else "yes" if whole else "so far (step cut short)")
                 if scan else "not measured"})
    rows += tile_rows(scan) if gpu else []
    profiled = [r for r in scan_rows if r.get("name", "").startswith("profile")]
    for r in profiled or [{}]:
        goal(r["name"].removeprefix("profile: ") + ": ms in the scan's and the convolution's kernels"
             + (f" (scan tile {r['tile']})" if r.get("tile") else "")
             if r else "a Mamba step's ms in the scan's and the convolution's kernels",
             r.get("scan_conv_ms"), GOALS["scan_conv_ms"], higher=False)
    grid_rows(steps, gpu, goal, rows)
    graphed = [r for r in steps.get("trainer", {}).get("rows", []) if r.get("name", "").startswith("graphed")]
    if graphed:
        rows.append({"number": "training steps from CUDA graphs == eager (speed-ups: "
                               + ", ".join(f"{r['speedup']}x" for r in graphed) + ")",
                     "value": f"{sum(r['ok'] for r in graphed)}/{len(graphed)}", "goal": "all",
                     "met": "yes" if all(r["ok"] for r in graphed) else "no"})
    sweep = steps.get("sweep", {}).get("rows", [])
    for model in dict.fromkeys(r["model"] for r in sweep):
        mine = {r["plan"]: r for r in sweep if r["model"] == model}
        auto = mine.get("auto", {})
        # auto's measuring included; a margin inside the plans' spread decides nothing
        goal(f"sweep {model}: auto's regret against the fastest forced plan" + (
             f" (auto ran {auto['ran']}, {auto['runs']} runs each)" if auto else ""), auto.get("regret"),
             GOALS["auto_regret"], higher=False, margin=max((r["spread"] for r in mine.values()), default=0.0))
        # equal (or every divergence a near-tie, in bf16) on generations that differ between prompts
        same = all(r["same_as_none"] for r in mine.values()) and min(
            r.get("distinct_generations", 2) for r in mine.values()) >= 2
        rows.append({"number": f"sweep {model}: auto and batch == none", "value": same, "goal": "True",
                     "met": "yes" if same else "no"})
    decode = [r for r in steps.get("decode", {}).get("rows", []) if "of_bound" in r
              and r["model"].split(" (")[0] == "phi"]
    for b, key in ((1, "decode_of_bound_b1"), (max([r.get("batch", 1) for r in decode], default=64),
                                                "decode_of_bound_b64")):
        # the faster of Phi's eager and graphed steps: what a run on this card gets by default
        best = max((r for r in decode if r.get("batch", 1) == b), key=lambda r: r["of_bound"], default=None)
        goal(f"Phi decode at batch {b}: share of the bandwidth bound"
             + (f" ({best['model'].removeprefix('phi').strip(' ()') or 'eager'})" if best else ""),
             best["of_bound"] if best else None, GOALS[key])
    for parity in (r for r in steps.get("decode", {}).get("rows", []) if "same_tokens" in r):
        rows.append({"number": parity["name"], "value": parity["same_tokens"], "goal": "True",
                     "met": "yes" if parity["ok"] else "no"})
    return rows


def _name_kind(row: dict) -> str:
    """What a named row is, from its name up to a colon or a parenthesis: "splits: 128 channels ..." -> "splits"."""
    return re.split(r"[:(]", row["name"], maxsplit=1)[0].strip()


def render(report: dict) -> str:
    env = report["environment"]
    card = env.get("gpu", "CPU (tiny sizes)")
    lines = [f"# Quick GPU suite on {card}: {report.get('seconds')} s of a {report['budget_s']:.0f} s budget", "",
             ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    if report.get("summary"):
        # values as written (a column mixing numbers and booleans would show True as 1)
        table = [{**r, "value": "" if r["value"] is None else str(r["value"])} for r in report["summary"]]
        lines += ["## The decisive numbers", "", pd.DataFrame(table).to_markdown(index=False), ""]
    titles = {"scan": "(a) Triton scan against the PyTorch scan, forward + backward; where a Mamba step's time goes",
              "trainer": "(b) Training steps through the trainer's own step and data",
              "sharing": "(c) Cells sharing a device: K processes after one barrier, one fixed window",
              "sweep": "(d) The all-slot HotpotQA sweep: auto, batch, none",
              "decode": "(e) Decode against the memory-bandwidth bound"}
    for name, title in titles.items():
        step = report["steps"].get(name)
        lines += [f"## {title}", ""]
        if step is None:
            lines += ["not reached" if name in report.get("asked", STEPS) else "not asked for in this call (--part)", ""]
            continue
        lines.append(f"{step['status']} in {step.get('seconds', 0)} s (limit {step.get('limit_s', '-')} s)"
                     + (f": {step['reason']}" if step.get("reason") else ""))
        table = [r for r in step["rows"] if not r.get("projection") and not r.get("supported") and not r.get("live")]
        # named rows (checks, profiles) a table for each kind of name, then the measurements in one
        kinds = dict.fromkeys(_name_kind(r) for r in table if "name" in r)
        for rows in [[r for r in table if "name" in r and _name_kind(r) == k] for k in kinds] + [
                [r for r in table if "name" not in r]]:
            if rows:
                lines += ["", pd.DataFrame(rows).fillna("").to_markdown(index=False)]
        lines += [f"\nprojected: **{r['grid_hours']} hours** for the paper grid on {card} ({r['how']})"
                  for r in [r for r in step["rows"] if r.get("projection")][-1:]]
        lines += [f"\nlive evaluation: {r['s_per_sample']} s a sample, {r['tokens_per_sample']} tokens and "
                  f"{r['tool_calls_per_sample']} tool calls a sample at batch {r['batch']}: **{r['retrieval_cells_hours']} "
                  f"hours** ({r['static_retrieval_cells_hours']} in static batches; {r['how']})"
                  for r in step["rows"] if r.get("live")]
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
