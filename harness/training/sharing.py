"""Cells that share a device (``--cells-per-gpu K``), measured so that K processes really overlap.

K processes each build one cell as its run would (``grid.cell_steps``: model, optimizer, graphs, packing, the
run's batches), take their warm-up steps, and wait at one barrier; released together, each trains for the same
fixed wall window and counts the samples it finished inside it (the step running at the window's end by the
part of it inside). Starting K processes and timing each over its own few steps would not do: their start-ups
take seconds, so short timed windows need not overlap at all and a sum of rates can read Kx with no sharing.

A second way (``streamed_rate``): K cells in one process, each stepping on its own CUDA stream, one round of
steps launched after another; kernels of different streams may run at once where one cell leaves the GPU's
multiprocessors idle (a latency-bound scan), which K processes cannot without MPS (their contexts take turns).

The CPU is counted too: each process's CPU seconds in the window (its own threads), and the CPU that data
generation would need at the measured rate (its seconds a sample, measured single-threaded as the run's
DataLoader workers generate) against the machine's cores. Windows are wall-clock times (``time.time``) so the
report states how much they overlapped."""
from __future__ import annotations

import contextlib
import os
import queue
import random
import time

import torch

from harness.procs import child_context
from harness.training.config import TrainConfig
from harness.training.grid import cell_steps

BARRIER_TIMEOUT_S = 600  # the slowest process's start-up (CUDA context, model, graph capture) must fit in this


def _worker(spec: dict, device: str, batch: int, window_s: float, barrier, results) -> None:
    """One of the K processes: build, warm up, wait for all, train for the window, report."""
    try:
        dev = torch.device(device)
        if dev.type == "cpu":
            torch.set_num_threads(1)  # K processes share the cores, as grid cells on a CPU do
        cs = cell_steps(TrainConfig(**spec, report_to="none").resolved(), dev, batch)
        order = cs.drawn[:]
        random.Random(os.getpid()).shuffle(order)  # each process its own mix of lengths, as independent runs
        for b in (cs.drawn[len(cs.drawn) // 2],) * 2:
            cs.step(b)
        ready = time.time()
        barrier.wait(timeout=BARRIER_TIMEOUT_S)
        start, cpu0 = time.time(), time.process_time()
        done, k = _window(lambda k: cs.step(order[k % len(order)]), start + window_s)
        results.put({"pid": os.getpid(), "ready": ready, "start": start, "end": start + window_s,
                     "samples": batch * done, "steps": k, "cpu_s": time.process_time() - cpu0,
                     "gen_s_per_sample": cs.gen_s_per_sample, "graphs": cs.graphs, "packing": cs.packing})
    except BaseException as e:  # noqa: BLE001  reported to the parent, which names it
        barrier.abort()
        results.put({"pid": os.getpid(), "error": f"{type(e).__name__}: {e}"})


def _window(step, end: float) -> tuple[float, int]:
    """``step(k)`` for k = 0, 1, ... until wall time ``end``: (the steps finished inside the window, the one
    running at its end counted by its part inside; the steps taken)."""
    done, k = 0.0, 0
    while True:
        t0 = time.time()
        step(k)
        t1 = time.time()
        k += 1
        if t1 >= end:
            return done + max(0.0, end - t0) / max(t1 - t0, 1e-9), k
        done += 1


def shared_rate(spec: dict, k: int, device: str, batch: int, window_s: float) -> dict:
    """K copies of the cell ``spec`` (TrainConfig fields) trained at once for ``window_s`` seconds after one
    barrier: their summed samples/s, how much their windows overlapped, and the CPU they and their data need."""
    ctx = child_context(cuda=torch.device(device).type == "cuda", preload=(__name__,))  # as the grid starts cells
    barrier, results = ctx.Barrier(k), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(spec, device, batch, window_s, barrier, results), daemon=True)
             for _ in range(k)]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in procs:
            got.append(results.get(timeout=BARRIER_TIMEOUT_S + 4 * window_s + 60))
    except queue.Empty:
        got.append({"error": "a process neither finished nor failed in time"})
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [g["error"] for g in got if "error" in g]
    if errors:
        raise RuntimeError(f"{k} cells side by side: {errors[0]}")
    overlap = max(0.0, min(g["end"] for g in got) - max(g["start"] for g in got)) / window_s
    # the barrier's guarantee: no window opened before every process had finished its warm-up
    released_together = max(g["ready"] for g in got) <= min(g["start"] for g in got)
    rate = sum(g["samples"] for g in got) / window_s
    cpu_cores = sum(g["cpu_s"] for g in got) / window_s
    data_cores = rate * sum(g["gen_s_per_sample"] for g in got) / len(got)
    return {"k": k, "samples_per_s": rate, "overlap": overlap, "released_together": released_together,
            "steps": [g["steps"] for g in got],
            "process_cores": cpu_cores, "data_cores": data_cores, "cores": os.cpu_count(),
            "graphs": got[0]["graphs"], "packing": got[0]["packing"]}


def streamed_rate(spec: dict, k: int, device: str, batch: int, window_s: float) -> dict:
    """K copies of the cell ``spec`` in this process, each on its own CUDA stream (on a CPU: one after another,
    the same code), trained in rounds (one step of each, then a wait for all) for ``window_s`` seconds after
    their warm-up: ``shared_rate``'s answer for them (one process: its windows overlap by construction)."""
    dev = torch.device(device)
    cfg = TrainConfig(**spec, report_to="none").resolved()
    built = time.time()
    cells = [cell_steps(cfg, dev, batch, draws=8, synchronize=False)]
    cells += [cell_steps(cfg, dev, batch, synchronize=False, data=(cells[0].drawn, cells[0].gen_s_per_sample))
              for _ in range(k - 1)]  # the data generated once: the copies' build is their model and graphs
    streams = [torch.cuda.Stream(dev) if dev.type == "cuda" else None for _ in range(k)]
    orders = [random.Random(i).sample(cs.drawn, len(cs.drawn)) for i, cs in enumerate(cells)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def round_of_steps(r: int) -> None:
        for cs, stream, order in zip(cells, streams, orders):
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                cs.step(order[r % len(order)])
        sync()

    for r in range(2):  # warm-up
        round_of_steps(len(orders[0]) // 2 + r)
    built = time.time() - built
    start, cpu0 = time.time(), time.process_time()
    rounds, r = _window(round_of_steps, start + window_s)
    rate = rounds * k * batch / window_s
    return {"k": k, "samples_per_s": rate, "overlap": 1.0, "released_together": True, "steps": [r] * k,
            "process_cores": (time.process_time() - cpu0) / window_s,
            "data_cores": rate * cells[0].gen_s_per_sample, "cores": os.cpu_count(),
            "graphs": cells[0].graphs, "packing": cells[0].packing, "build_s": built}


def sharing_table(cells: dict[str, dict], ks: list[int], device: str, batch: int, window_s: float, emit,
                  ways: tuple[str, ...] = ("processes",)) -> dict:
    """For each way (``processes``: ``shared_rate``; ``streams``: ``streamed_rate``), named cell and K, a row
    (``emit``), and the K each cell supports best: the largest aggregate rate whose processes' and data's CPU fit
    in the machine's cores (keys ``cell`` or ``cell (streams)``)."""
    best = {}
    ks = [1, *[k for k in ks if k != 1]]  # gains are against one alone
    for way, (name, spec) in ((w, c) for w in ways for c in cells.items()):
        alone = None
        measure = streamed_rate if way == "streams" else shared_rate
        for k in ks:
            r = measure(spec, k, device, batch, window_s)
            alone = alone or r["samples_per_s"] / k
            need = r["process_cores"] + r["data_cores"]
            row = {"cell": name, "way": way, "K": k, "samples_per_s": round(r["samples_per_s"], 1),
                   "gain_over_one": round(r["samples_per_s"] / alone, 2), "windows_overlap": round(r["overlap"], 3),
                   "released_together": r["released_together"],
                   "steps_each": r["steps"], "build_s": round(r["build_s"], 3) if "build_s" in r else None,
                   "cpu_cores_needed": round(need, 1), "cores": r["cores"],
                   "plan": "graphs" if r["graphs"] else "packed" if r["packing"] == "on" else "eager"}
            emit(row)
            fits = need <= r["cores"] and r["overlap"] > 0.9
            key = name if way == "processes" else f"{name} ({way})"
            if fits and row["gain_over_one"] > best.get(key, {}).get("gain", 0):
                best[key] = {"k": k, "gain": row["gain_over_one"]}
    return best


def supported_gain(best: dict, way: str = "processes") -> tuple[int, float] | None:
    """From ``sharing_table``'s answer, for one way of sharing: the largest K supported and the smallest gain
    among the cells measured (every cell gains at least that), for projecting a grid's hours; None if that way
    was not measured."""
    mine = [b for key, b in best.items() if (key.endswith(f" ({way})") if way != "processes" else " (" not in key)]
    return (max(b["k"] for b in mine), min(b["gain"] for b in mine)) if mine else None
