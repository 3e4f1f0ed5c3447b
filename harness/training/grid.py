"""Grids of IsTree training runs: the paper's 81 cells and a CPU demo, run side by side, planned before they
start, and collected into one table and the paper-style figure.

A cell is one ``TrainConfig``; its run directory is ``ROOT/NAME`` and holds ``result.json`` once finished, so
a grid resumes by skipping finished cells. ``--jobs N`` trains N cells at once in separate processes (on one
GPU, small models leave most of it idle; on a CPU, single-threaded processes beat one process on all cores).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from evals import istree
from evals.registry import get_task
from harness.backends.generation import scheduled_steps
from harness.engine.config import ConfigError
from harness.files import write_atomic
from harness.models.istree import build_model, scans_ran, trainable_parameters
from harness.models.packing import one_row_on, pack
from harness.reports.plotting import pyplot, save
from harness.procs import child_context, die_with_parent, exit_description
from harness.training.config import USER_ERRORS, TrainConfig
from harness.training.data import PAD, TrainingBatches, TrainTask, packing_setting
from harness.training.gold_trace import GoldTrace, gold_continuations
from harness.training.launch import run_on_scheduler
from harness.training.step_graphs import MAX_SHAPES, WARMUP, GraphedSteps
from harness.training.step import new_model, new_optimizer, optimizer_step, uses_bf16
from harness.training.state import save_checkpoint
from harness.training.trainer import evaluate, train_one

log = logging.getLogger("harness")

ARCH_ORDER = ("transformer", "mamba", "hybrid")
GRIDS = {
    "paper": {"arch": list(ARCH_ORDER), "size": ["0.5M", "1M", "2M"], "nodes": [16, 32, 64],
              "setup": ["direct", "cot", "retrieval"]},
    "smoke": {"arch": list(ARCH_ORDER), "size": ["smoke"], "nodes": [4], "setup": ["direct", "cot", "retrieval"]},
}
# What a flag left out means in each grid (per setup where the setups need different budgets).
GRID_DEFAULTS = {
    "paper": {"samples": 5_000_000, "eval_every": 100_000, "eval_samples": 5000},
    # A CPU demo sized for 2 cores (about 6 minutes with --jobs 2): a hotter lr and smaller batch than the
    # paper's 5M-sample runs, and budgets per cell. Direct answers get one budget for all three (the comparison
    # the demo shows); the tiny two-layer Transformer needs 4x Mamba's samples to learn the CoT trace and 6x for
    # retrieval traces, but trains 4-5x faster per sample on a CPU.
    "smoke": {"batch_size": 32, "warmup": 960, "lr": 3e-3, "eval_samples": 500, "eval_batch_size": 250,
              "by_setup": {"direct": {"samples": 48_000, "eval_every": 8000},
                           "cot": {"samples": 32_000, "eval_every": 4000},
                           "retrieval": {"samples": 16_000, "eval_every": 4000}},
              "by_cell": {("transformer", "cot"): {"samples": 128_000, "eval_every": 16_000},
                          ("transformer", "retrieval"): {"samples": 96_000, "eval_every": 16_000}}},
}


def grid_cells(name: str, base: TrainConfig, root: Path) -> list[TrainConfig]:
    """Every cell of a grid, resolved: the command line's settings, then the grid's defaults, then the paper's."""
    grid, defaults = GRIDS[name], GRID_DEFAULTS[name]
    cells = []
    for setup, nodes, size, arch in itertools.product(grid["setup"], grid["nodes"], grid["size"], grid["arch"]):
        fill = {k: v for k, v in defaults.items() if not k.startswith("by_")}
        fill.update(defaults.get("by_setup", {}).get(setup, {}))
        fill.update(defaults.get("by_cell", {}).get((arch, setup), {}))
        cell = dataclasses.replace(base, arch=arch, size=size, nodes=nodes, setup=setup, task="istree", output=None)
        cell = cell.resolved(fill)
        cells.append(dataclasses.replace(cell, output=str(root / cell.name)))
    return cells


def _cost(cell: TrainConfig) -> float:
    """A rough order for packing cells onto workers: longest first."""
    per_token = {"transformer": 1.0, "mamba": 3.0, "hybrid": 3.0}[cell.arch]
    length = {"direct": 4, "cot": 8, "retrieval": 40}[cell.setup] * cell.nodes
    return per_token * length * cell.samples


def run_grid(name: str, base: TrainConfig, root: Path, jobs: int | None = None, progress: bool = True,
             overwrite: bool = False, launcher: str = "processes", cells_per_gpu: int = 1,
             partition: str | None = None, timeout_min: int = 72 * 60) -> list[dict]:
    """Train every unfinished cell (``jobs`` at a time; default: one per core on a CPU, ``cells_per_gpu`` on
    each GPU), here or on a scheduler (``harness.training.launch``), then write the grid's report once. A cell
    that fails is named at the end; the others still train."""
    cells = grid_cells(name, base, root)
    if cells_per_gpu < 1:
        raise ConfigError(f"--cells-per-gpu {cells_per_gpu}: use 1 or more")
    jobs = default_jobs(len(cells), cells_per_gpu) if jobs is None else jobs
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: use 1 or more")
    if jobs > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--jobs > 1 runs cells in separate processes; under accelerate launch (data parallel) "
                          "use --jobs 1")
    root.mkdir(parents=True, exist_ok=True)
    ordered = sorted(cells, key=_cost, reverse=True)
    if launcher != "processes":
        results = run_on_scheduler(launcher, name, ordered, root, jobs, cell_threads(base, jobs), overwrite,
                                   timeout_min=timeout_min, partition=partition)
    elif jobs == 1:
        results = []
        for i, cell in enumerate(cells, 1):
            log.info("grid %s: cell %d/%d %s", name, i, len(cells), cell.name)
            results.append(train_one(cell, progress, overwrite=overwrite))
    else:
        threads = cell_threads(base, jobs)
        log.info("grid %s: %d cells, %d at a time, %d CPU thread(s) each", name, len(cells), jobs, threads)
        results = train_in_processes(name, ordered, jobs, threads, progress, overwrite, cost=_cost)
    write_grid_report(root)
    return results


def default_jobs(cells: int, cells_per_gpu: int = 1) -> int:
    """Cells at once: one per core on a CPU (single-threaded processes beat one process on all cores),
    ``cells_per_gpu`` on each GPU (a 0.5M model leaves most of one idle), one under data parallelism."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return 1
    if torch.cuda.is_available():
        return min(cells, torch.cuda.device_count() * cells_per_gpu)
    return min(cells, os.cpu_count() or 1)


def cell_threads(base: TrainConfig, jobs: int) -> int:
    return base.threads or max(1, (os.cpu_count() or 1) // jobs)


def eta_seconds(fraction: float, elapsed: float, expected: float | None = None) -> float | None:
    """Seconds left: the measured rate once enough is done, the up-front estimate (``expected``, seconds for the
    whole) before, and a blend between, so the first ETA is not a rate extrapolated from a few seconds of process
    start-ups (a demo's read 33 hours). None: nothing to say yet."""
    rate = elapsed * (1 - fraction) / fraction if fraction > 0 else None
    prior = max(0.0, expected - elapsed) if expected is not None else None
    if prior is None:
        return rate if fraction >= 0.02 else None
    if rate is None:
        return prior
    weight = min(1.0, fraction / 0.25)  # the estimate gives way to the rate over the first quarter
    return weight * rate + (1 - weight) * prior


def train_in_processes(name: str, cells: list[TrainConfig], jobs: int, threads: int, progress: bool,
                       overwrite: bool, cost=None, expected_s: float | None = None) -> list[dict]:
    """Cells in child processes, ``jobs`` at a time. A child dies with this process however it ends (SIGKILL
    included), and on any exit here (Ctrl-C, SIGTERM, an error) the running children are stopped before it
    returns: no cell keeps training unseen, so a rerun never trains a cell twice at once (each cell's directory
    lock refuses that too). Processes are managed by hand because ProcessPoolExecutor waits for running cells
    when interrupted and has no public way to stop them.

    The progress bar counts the work done in every cell (the steps in its ``train_log.jsonl``), each cell
    weighted by ``cost`` (default: its steps), so its ETA moves while long cells train; ``expected_s``, an up-front
    estimate of the whole, steadies the first ETA (``eta_seconds``)."""
    gpus = torch.cuda.device_count()
    ctx = child_context(cuda=gpus > 0, preload=(__name__,))
    pending, running, results, failed = list(cells), {}, [], []
    free = list(range(jobs))  # slot k trains on GPU k mod the GPUs (several cells share one when jobs > GPUs)
    weight = {c.output: (cost or (lambda c: c.samples // c.batch_size))(c) for c in cells}
    total = sum(weight.values()) or 1.0
    shown = 0.0
    bar = tqdm(total=100.0, desc=f"{name}: {len(cells)} cells", unit="%", disable=not progress,
               bar_format="{l_bar}{bar}| {n:.0f}% [{elapsed}{postfix}]")
    started, status = time.perf_counter(), ""
    try:
        while pending or running:
            while pending and free:
                cell, slot = pending.pop(0), free.pop(0)
                gpu = slot % gpus if gpus else None
                proc = ctx.Process(target=_cell_process, args=(cell, threads, os.getpid(), overwrite),
                                   name=f"cell {cell.name}")
                with _only_gpu(gpu):
                    proc.start()
                running[proc.sentinel] = (proc, cell, slot)
            for sentinel in wait(list(running), timeout=1.0):
                proc, cell, slot = running.pop(sentinel)
                free.append(slot)
                proc.join()
                done = Path(cell.output) / "result.json"
                if proc.exitcode == 0 and done.exists():
                    res = json.loads(done.read_text())
                    results.append(res)
                    status = (f", {len(results)} done, last {cell.name}: EM "
                              f"{100 * res.get('teacher_forced_em', 0):.0f}%")
                else:
                    failed.append(f"{cell.name} ({exit_description(proc.exitcode)})")
            now = 100.0 * sum(weight[c.output] * cell_fraction(c) for c in cells) / total
            if now > shown:
                bar.update(now - shown)
                shown = now
            left = eta_seconds(now / 100, time.perf_counter() - started, expected_s)
            bar.set_postfix_str(("" if left is None else f"<{tqdm.format_interval(left)} left") + status)
    finally:
        _stop(proc for proc, _, _ in running.values())
        bar.close()
    if failed:
        raise ConfigError(f"grid {name}: {len(failed)} cell(s) failed ({'; '.join(failed)}); their errors are printed "
                          "above; the other cells are finished and kept; rerun the same command to retry them")
    return results


def cell_fraction(cell: TrainConfig) -> float:
    """How much of a cell is done: 1 when finished, else the last logged step over its steps (the log's tail)."""
    out = Path(cell.output)
    if (out / "result.json").exists():
        return 1.0
    try:
        with open(out / "train_log.jsonl", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return 0.0
    step = 0
    for line in reversed(tail.splitlines()):  # the last whole line (the child may be writing the next one)
        try:
            step = json.loads(line)["step"] + 1
            break
        except (ValueError, KeyError, TypeError):
            continue
    return min(1.0, step / max(1, cell.samples // cell.batch_size))


def _stop(procs) -> None:
    procs = list(procs)
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


@contextlib.contextmanager
def _only_gpu(gpu: int | None):
    """A child started inside this block sees one GPU: the ``gpu``-th this process sees. Set in the environment
    it inherits, because CUDA reads it once, when it starts, which an import in the child may already do."""
    if gpu is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[gpu]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _cell_process(cfg: TrainConfig, threads: int, parent_pid: int, overwrite: bool) -> None:
    """One grid cell in a child process: an error is one line on stderr and a non-zero exit code."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops the cells
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    try:
        train_one(cfg, progress=False, overwrite=overwrite)
    except USER_ERRORS as e:
        print(f"error: {cfg.name}: {e}", file=sys.stderr)
        sys.exit(2)


# ------------------------------------------------------------------------------------------ planning
@functools.cache
def cell_parameters(arch: str, size: str, nodes: int) -> int:
    """Trainable parameters of an IsTree cell's model (its vocabulary is the graph size's): what projections
    scale a measured size to another by."""
    return trainable_parameters(build_model(arch, size, len(istree.vocabulary(nodes))))


@dataclasses.dataclass
class CellSteps:
    """A cell's optimizer step as its run takes it (its model, optimizer, precision, graphs and packing as the run
    decides them), with batches drawn as the run draws them, sorted by padded length."""
    step: Callable[[tuple], None]  # one optimizer step on a drawn (ids, mask), synchronised
    drawn: list
    graphs: bool
    packing: str
    gen_s_per_sample: float  # seconds of data generation a sample (one thread, inline)
    forward: Callable[[tuple], None]  # a forward pass only (evaluations), synchronised
    model: torch.nn.Module


def cell_steps(cell: TrainConfig, device: torch.device, batch: int, draws: int = 32,
               synchronize: bool = True, data: tuple[list, float] | None = None) -> CellSteps:
    """Everything a timed step of ``cell`` needs, built as the trainer builds it; graphs captured for the drawn
    batches' shapes (eager warm-up steps first, as a run), so what follows times replays. ``synchronize``: each
    step waits for the device (off: cells stepping on streams of their own, ``sharing.streamed_rate``). ``data``:
    another copy's (drawn batches, generation seconds a sample), so K copies of a cell generate its data once."""
    task = TrainTask(cell)
    torch.manual_seed(cell.seed)
    model = new_model(cell, task).to(device)
    graphs = cell.cuda_graphs != "off" and device.type == "cuda"  # auto as the run would: graphs, if they agree
    opt = new_optimizer(cell, model, device, graphs)
    if data is None:
        source = TrainingBatches(task, batch, cell.seed, 0, cell.bucket)
        t = time.perf_counter()
        drawn = [b for k in range(-(-draws // cell.bucket)) for b in source.pool(k)]
        data = sorted(drawn, key=lambda b: b[0].shape[1]), (time.perf_counter() - t) / (len(drawn) * batch)
    drawn, gen_s = data
    # graphs replay only shapes seen before (the first MAX_SHAPES): a cell whose batches pad to varying lengths
    # trains eagerly under auto (its check finds no repeat), so it is timed eagerly
    one_row = one_row_on(device.type)
    packing, _ = packing_setting(cell, task, batch, device.type)  # the run's own decision: what it trains
    pad = task.vocab.index(PAD)
    graphs = graphs and packing == "off" and len({b[0].shape for b in drawn}) <= MAX_SHAPES
    sync = torch.cuda.synchronize if device.type == "cuda" and synchronize else (lambda: None)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(cell, device))
    graphed = GraphedSteps(model, opt, device.type, uses_bf16(cell, device)) if graphs else None
    if graphed is not None:  # as a run: each batch shape's eager warm-up steps and its capture
        for ids, mask in {b[0].shape: b for b in drawn}.values():
            for _ in range(WARMUP + 1):
                graphed(ids.to(device), mask.to(device))

    def step(b) -> None:
        ids, mask = b
        packed = pack(ids, mask, pad, one_row).to(device) if packing == "on" else None
        ids, mask = (packed.ids, packed.mask) if packed is not None else (ids.to(device), mask.to(device))
        if graphed is not None:
            graphed(ids, mask)
        else:
            optimizer_step(model, opt, ids, mask, autocast, packed=packed)
        sync()

    def forward(b) -> None:
        with torch.no_grad(), autocast:
            model(input_ids=b[0].to(device))
        sync()

    return CellSteps(step, drawn, graphs, packing, gen_s, forward, model)


def measure_cell(cell: TrainConfig, device: torch.device, batch: int, steps: int = 3, draws: int = 32,
                 busy: bool = False, passes: int = 1) -> dict:
    """Seconds per optimizer step (the trainer's own ``optimizer_step``: its model, scan, precision, loss and
    optimizer) and per sample of data generation, and the forward-only seconds of one batch (for evaluations).

    Steps cost what their padded length costs, and a cell's lengths vary widely (IsTree retrieval: 2x between
    batches), so a few steps on whatever batches come first misstate the mean by as much. ``draws`` batches are
    drawn as the trainer draws them (``TrainingBatches``: the run's seed, bucketing and batch), and the ``steps``
    timed steps (after two warm-up steps and one for each other power of two they pad to) run on the batches at
    evenly spaced quantiles of padded length: their mean is a stratified estimate of the run's mean step.
    ``passes`` times over those batches: ``step_s`` is the median of the passes' means and ``spread`` their
    range over it, the measurement's noise (one pass: the range of its steps, lengths included). ``busy``
    (CUDA): the same steps again under the profiler, their kernels' time a step (``busy_s``: the GPU's busy
    time, what a step without launch gaps would take)."""
    cs = cell_steps(cell, device, batch, max(draws, steps))
    drawn = cs.drawn
    picked = [drawn[int((k + 0.5) * len(drawn) / steps)] for k in range(steps)]
    middle = drawn[len(drawn) // 2]
    # two warm-up steps, then one on a timed batch of each other length up to a power of two: a GPU's scan times
    # its tiles per such length (harness.ops.scan_tuning), which no timed step should include
    octaves = {(b[0].shape[1] - 1).bit_length(): b for b in picked}
    octaves.pop((middle[0].shape[1] - 1).bit_length(), None)
    for b in (middle, middle, *octaves.values()):
        cs.step(b)
    means, timed = [], []
    for _ in range(max(1, passes)):
        times = []
        for b in picked:
            t0 = time.perf_counter()
            cs.step(b)
            times.append(time.perf_counter() - t0)
        means.append(sum(times) / steps)
        timed += times
    t1 = time.perf_counter()
    cs.forward(middle)
    forward_s = time.perf_counter() - t1
    step_s = statistics.median(means)
    spread = (max(means) - min(means) if len(means) > 1 else max(timed) - min(timed)) / step_s
    busy_s = None
    if busy and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile  # lazy: the profiler is only for this

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for b in picked:
                cs.step(b)
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        busy_s = sum(e.self_device_time_total for e in kernels) / 1e6 / steps
    return {"step_s": step_s, "spread": spread, "passes": len(means), "timed_steps": len(timed), "busy_s": busy_s,
            "graphs": cs.graphs, "packing": cs.packing, "gen_s_per_sample": cs.gen_s_per_sample,
            "forward_s": forward_s, "scans": scans_ran(cs.model),
            "tokens": sum(int(m.shape[1]) for m, _ in drawn) / len(drawn),
            "padded_lengths": [int(b[0].shape[1]) for b in picked]}


def measure_live_eval(cell: TrainConfig, device: torch.device, samples: int | None = None) -> dict:
    """What the cell's live evaluation costs (the trainer's own ``evaluate``: greedy generation through the eval
    engine at the run's evaluation batch, the tool live), timed on ``samples`` test samples (default: one
    evaluation batch), with the tokens generated, the tool calls made and the accuracy. The model is the cell's
    fresh one writing each sample's gold trace (``harness.training.gold_trace``): its forward passes at the
    lengths and calls of a model that has learned the task (at n=64 retrieval ~1,500 tokens and ~240 calls a
    sample), every sample right when every search answered as the trace says.

    The whole evaluation (``eval_samples``) refills rows as they finish (continuous batching), so its length is
    not the timed batch's scaled: its decode steps come from the loop's admission rule replayed over every test
    sample's gold trace (``generation.scheduled_steps``; checked to give the timed run's own steps), at the timed
    run's seconds a step (``run_s``, and ``static_run_s`` for batches each run to its longest row)."""
    task = TrainTask(cell)
    torch.manual_seed(cell.seed)
    model = new_model(cell, task).to(device).eval()
    batch, tok = cell.eval_batch_size, task.tokenizer()
    samples = samples or batch
    gold = gold_continuations(get_task(cell.task, **{**task.eval_args, "samples": samples}), tok)
    backends = []

    def wrap(backend):
        backends.append(GoldTrace(backend, gold))
        return backends[-1]

    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d)
        save_checkpoint(run_dir, model, tok, {"task": cell.task, "args": task.eval_args})
        t = time.perf_counter()
        evaluate(model, tok, run_dir, cell.task, {**task.eval_args, "samples": samples}, batch, wrap=wrap)
        seconds = time.perf_counter() - t
        rows = [json.loads(line) for line in open(run_dir / "eval" / "samples.jsonl")]
    steps = backends[-1].stats["decode_steps"]
    by_token = backends[-1].feeds_token_by_token([1, 2])
    end = tok.convert_tokens_to_ids(istree.END)

    def passes(continuations: dict) -> list[int]:
        """Each row's passes of the decode loop, in the order the plan admits them (longest prompt first): a pass a
        token where the model is fed one at a time; where it takes blocks whole, each tool answer (one token in
        IsTree) rides with the call's last token."""
        order = sorted(continuations, key=lambda p: -len(p))
        return [len(continuations[p]) - (0 if by_token else continuations[p].count(end)) for p in order]

    replayed = scheduled_steps(passes(gold), batch)
    if replayed != steps:
        raise RuntimeError(f"the live evaluation's admission rule replayed gives {replayed} decode steps, the run "
                           f"took {steps}: its projection would not hold")
    every = passes(gold_continuations(get_task(cell.task, **task.eval_args), tok))
    count, s_per_step = max(1, len(rows)), seconds / max(1, steps)
    run_s = s_per_step * scheduled_steps(every, batch)
    return {"samples": len(rows), "batch": batch, "seconds": seconds, "decode_steps": steps,
            "s_per_step": s_per_step, "run_s": run_s,
            "static_run_s": s_per_step * scheduled_steps(every, batch, continuous=False),
            "s_per_sample": run_s / len(every),
            "tokens_per_sample": sum(r["new_tokens"] for r in rows) / count,
            "tool_calls_per_sample": sum(len(r["tool_calls"]) for r in rows) / count,
            "accuracy": sum(r["scores"]["accuracy"] for r in rows) / count}


PLAN_STEPS, PLAN_PASSES = 5, 3  # a planned cell: warm-up steps, then 3 passes over 5 batches of its lengths
ONE_MILLION = 1_000_000  # the paper's stated minimum of samples a run


def plan_grid(name: str, base: TrainConfig, root: Path, measure_batch: int | None = None, steps: int = PLAN_STEPS,
              progress: bool = True, jobs: int | None = None, cells_per_gpu: int = 1, passes: int = PLAN_PASSES,
              live_samples: int | None = None) -> str:
    """A table of every cell's projected hours on this machine, from steps measured as each run takes them (its
    graphs and packing as the run decides), then the projection's parts: serial hours, GPU-busy hours (CUDA),
    the grid as ``run_grid`` would run it (``jobs`` cells at once, longest first), the live evaluations, whether
    data generation keeps up, and the same at 1M samples a run; nothing is trained.

    A step is measured at ``measure_batch`` samples (default: the cell's batch) and scaled linearly to the
    cell's batch; teacher-forced evaluations are projected from one forward pass; data generation counts where
    it runs inline (no DataLoader workers: the CPU default); the live evaluation is timed on one retrieval cell
    (``live_samples`` test samples, default one evaluation batch; 0: not timed) and scaled to every retrieval cell."""
    import pandas as pd

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cells = grid_cells(name, base, root)
    if cells_per_gpu < 1:
        raise ConfigError(f"--cells-per-gpu {cells_per_gpu}: use 1 or more")
    jobs = default_jobs(len(cells), cells_per_gpu) if jobs is None else jobs
    threads, before = cell_threads(base, jobs), torch.get_num_threads()
    workers = base.workers if base.workers is not None else (4 if device.type == "cuda" else 0)
    log.info("plan %s: measuring %d training steps of each of %d cells on %s%s (the bar's ETA: the measuring's own "
             "time, each cell weighted by its tokens and parameters); nothing is trained or kept", name,
             2 + steps * passes, len(cells),
             "CPU" if device.type == "cpu" else device_name(device),
             "" if live_samples == 0 else ", then one retrieval cell's live evaluation")
    torch.set_num_threads(threads)  # measured as each cell will run
    try:
        rows = _measured_rows(name, cells, device, measure_batch, steps, passes, workers, progress)
        retrieval = [c for c in cells if c.setup == "retrieval"]
        live = (measure_live_eval(max(retrieval, key=lambda c: (c.nodes, cell_parameters(c.arch, c.size, c.nodes))),
                                  device, live_samples) if retrieval and live_samples != 0 else None)
    finally:
        torch.set_num_threads(before)
    df = pd.DataFrame(rows)
    hidden = ["data cores", *(["busy h"] if df["busy h"].isna().all() else [])]
    table = df.drop(columns=hidden).to_markdown(index=False, floatfmt=".3g")
    return f"{table}\n\n" + plan_parts(name, cells, df, jobs, threads, device, workers, cells_per_gpu, live,
                                        steps, passes)


def _measuring_cost(cell: TrainConfig) -> float:
    """A rough weight of measuring a cell, for the plan's ETA: its tokens a sample times its parameters. The paper
    grid's heaviest cell (n=64 retrieval, 2M) weighs ~480x its lightest and comes last: a bar counting cells
    reads an ETA many times too short."""
    return _cost(cell) / cell.samples * cell_parameters(cell.arch, cell.size, cell.nodes)


def _measured_rows(name: str, cells: list[TrainConfig], device: torch.device, measure_batch: int | None,
                   steps: int, passes: int, workers: int, progress: bool) -> list[dict]:
    """Every cell's plan row, measured in turn under a bar weighted by ``_measuring_cost``."""
    weights = [_measuring_cost(c) for c in cells]
    total = sum(weights)
    bar = tqdm(total=100.0, desc=f"plan {name}: {len(cells)} cells", unit="%", disable=not progress,
               bar_format="{l_bar}{bar}| {n:.0f}% [{elapsed}<{remaining}{postfix}]")
    rows = []
    try:
        for cell, weight in zip(cells, weights):
            bar.set_postfix_str(f"measuring {cell.name}")
            rows.append(_plan_row(cell, device, measure_batch or cell.batch_size, steps, passes, workers))
            bar.update(100.0 * weight / total)
    finally:
        bar.close()
    return rows


def _plan_row(cell: TrainConfig, device: torch.device, batch: int, steps: int, passes: int, workers: int) -> dict:
    """One cell's line of the plan: its step as its run takes it, and its hours (training, teacher-forced
    evaluations, data generation where inline, GPU-busy where CUDA)."""
    m = measure_cell(cell, device, batch, steps, passes=passes, busy=device.type == "cuda")
    scale = cell.batch_size / batch
    n_steps = cell.samples // cell.batch_size
    n_evals = max(1, cell.samples // cell.eval_every)
    train_h = n_steps * m["step_s"] * scale / 3600
    eval_h = n_evals * cell.eval_samples / batch * m["forward_s"] / 3600
    data_h = cell.samples * m["gen_s_per_sample"] / 3600
    busy = m["busy_s"] / m["step_s"] if m["busy_s"] is not None else None  # the share of a step the GPU is busy
    return {"cell": cell.name, "padded tokens/sample": round(m["tokens"]), "ran": _ran(m),
            "step ms": 1000 * m["step_s"] * scale, "spread": m["spread"], "data share": data_h / (train_h + data_h),
            "train h": train_h, "eval h": eval_h, "data h (1 worker)": data_h,
            "cell h": train_h + eval_h + (data_h if workers == 0 else 0.0),
            "busy h": (train_h + eval_h) * busy if busy is not None else None,
            "data cores": cell.batch_size / (m["step_s"] * scale) * m["gen_s_per_sample"]}


def _ran(m: dict) -> str:
    return "graphs" if m["graphs"] else "packed" if m["packing"] == "on" else "eager"


def plan_parts(name: str, cells: list[TrainConfig], df, jobs: int, threads: int, device: torch.device, workers: int,
               cells_per_gpu: int, live: dict | None, steps: int, passes: int) -> str:
    """The projection's parts under the plan's table, each saying how it was had."""
    where = "this CPU" if device.type == "cpu" else device_name(device)
    samples = sorted({c.samples for c in cells})
    wall, serial = _makespan(list(df["cell h"]), jobs), df["cell h"].sum()
    ran = df["ran"].value_counts()
    lines = [f"grid '{name}' on {where}: {len(cells)} cells of {'/'.join(f'{n:,}' for n in samples)} samples; each "
             f"step the median of {passes} pass(es) over {steps} batches at the quantiles of its lengths, after 2 "
             f"warm-up steps (largest spread between passes: {df['spread'].max():.0%}); steps as each run takes "
             f"them: {', '.join(f'{ran[k]} {k}' for k in ran.index)}",
             f"- serial: {_duration(serial)} (cells one at a time: training, teacher-forced evaluation"
             f"{', inline data generation' if workers == 0 else ''})"]
    if df["busy h"].notna().all():
        lines.append(f"- GPU-busy: {_duration(df['busy h'].sum())} (the steps' kernel time: every launch gap removed)")
    shared = (f"; {cells_per_gpu} cells a GPU taken at their speed alone, an upper bound on the gain "
              f"(benchmarks/train_throughput.py --side-by-side {cells_per_gpu} measures it)"
              if device.type == "cuda" and cells_per_gpu > 1 else "")
    lines.append(f"- as the grid runs: about {_duration(wall)} of wall time ({jobs} at a time with {threads} "
                 f"thread(s) each, longest first{shared})")
    live_h = 0.0
    if live is not None:
        retrieval = [c for c in cells if c.setup == "retrieval"]
        live_h = live["s_per_sample"] * sum(c.eval_samples for c in retrieval) / 3600
        lines.append(f"- live evaluation of the {len(retrieval)} retrieval cells: {_duration(live_h)} serial (timed "
                     f"on {live['samples']} test samples of the longest retrieval cell at batch {live['batch']}, its "
                     f"fresh model writing the gold traces: {live['tokens_per_sample']:.0f} tokens and "
                     f"{live['tool_calls_per_sample']:.0f} tool calls a sample, {live['accuracy']:.0%} right; a "
                     f"whole evaluation's steps replayed over its test samples' traces, rows refilled as they finish: "
                     f"{_duration(live['run_s'] / 3600)} a cell, {_duration(live['static_run_s'] / 3600)} in static "
                     "batches; "
                     "the direct and CoT cells' live evaluations not timed)")
    worst = df.loc[df["data cores"].idxmax()]
    if workers:
        binds = int((df["data cores"] > workers).sum())
        lines.append(f"- data generation: {'keeps up in every cell' if not binds else f'binds in {binds} cells'} "
                     f"({workers} workers a cell; most needed: {worst['data cores']:.2f} cores, {worst['cell']})")
    else:
        lines.append(f"- data generation: inline (no workers), in the hours above: {df['data share'].mean():.0%} "
                     f"of a cell's training on average")
    if any(c.samples > ONE_MILLION for c in cells):
        share = {c.name: min(1.0, ONE_MILLION / c.samples) for c in cells}
        at_1m = [h * share[c] for c, h in zip(df["cell"], df["cell h"])]
        lines.append(f"- at 1M samples a run (the paper's stated minimum): serial {_duration(sum(at_1m))}, as the "
                     f"grid runs {_duration(_makespan(at_1m, jobs))}"
                     + (f", live evaluation {_duration(live_h)} (the same test samples)" if live is not None else ""))
    return "\n".join(lines)


def _makespan(hours: list[float], jobs: int) -> float:
    """Wall time of running cells ``jobs`` at a time, longest first, each on the first free slot."""
    slots = [0.0] * max(1, jobs)
    for h in sorted(hours, reverse=True):
        slots[slots.index(min(slots))] += h
    return max(slots)


def _duration(hours: float) -> str:
    return f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.1f} h"


def device_name(device: torch.device) -> str:
    """What a measurement ran on, for the lines benchmarks and the planner print."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


# ------------------------------------------------------------------------------------------ report
PROTOCOL_NOTE = ("TF EM (test): teacher-forced exact match on the test split, the paper's metric. checkpoint last: the "
                 "final weights, whose last validation is the number (the paper's protocol); best: the checkpoint "
                 "with the best EM on a validation split disjoint from the test split. live acc: greedy generation "
                 "through the eval engine on the test split, the kept checkpoint.")


def _read_result(path: Path) -> dict | None:
    """A cell's result.json; one that does not parse (cut short by a full disk or an outside edit) is left out of
    the report with a warning naming it, never a crash of the report of every other cell."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s is not a readable result (%s); that cell is left out of the grid's report. Move the file "
                    "away and rerun the grid to redo the cell", path, e)
        return None


def write_grid_report(root: Path) -> str:
    """Collect every finished run under ``root`` into results.csv / results.md and the paper-style figure."""
    import pandas as pd

    rows = [r for r in (_read_result(p) for p in sorted(root.glob("*/result.json")))
            if r is not None and r.get("task") == "istree"]
    if not rows:
        return ""
    df = pd.DataFrame(rows)
    for col in ("accuracy", "accuracy_se"):
        if col not in df:
            df[col] = float("nan")
    # Runs finished before the protocol was recorded kept their best checkpoint by EM on the very samples they
    # report it on: shown as such, never as the paper's number.
    for col in ("checkpoint", "checkpoint_samples", "best_samples"):
        if col not in df:
            df[col] = None
    old = df["checkpoint"].isna()
    df["checkpoint"] = df["checkpoint"].where(~old, "best on the reported samples (old run)")
    df["checkpoint_samples"] = df["checkpoint_samples"].where(~old, df["best_samples"])
    df = df[["setup", "nodes", "size", "arch", "trainable_parameters", "teacher_forced_em", "checkpoint",
             "checkpoint_samples", "accuracy", "accuracy_se", "samples", "final_loss", "samples_per_second",
             "train_seconds"]]
    df = df.sort_values(["setup", "nodes", "size", "arch"], key=lambda s: s.map(_order) if s.name == "arch" else s)
    write_atomic(root / "results.csv", df.to_csv(index=False))
    shown = df.assign(teacher_forced_em=[f"{100 * e:.1f}" for e in df.teacher_forced_em],
                      checkpoint_samples=[f"{int(n):,}" if pd.notna(n) else "" for n in df.checkpoint_samples],
                      accuracy=[f"{100 * a:.1f} ± {100 * s:.1f}" if a == a else "n/a"
                                for a, s in zip(df.accuracy, df.accuracy_se)]) \
        .drop(columns=["accuracy_se"]).rename(columns={"teacher_forced_em": "TF EM (test)", "accuracy": "live acc",
                                                       "checkpoint_samples": "at samples"})
    table = shown.to_markdown(index=False, floatfmt=".3f") + "\n\n" + PROTOCOL_NOTE
    write_atomic(root / "results.md", table + "\n")
    plot_grid(df, root / "istree_grid.png")
    return table


def _order(arch: str) -> int:
    return ARCH_ORDER.index(arch) if arch in ARCH_ORDER else len(ARCH_ORDER)


def plot_grid(df, path: Path) -> None:
    """Teacher-forced EM per architecture, one panel per (setup, graph size), sizes side by side: the paper's
    layout (its metric); live greedy accuracy as a hollow marker on each bar."""
    plt = pyplot()

    setups = [s for s in istree.SETUPS if s in set(df.setup)]
    nodes = sorted(set(df.nodes))
    sizes = list(dict.fromkeys(df["size"]))
    archs = [a for a in ARCH_ORDER if a in set(df.arch)]
    fig, axes = plt.subplots(len(setups), len(nodes), figsize=(3.2 * len(nodes) + 0.6, 2.6 * len(setups)),
                             squeeze=False, sharey=True)
    width = 0.8 / len(archs)
    for r, setup in enumerate(setups):
        for c, n in enumerate(nodes):
            ax = axes[r][c]
            sub = df[(df.setup == setup) & (df.nodes == n)]
            for k, arch in enumerate(archs):
                xs, em, live = [], [], []
                for i, s in enumerate(sizes):
                    row = sub[(sub["size"] == s) & (sub.arch == arch)]
                    if len(row):
                        xs.append(i + k * width)
                        em.append(100 * float(row.teacher_forced_em.iloc[0]))
                        live.append(100 * float(row.accuracy.iloc[0]))
                ax.bar(xs, em, width, label=arch, color=f"C{k}")
                ax.plot(xs, live, "o", mfc="none", mec="black", ms=5, label="live greedy" if k == 0 else None)
            ax.set_xticks([i + width * (len(archs) - 1) / 2 for i in range(len(sizes))], sizes)
            ax.set_ylim(0, 100)
            if setup == "direct":  # chance for a bare verdict; a trace's EM has no such floor
                ax.axhline(50, color="grey", lw=0.6, ls=":")
            ax.set_title(f"{setup}, n={n}", fontsize=9)
            if c == 0:
                ax.set_ylabel("teacher-forced EM, test split (%)")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    save(fig, path, dpi=130)
