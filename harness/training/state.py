"""A training run's directory: the same guarantees as an evaluation's, for the trainer.

  .lock / .lock.json     one process trains into a directory at a time (``harness.engine.runlog.RunLock``)
  train_run.json         the settings that decide the run's numbers; a rerun with others is refused by name
  .training_state.pt     model, optimizer, scheduler, RNG, the step reached (the data stream's position),
                         the curve and the kept checkpoint so far: written atomically at every evaluation, so a
                         killed run continues where it stopped and ends with the weights and curve of one never
                         killed; removed once result.json is written
  model.safetensors ...  the kept (last or best) checkpoint with its tokenizer and icr_task.json, replaced file by file
                         through renames: a crash or a full disk leaves the previous checkpoint whole
  train_log.jsonl        the curve, rewritten from the state on resume (a killed attempt's later rows go)
  tracker/               the tracker's curves; a killed attempt's are moved to .killed/ and the curve up to the
                         resumed step is logged again, so the two never mix
  result.json            written last, atomically: the run is finished

accelerate's ``save_state`` writes several files in place (a kill mid-save leaves a mix), so the mid-run state
is one ``torch.save`` renamed into place."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from harness.engine.runlog import describe_changes
from harness.engine.runlog import RunDirError, move_aside
from harness.files import write_atomic

log = logging.getLogger("harness")

STATE_FILE = ".training_state.pt"
SETTINGS_FILE = "train_run.json"


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, a checkpoint that cannot be written); says what was kept."""


@dataclasses.dataclass
class Progress:
    """What a run has reached; saved with the weights so a resumed run continues exactly."""

    step: int = 0  # the next optimizer step to run (the data stream's position)
    curve: list = dataclasses.field(default_factory=list)
    best_em: float = -1.0  # validation EM of the kept checkpoint (the latest one with --checkpoint last)
    best_samples: int = 0  # samples the kept checkpoint had seen (0: none kept yet)
    best_state: dict | None = None  # CPU copy of the best weights (--checkpoint best only)
    first_loss: float | None = None
    train_s: float = 0.0  # the training loop's wall time, its evaluations included (not its saves)
    data_s: float = 0.0
    eval_s: float = 0.0  # of train_s: the teacher-forced evaluations
    attempts: int = 1


def recorded_settings(out: Path, added: dict | None = None) -> dict:
    """The settings a run in ``out`` was started with (``added``: the values of settings it predates), or {}."""
    try:
        prev = json.loads((out / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {**(added or {}), **prev} if prev else {}


def check_settings(out: Path, settings: dict, overwrite: bool, added: dict | None = None) -> None:
    """Refuse a directory that holds (or held, killed) a training run of other settings; record ours. ``added``:
    settings recorded only since some release, with the value a run that predates them had."""
    path = out / SETTINGS_FILE
    if path.exists():
        try:
            prev = json.loads(path.read_text())
        except (OSError, ValueError):
            prev = {}
        if prev:
            prev = {**(added or {}), **prev}
        if prev != settings and not overwrite:
            raise RunDirError(f"{out} holds a training run of other settings: {describe_changes(prev, settings)}. "
                              "Use another --output, or --overwrite to start over (its files are moved aside, "
                              "not deleted).")
    if overwrite:
        move_aside(out)
    write_atomic(path, json.dumps(settings, indent=2, default=str))


def save_state(out: Path, model, opt, sched, progress: Progress, processes: int) -> None:
    """The whole mid-run state in one file, renamed into place (a kill leaves the previous one)."""
    state = {"model": {k: v.detach().to("cpu") for k, v in model.state_dict().items()},
             "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "progress": dataclasses.asdict(progress),
             "rng": {"torch": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
             "processes": processes}
    tmp = out / f"{STATE_FILE}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out / STATE_FILE)
    except Exception as e:  # noqa: BLE001  a full disk, a file-size limit, ...
        tmp.unlink(missing_ok=True)
        raise TrainingError(f"could not save the training state into {out} ({type(e).__name__}: {e}); the previous state and "
                            "checkpoint are kept; free disk space and rerun the same command to continue") from e


def load_state(out: Path, model, opt, sched, processes: int) -> Progress | None:
    """The saved state put back into ``model``/``opt``/``sched``; None when there is none."""
    path = out / STATE_FILE
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001  a state torch cannot read is a state we do not have
        raise RunDirError(f"{path} cannot be read ({type(e).__name__}: {e}); move it away to train from the start")
    if state["processes"] != processes:
        raise RunDirError(f"{path} was saved by {state['processes']} process(es) and this run has {processes}: each "
                          "process draws its own data stream, so the run cannot continue exactly. Rerun with "
                          f"{state['processes']} process(es), or --overwrite to start over.")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    progress = Progress(**state["progress"])
    progress.attempts += 1
    return progress


def drop_state(out: Path) -> None:
    (out / STATE_FILE).unlink(missing_ok=True)


def save_checkpoint(out: Path, model, tokenizer, task_meta: dict[str, Any]) -> None:
    """The kept checkpoint, written into a hidden folder and renamed over the old files one by one: every file
    of the kept checkpoint is always whole, and a failed write (a full disk) leaves the previous one."""
    from transformers.utils import logging as hf_logging

    tmp = out / f".checkpoint.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one "Writing model shards" bar per kept checkpoint is noise
    try:
        tmp.mkdir()
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "icr_task.json").write_text(json.dumps(task_meta, indent=2))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        for f in sorted(tmp.iterdir(), key=lambda p: p.suffix == ".safetensors"):  # weights last
            os.replace(f, out / f.name)
        _fsync_dir(out)
    except Exception as e:  # noqa: BLE001  OSError, and what safetensors raises for the same failure
        raise TrainingError(f"could not write the checkpoint into {out} ({type(e).__name__}: {e}); the previous "
                            "checkpoint is kept; free disk space and rerun the same command to continue") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            hf_logging.enable_progress_bar()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rewrite_log(out: Path, curve: list[dict]) -> None:
    """train_log.jsonl as the curve up to the resumed step: a killed attempt's later rows never mix in."""
    write_atomic(out / "train_log.jsonl", "".join(json.dumps(r) + "\n" for r in curve))


def retire_tracker(out: Path) -> None:
    """A killed attempt's tracker files go to ``.killed/`` (the rerun logs the curve so far again)."""
    tracker = out / "tracker"
    if tracker.exists():
        dest = out / ".killed" / f"tracker-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S.%f')}"
        dest.parent.mkdir(exist_ok=True)
        os.replace(tracker, dest)
        log.info("%s: the killed attempt's tracker curves were moved to %s", out, dest)
