"""Cells that share a device (``--cells-per-gpu K``), measured so that K processes really overlap.

K processes each build one cell as its run would (``grid.cell_steps``: model, optimizer, graphs, packing, the
run's batches), take their warm-up steps, and wait at one barrier; released together, each trains for the same
fixed wall window and counts the samples it finished inside it (the step running at the window's end by the
part of it inside). Starting K processes and timing each over its own few steps would not do: their start-ups
take seconds, so short timed windows need not overlap at all and a sum of rates can read Kx with no sharing.

The CPU is counted too: each process's CPU seconds in the window (its own threads), and the CPU that data
generation would need at the measured rate (its seconds a sample, measured single-threaded as the run's
DataLoader workers generate) against the machine's cores. Windows are wall-clock times (``time.time``) so the
report states how much they overlapped."""
from __future__ import annotations

import multiprocessing
import os
import queue
import random
import time

import torch

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
        end, samples, k = start + window_s, 0.0, 0
        while True:
            t0 = time.time()
            cs.step(order[k % len(order)])
            t1 = time.time()
            k += 1
            if t1 >= end:
                samples += batch * max(0.0, end - t0) / max(t1 - t0, 1e-9)
                break
            samples += batch
        results.put({"pid": os.getpid(), "ready": ready, "start": start, "end": end, "samples": samples, "steps": k,
                     "cpu_s": time.process_time() - cpu0, "gen_s_per_sample": cs.gen_s_per_sample,
                     "graphs": cs.graphs, "packing": cs.packing})
    except BaseException as e:  # noqa: BLE001  reported to the parent, which names it
        barrier.abort()
        results.put({"pid": os.getpid(), "error": f"{type(e).__name__}: {e}"})


def shared_rate(spec: dict, k: int, device: str, batch: int, window_s: float) -> dict:
    """K copies of the cell ``spec`` (TrainConfig fields) trained at once for ``window_s`` seconds after one
    barrier: their summed samples/s, how much their windows overlapped, and the CPU they and their data need."""
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
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


def sharing_table(cells: dict[str, dict], ks: list[int], device: str, batch: int, window_s: float, emit) -> dict:
    """``shared_rate`` for each named cell at each K; a row each (``emit``), and the K each cell supports best:
    the largest aggregate rate whose processes' and data's CPU fit in the machine's cores."""
    best = {}
    ks = [1, *[k for k in ks if k != 1]]  # gains are against one alone
    for name, spec in cells.items():
        alone = None
        for k in ks:
            r = shared_rate(spec, k, device, batch, window_s)
            alone = alone or r["samples_per_s"] / k
            need = r["process_cores"] + r["data_cores"]
            row = {"cell": name, "K": k, "samples_per_s": round(r["samples_per_s"], 1),
                   "gain_over_one": round(r["samples_per_s"] / alone, 2), "windows_overlap": round(r["overlap"], 3),
                   "released_together": r["released_together"],
                   "steps_each": r["steps"], "cpu_cores_needed": round(need, 1), "cores": r["cores"],
                   "plan": "graphs" if r["graphs"] else "packed" if r["packing"] == "on" else "eager"}
            emit(row)
            fits = need <= r["cores"] and r["overlap"] > 0.9
            if fits and row["gain_over_one"] > best.get(name, {}).get("gain", 0):
                best[name] = {"k": k, "gain": row["gain_over_one"]}
    return best


def supported_gain(best: dict) -> tuple[int, float]:
    """From ``sharing_table``'s answer: the largest K supported and the smallest gain among the cells measured
    (every cell gains at least that), for projecting a grid's hours."""
    return max(b["k"] for b in best.values()), min(b["gain"] for b in best.values())
