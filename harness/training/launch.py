"""A grid's cells on a scheduler: SLURM through submitit (``--launcher slurm``), or submitit's local executor
(``--launcher submitit-local``: the same code path on one machine, which is how CI tests it). The default,
``--launcher processes``, is ``grid.train_in_processes`` on this machine.

SLURM through submitit rather than Ray: the GPU clusters this grid is run on already schedule with SLURM and
grant GPUs through it; submitit needs no daemon or cluster of its own, and a job array maps one to one onto
the grid's cells. The guarantees stay the trainer's own: a cell's directory lock admits one process, a killed
or preempted cell resumes from its last evaluation (SLURM's pre-timeout signal requeues it through
``CellJob.checkpoint``), result.json is written atomically, and the report is written once, here, when every
cell has ended."""
from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from harness.engine.config import ConfigError
from harness.procs import exit_description
from harness.training.config import LAUNCHERS, TrainConfig
from harness.training.trainer import finished_result, train_one

log = logging.getLogger("harness")

class CellJob:
    """One cell as a submitit job: trains it (or returns its finished result) in the job's process."""

    def __init__(self, threads: int | None = None):
        self.threads = threads

    def __call__(self, cfg: TrainConfig, overwrite: bool = False) -> dict:
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        logging.basicConfig(level=logging.INFO)
        return train_one(cfg, progress=False, overwrite=overwrite)

    def checkpoint(self, cfg: TrainConfig, overwrite: bool = False):
        """Called by submitit before a timeout or preemption: the same cell again, resuming (never overwriting)
        from the state the trainer saved at its last evaluation."""
        import submitit

        return submitit.helpers.DelayedSubmission(CellJob(self.threads), cfg, False)


def job_error(e: Exception) -> str:
    """How a scheduler's job died, out of submitit's report of it: the scheduler's state (OUT_OF_MEMORY, TIMEOUT,
    CANCELLED, ...) or a signal where it names one, else the job's own error message."""
    text = str(e)
    state = re.search(r"state[:=]\s*'?([A-Z_]{4,})", text)
    if state and state.group(1) not in ("COMPLETED", "RUNNING"):
        return f"the scheduler ended it: {state.group(1)}"
    code = re.search(r"(?:exit(?:ed with)? code|exitcode)[:= ]+(-?\d+)", text, re.IGNORECASE)
    if code and int(code.group(1)) != 0:
        return exit_description(int(code.group(1)))
    lines = [line for line in text.splitlines()
             if line.strip() and not line.startswith(("-", " ", "You can check", "Traceback"))]
    for line in reversed(lines):
        found = re.match(r"^[\w.]+(?:Error|Exception|Interrupt)\w*: (.*)", line)
        if found:
            return found.group(1)
    return lines[-1] if lines else type(e).__name__


def executor(launcher: str, folder: Path, name: str, jobs: int, threads: int, gpus: int, timeout_min: int,
             partition: str | None):
    """A submitit executor for the grid's cells (one GPU and ``threads`` CPUs a cell where the grid has GPUs)."""
    try:
        import submitit  # optional: only a grid run through a scheduler needs it
    except ImportError:
        raise ConfigError(f"--launcher {launcher} needs submitit: pip install 'icr-harness[cluster]'") from None
    ex = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm" if launcher == "slurm" else "local")
    params = {"name": f"icr-{name}", "timeout_min": timeout_min, "cpus_per_task": threads, "gpus_per_node": gpus,
              "tasks_per_node": 1, "nodes": 1}
    if launcher == "slurm":
        params.update(slurm_array_parallelism=jobs, slurm_signal_delay_s=120)
        if partition:
            params["slurm_partition"] = partition
    ex.update_parameters(**params)
    return ex


def run_on_scheduler(launcher: str, name: str, cells: list[TrainConfig], root: Path, jobs: int, threads: int,
                     overwrite: bool, timeout_min: int = 72 * 60, partition: str | None = None,
                     poll_s: float = 1.0) -> list[dict]:
    """Submit every unfinished cell and wait for all of them: SLURM takes the whole grid as one job array
    (``jobs`` cells at once); the local executor starts ``jobs`` cells at a time. A failed cell is named at the
    end; the others still train."""
    import torch

    if launcher not in LAUNCHERS[1:]:
        raise ConfigError(f"--launcher {launcher}: choose {', '.join(LAUNCHERS)}")
    if timeout_min < 1:
        raise ConfigError(f"--timeout-min {timeout_min}: use 1 or more minutes")
    finished = {c.output: None if overwrite else finished_result(c) for c in cells}
    todo = [c for c in cells if finished[c.output] is None]
    results = [r for r in finished.values() if r is not None]
    if not todo:
        return results
    gpus = 1 if torch.cuda.is_available() or launcher == "slurm" else 0
    local_gpus = torch.cuda.device_count() if launcher != "slurm" else 0  # cells share them round robin
    ex = executor(launcher, root / "submitit", name, jobs, threads, gpus, timeout_min, partition)
    job = CellJob(threads)
    log.info("grid %s: %d cell(s) to %s (%d at a time); logs in %s", name, len(todo), launcher, jobs,
             root / "submitit")
    running: list = []  # (job handle, cell, slot)
    failed: list[str] = []
    if launcher == "slurm":
        running = [(h, c, None) for h, c in zip(ex.map_array(job, todo, [overwrite] * len(todo)), todo)]
        pending = []
    else:
        pending = list(todo)
    free = list(range(jobs))
    try:
        while pending or running:
            while pending and free:
                cell, slot = pending.pop(0), free.pop(0)
                if local_gpus:
                    ex.update_parameters(visible_gpus=[slot % local_gpus])
                running.append((ex.submit(job, cell, overwrite), cell, slot))
            for item in [r for r in running if r[0].done()]:
                running.remove(item)
                handle, cell, slot = item
                free.append(slot)
                try:
                    results.append(handle.result())
                except Exception as e:  # submitit re-raises the job's error here, with its log's path
                    failed.append(f"{cell.name}: {job_error(e)[:300]}")
            time.sleep(poll_s)
    finally:
        for handle, _, _ in running:  # an interrupted grid leaves no cell training unseen; reruns resume them
            handle.cancel(check=False)
    if failed:
        raise ConfigError(f"grid {name}: {len(failed)} cell(s) failed ({'; '.join(failed)}); logs under "
                          f"{root / 'submitit'}; the other cells are finished and kept; rerun the same command to "
                          "retry them")
    return results
