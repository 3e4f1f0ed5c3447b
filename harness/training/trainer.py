"""One training run, readable top to bottom: build the model, optimizer and data (``Trainer.__init__``), start
or resume (``run``), the loop (``train``), the paper's metric on held-out samples (``evaluate``), and the kept
checkpoint reported and evaluated live through the eval engine (``finish``).

Defaults follow the paper's code: AdamW (weight decay 0), cosine schedule with a 10,000-sample warm-up, a
global batch of 64 (split over processes), lr 1e-3 for the Transformer and 3e-4 for Mamba and the hybrid,
fresh samples every step, mamba-ssm's initialisation. Every ``--eval-every`` samples the model is scored by
the paper's metric, teacher-forced exact match on held-out samples (every target token right, tool results
given). The reported number follows the paper: the last validation, on the test split, of the final weights
(``--checkpoint last``). ``--checkpoint best`` instead validates on a separate validation split, keeps the
best checkpoint there, and reports that checkpoint on the test split, never on the samples it was chosen on.
The kept checkpoint is written with ``save_pretrained`` next to its tokenizer and task, and evaluated once
more by live greedy generation through the eval engine on the test split (the retrieval tool live), so
``python -m harness.eval --model RUN_DIR --task istree`` reproduces that number.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import logging
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from harness.backends.hf import TransformersBackend
from harness.engine.config import ConfigError, RunConfig
from harness.cache import cache_dir
from harness.engine.run import run_eval
from harness.engine.runlog import ResumeMismatchError, RunDirError, RunLock
from harness.files import write_json
from harness.models.istree import scans_ran, trainable_parameters
from harness.models.packing import one_row_on, pack
from harness.reports.plotting import pyplot, save
from harness.training.config import ADDED_SETTINGS, PAPER_DEFAULTS, RESULT_DECIDING, TrainConfig, graphs_setting
from harness.training.step import (lr_at, masked_loss, new_model, new_optimizer, optimizer_step, rate_on_device,
                                   uses_bf16)
from harness.training.step_graphs import GraphedSteps, check_graphed_steps
from harness.training.data import PAD, TrainingBatches, TrainTask, batch_from_tokens, packing_setting
from harness.training.state import (
    Progress,
    TrainingError,
    check_settings,
    drop_state,
    recorded_settings,
    load_state,
    retire_tracker,
    rewrite_log,
    save_checkpoint,
    save_state,
)
from harness.training.store import ensure_store

log = logging.getLogger("harness")

@torch.no_grad()
def teacher_forced(model, batches, autocast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paper's metric on pre-built held-out batches: per batch, the summed loss, the number of samples whose
    every target token is the argmax, and the sample count (tensors: summed over processes by the caller)."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    loss = torch.zeros((), device=dev)
    right = torch.zeros((), device=dev)
    count = torch.zeros((), device=dev)
    for ids, mask in batches:
        ids, mask = ids.to(dev), mask.to(dev)
        with autocast():
            logits = model(input_ids=ids).logits
        ok = (logits[:, :-1].argmax(-1) == ids[:, 1:]) | (mask[:, 1:] == 0)
        right += ok.all(dim=1).sum()
        count += len(ids)
        loss += masked_loss(logits, ids, mask) * len(ids)
    model.train(was_training)
    return loss, right, count


def _tracker(cfg: TrainConfig) -> str | None:
    if cfg.report_to == "auto":
        return "tensorboard" if importlib.util.find_spec("tensorboard") else None
    return None if cfg.report_to == "none" else cfg.report_to


def train_one(cfg: TrainConfig, progress: bool = True, overwrite: bool = False) -> dict:
    """Train one model (or return the finished result; a killed run continues from its last evaluation), keep
    the last (or best on validation) checkpoint, report it on the test split, evaluate it live, save it."""
    if cfg.output is None or any(getattr(cfg, k) is None for k in PAPER_DEFAULTS):
        cfg = cfg.resolved()
    if not overwrite:
        finished = finished_result(cfg)
        if finished is not None:
            log.info("%s: finished earlier, skipped", cfg.output)
            return finished
    trainer = Trainer(cfg, progress, overwrite)
    lock = RunLock(cfg.output).acquire() if trainer.acc.is_main_process else None
    try:
        return trainer.run(overwrite)
    finally:
        if lock is not None:
            lock.release()


AUTO_SETTINGS = ("cuda_graphs", "packing")  # how steps run, not what they compute: auto takes either way


def finished_result(cfg: TrainConfig) -> dict | None:
    """result.json of a finished run with these settings; None if unfinished; refused if of other settings."""
    done = Path(cfg.output) / "result.json"
    if not done.exists():
        return None
    try:
        earlier = json.loads(done.read_text())
    except ValueError as e:
        raise RunDirError(f"{done} is not valid JSON ({e}); move it away and rerun to finish the run") from None
    # A run finished before the protocol was recorded kept its best checkpoint on the samples it reports.
    earlier.setdefault("checkpoint", "best on the reported samples (before the checkpoint protocol)")
    changed = [k for k in RESULT_DECIDING if k in earlier and earlier[k] != getattr(cfg, k)
               and not (k in AUTO_SETTINGS and getattr(cfg, k) == "auto")]  # auto may have been either
    if changed:
        raise ConfigError(f"{cfg.output} holds a finished run with other settings ("
                          + ", ".join(f"{k}: {earlier[k]!r} there, {getattr(cfg, k)!r} now" for k in changed)
                          + "); use another --output, the same settings, or --overwrite to start over")
    return earlier


class Trainer:
    """One training run, in the order it happens: build (``__init__``), start or resume, the loop, finish."""

    def __init__(self, cfg: TrainConfig, progress: bool, overwrite: bool = False):
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        self.cfg, self.out, self.show = cfg, Path(cfg.output), progress
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.tracker = _tracker(cfg)
        self.acc = acc = Accelerator(cpu=not torch.cuda.is_available(), log_with=self.tracker,
                                     project_config=ProjectConfiguration(project_dir=str(self.out),
                                                                         logging_dir=str(self.out / "tracker")))
        if cfg.batch_size % acc.num_processes:
            raise ConfigError(f"--batch-size {cfg.batch_size} is the global batch and must split evenly over "
                              f"{acc.num_processes} processes")
        self.per_process = cfg.batch_size // acc.num_processes
        cuda = acc.device.type == "cuda"
        self.bf16 = uses_bf16(cfg, acc.device)
        # an auto setting resumes as the run it resumes began (one started before auto existed: off)
        started = {} if overwrite else recorded_settings(self.out, ADDED_SETTINGS)
        self.graphs_setting = graphs_setting(cfg, acc.device.type, acc.num_processes)
        if cfg.cuda_graphs == "auto" and started.get("cuda_graphs") in ("on", "off"):
            self.graphs_setting = started["cuda_graphs"]
        if self.graphs_setting == "on" and (not cuda or acc.num_processes > 1):
            raise ConfigError(f"--cuda-graphs on replays steps on one CUDA device (this run: {acc.num_processes} "
                              f"process(es) on {acc.device}); use --cuda-graphs off")
        self.task = TrainTask(cfg)
        self.one_row = one_row_on(acc.device.type)
        self.packing, self.packed_share = packing_setting(cfg, self.task, self.per_process, acc.device.type)
        if cfg.packing == "auto" and started.get("packing") in ("on", "off") and started["packing"] != self.packing:
            self.packing, self.packed_share = packing_setting(
                dataclasses.replace(cfg, packing=started["packing"]), self.task, self.per_process, acc.device.type)
        if self.packing == "on" and self.graphs_setting != "off":
            # packed batches change shape from step to step: graphs would replay few of them
            (log.warning if self.graphs_setting == "on" else log.info)(
                "%s: packed rows (%.0f%% of the padded tokens): training steps run eagerly, without CUDA graphs "
                "(--packing off keeps them)", cfg.name, 100 * self.packed_share)
            self.graphs_setting = "off"
        # auto's check of graphed steps against eager ones, before the run's own seed is set
        self.graphs_check = self.check_graphs() if self.graphs_setting == "auto" else None
        graphs = self.graphs_setting == "on" or bool(self.graphs_check and self.graphs_check["ok"])
        torch.manual_seed(cfg.seed)
        self.vocab = {t: i for i, t in enumerate(self.task.vocab)}
        model = new_model(cfg, self.task)
        self.n_params = trainable_parameters(model)
        self.model, self.opt = acc.prepare(model, new_optimizer(cfg, model.to(acc.device), acc.device, graphs))
        self.graphed = GraphedSteps(self.model, self.opt, acc.device.type, self.bf16) if graphs else None
        self.steps = max(1, cfg.samples // cfg.batch_size)
        warm = max(1, cfg.warmup // cfg.batch_size)
        steps = self.steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_at(s, steps, warm))
        self.workers = cfg.workers if cfg.workers is not None else (4 if cuda else 0)
        self.store = None
        if cfg.store:
            self.store = ensure_store(self.task, cfg.store, Path(cfg.store_dir or cache_dir() / "stores"),
                                      workers=self.workers)
        # The split the curve is validated on: the test split itself under the paper's protocol (nothing is chosen
        # on it), a disjoint validation split where the best checkpoint is chosen.
        validation = self.task.validation() if cfg.checkpoint == "best" else self.task.heldout()
        if not validation:
            raise ConfigError(f"--checkpoint best: every validation sample is also a test sample (IsTree graphs of "
                              f"{cfg.nodes} nodes repeat); use --checkpoint last or a larger task")
        self.eval_batches = self.batched(validation)
        self.n_heldout = len(validation)
        self.every = max(1, cfg.eval_every // cfg.batch_size)
        self.log_every = max(1, min(self.every, self.steps // 100))
        self.state = Progress()

    def batched(self, sequences: list[list[str]], share: bool = True) -> list:
        """Held-out sequences in evaluation batches: this process's share (``share``), or all of them."""
        mine = sequences[self.acc.process_index::self.acc.num_processes] if share else sequences
        size = self.cfg.eval_batch_size
        return [batch_from_tokens(mine[i:i + size], self.vocab, "cpu") for i in range(0, len(mine), size)]

    def autocast(self):
        return torch.autocast(self.acc.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def check_graphs(self) -> dict:
        """``--cuda-graphs auto``: graphed steps of this cell against eager ones (fresh models and the cell's own
        batches under a moving rate: ``check_graphed_steps``) before the run's model exists; graphs run only
        where they agree, else the run trains as ``off`` would, the reason logged and kept for result.json."""
        r = check_graphed_steps(self.cfg, self.acc.device, self.per_process)
        check = {k: r[k] for k in ("loss_diff", "weight_diff", "eager_loss_floor", "eager_weight_floor", "speedup",
                                   "ok")}
        # a graph that replays a slower kernel choice (the H100 ran a Transformer's 2,535-token step at 0.49x)
        # is exact but no gain: auto keeps such a cell eager
        slower = self.acc.device.type == "cuda" and r["speedup"] < 1.0
        if r["ok"] and not slower:
            log.info("%s: training steps replay from CUDA graphs (8 graphed steps equal eager ones: losses within "
                     "%.1e, weights %.1e; %.1fx faster)", self.cfg.name, r["loss_diff"], r["weight_diff"], r["speedup"])
            return check
        why = r.get("why") or f"graphed steps are slower here ({r['speedup']}x the eager step)"
        log.warning("%s: --cuda-graphs auto: training eagerly: %s", self.cfg.name, why)
        return {**check, "ok": False, "why": why}

    # -- start or resume ----------------------------------------------------------------------------------
    def run(self, overwrite: bool) -> dict:
        cfg, acc = self.cfg, self.acc
        if acc.is_main_process:
            settings = {k: getattr(cfg, k) for k in RESULT_DECIDING}
            check_settings(self.out, {**settings, "cuda_graphs": self.graphs_setting, "packing": self.packing},
                           overwrite, ADDED_SETTINGS)
        acc.wait_for_everyone()
        resumed = load_state(self.out, acc.unwrap_model(self.model), self.opt, self.sched, acc.num_processes)
        if resumed is not None and acc.device.type == "cuda":
            rate_on_device(self.opt, acc.device)  # the saved state loads on the CPU
        if resumed is not None:
            self.state = resumed
            log.info("%s: resumed at step %d of %d (%s samples; attempt %d); the curve so far is kept", cfg.name,
                     resumed.step, self.steps, f"{resumed.step * cfg.batch_size:,}", resumed.attempts)
        log.info("%s: %s trainable parameters, %d steps of %d (%d per process x %d), lr %g, %s, %s, %d data workers, "
                 "teacher-forced eval every %d steps on %d %s samples", cfg.name, f"{self.n_params:,}", self.steps,
                 cfg.batch_size, self.per_process, acc.num_processes, cfg.lr, acc.device,
                 "bf16 autocast" if self.bf16 else "float32", self.workers, self.every, self.n_heldout,
                 "validation" if cfg.checkpoint == "best" else "test (= validation: the paper's protocol)")
        log.info("%s: data: %s", cfg.name, f"the {len(self.store):,} samples of the token store {self.store.path}, "
                 "reused in a seeded order each epoch" if self.store else "a fresh sample every step")
        self.state_bytes = model_state_bytes(acc.unwrap_model(self.model), self.task, self.task.max_len)
        log.info("%s: a sequence of %d tokens (the task's longest) leaves %s bytes of model state", cfg.name,
                 self.task.max_len, f"{self.state_bytes:,}")
        if acc.is_main_process:
            rewrite_log(self.out, self.state.curve)
            if resumed is not None:
                retire_tracker(self.out)
        if self.tracker:
            hparams = {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None and k != "task_args"}
            hparams.update({f"task_arg.{k}": v for k, v in cfg.task_args.items()})  # trackers take scalars only
            acc.init_trackers(cfg.name, config=hparams)
            for row in self.state.curve:  # a resumed run's tracker holds the whole curve, once
                self._track(row)
        try:
            if self.state.step < self.steps:
                self.train()
            acc.wait_for_everyone()
            result = self.finish() if acc.is_main_process else None
        finally:
            if self.tracker:
                acc.end_training()
        acc.wait_for_everyone()
        return result or {}

    # -- the loop -----------------------------------------------------------------------------------------
    def batches(self):
        """Batches from the state's step on: pools in order from the DataLoader, split into their batches."""
        cfg, cuda = self.cfg, self.acc.device.type == "cuda"
        start = self.state.step
        loader = torch.utils.data.DataLoader(
            TrainingBatches(self.task, self.per_process, cfg.seed, self.acc.process_index, cfg.bucket,
                            start_pool=start // cfg.bucket, store=self.store, processes=self.acc.num_processes),
            batch_size=None, num_workers=self.workers, pin_memory=cuda,
            prefetch_factor=4 if self.workers else None, persistent_workers=False)
        skip = start % cfg.bucket
        for pool in loader:
            yield from pool[skip:]
            skip = 0

    def train(self) -> None:
        cfg, acc, st = self.cfg, self.acc, self.state
        loss_sum = torch.zeros((), device=acc.device)  # summed on the device: one host sync per log line
        first_bad = torch.full((), -1, dtype=torch.long, device=acc.device)  # first non-finite loss, no sync
        loss_n = 0
        scans_ran(self.model, forget=True)  # the scans of this run's training and evaluation passes only
        self.model.train()
        bar = tqdm(total=self.steps, initial=st.step, desc=cfg.name, unit="step", dynamic_ncols=True,
                   disable=not (self.show and acc.is_main_process))
        batches = self.batches()
        t0 = time.perf_counter()
        with open(self.out / "train_log.jsonl", "a") as logf:
            for step in range(st.step, self.steps):
                t_data = time.perf_counter()
                ids, mask = next(batches)
                packed = pack(ids, mask, self.vocab[PAD], self.one_row).to(acc.device, non_blocking=True) \
                    if self.packing == "on" else None
                ids, mask = (packed.ids, packed.mask) if packed is not None else (
                    ids.to(acc.device, non_blocking=True), mask.to(acc.device, non_blocking=True))
                st.data_s += time.perf_counter() - t_data
                if self.graphed is not None:
                    loss = self.graphed(ids, mask)  # valid until the next step: summed on the device below
                else:
                    loss = optimizer_step(self.model, self.opt, ids, mask, self.autocast(), acc.backward, packed)
                self.sched.step()
                loss_sum += loss.detach()
                first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss.detach()), step, first_bad)
                loss_n += 1
                bar.update(1)
                evaluate_now = (step + 1) % self.every == 0 or step == self.steps - 1
                if step % self.log_every and not evaluate_now:
                    continue
                if float(acc.reduce((first_bad >= 0).float(), "sum")) > 0:  # on any process
                    bad = int(first_bad) if int(first_bad) >= 0 else step
                    self._diverged(f"the training loss became {float(loss_sum)} at step {bad} (sample "
                                   f"{(bad + 1) * cfg.batch_size:,})")
                row = {"step": step, "samples": (step + 1) * cfg.batch_size,
                       "loss": round(float(acc.reduce(loss_sum, "mean")) / loss_n, 6), "lr": float(self.sched.get_last_lr()[0])}
                st.first_loss = row["loss"] if st.first_loss is None else st.first_loss
                loss_sum.zero_()
                loss_n = 0
                if evaluate_now:
                    t_eval = time.perf_counter()
                    self.evaluate(row)
                    st.eval_s += time.perf_counter() - t_eval
                    bar.set_postfix(loss=f"{row['loss']:.4f}", em=f"{100 * row['eval_em']:.1f}%")
                else:
                    bar.set_postfix(loss=f"{row['loss']:.4f}")
                st.curve.append(row)
                self._track(row)
                if acc.is_main_process:
                    logf.write(json.dumps(row) + "\n")
                    logf.flush()
                if evaluate_now:  # the state a killed run resumes from: everything up to this step
                    st.step = step + 1
                    st.train_s += time.perf_counter() - t0
                    if acc.is_main_process:
                        save_state(self.out, acc.unwrap_model(self.model), self.opt, self.sched, st,
                                   acc.num_processes)
                    t0 = time.perf_counter()  # saves are not training time
        bar.close()

    def evaluate(self, row: dict) -> None:
        """The paper's metric on the validation split; the checkpoint kept on disk is the latest one
        (``--checkpoint last``) or the best so far (``best``; ties go to the later, longer-trained one)."""
        acc, st = self.acc, self.state
        tf_loss, right, count = (acc.reduce(t, "sum") for t in teacher_forced(self.model, self.eval_batches,
                                                                              self.autocast))
        row["eval_loss"] = round(float(tf_loss / count), 6)
        row["eval_em"] = int(right) / max(1, int(count))
        if not math.isfinite(row["eval_loss"]):  # the update of this step broke the weights: never keep them
            self._diverged(f"the held-out loss became {row['eval_loss']} at step {row['step']} (evaluated after "
                           f"its update; sample {row['samples']:,})")
        if self.cfg.checkpoint == "last" or row["eval_em"] >= st.best_em:
            model = acc.unwrap_model(self.model)
            st.best_em, st.best_samples = row["eval_em"], row["samples"]
            if self.cfg.checkpoint == "best":  # the last weights are the model's own; only a best needs a copy
                st.best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            if acc.is_main_process:
                save_checkpoint(self.out, model, self.task.tokenizer(), self.task_meta())
        acc.wait_for_everyone()

    def _diverged(self, what: str) -> None:
        st = self.state
        kept = (f"the {self.cfg.checkpoint} checkpoint (teacher-forced EM {100 * st.best_em:.1f}% at "
                f"{st.best_samples:,} samples) and the training state of step {st.step} are kept in {self.out}"
                if st.best_samples else f"no checkpoint was kept (the first evaluation is at step {self.every})")
        raise TrainingError(f"{what}: non-finite, so training stopped; {kept}. Lower --lr (now {self.cfg.lr:g})"
                            f"{' or use --precision fp32' if self.bf16 else ''}, and rerun with --overwrite or "
                            "another --output.")

    def _track(self, row: dict) -> None:
        if self.tracker:
            self.acc.log({f"train/{k}" if k in ("loss", "lr") else k.replace("eval_", "eval/"): v
                          for k, v in row.items() if k not in ("step", "samples")}, step=row["samples"])

    def task_meta(self) -> dict:
        return {"task": self.cfg.task, "args": self.task.eval_args}

    # -- finish -------------------------------------------------------------------------------------------
    def finish(self) -> dict:
        """The kept checkpoint (on disk since its evaluation) reported on the test split and evaluated live;
        result.json written last. Which split and which checkpoint each number comes from is written beside it."""
        cfg, st, out = self.cfg, self.state, self.out
        model = self.acc.unwrap_model(self.model).eval()
        last = st.curve[-1]
        test = (f"test split ({self.task.eval_args['samples']:,} held-out samples, eval_seed "
                f"{self.task.impl.options.eval_seed})")
        if cfg.checkpoint == "best":
            model.load_state_dict(st.best_state)
            # finish runs on the main process alone: it scores the whole test split
            _, right, count = teacher_forced(model, self.batched(self.task.heldout(), share=False), self.autocast)
            protocol = {"teacher_forced_em": int(right) / max(1, int(count)), "teacher_forced_samples": int(count),
                        "reported": f"best checkpoint (at {st.best_samples:,} samples, chosen on the validation "
                                    f"split) on the {test}",
                        "validation": f"validation split ({self.n_heldout:,} samples, disjoint from the test split)",
                        "best_validation_em": st.best_em}
        else:
            protocol = {"teacher_forced_em": last["eval_em"], "teacher_forced_samples": self.n_heldout,
                        "reported": f"last validation (the paper's number): the final weights on the {test}",
                        "validation": "the test split (nothing is chosen on it)"}
        tok = self.task.tokenizer()
        plot_curves(st.curve, out / "curves.png", cfg.name)
        result = {**dataclasses.asdict(cfg), "trainable_parameters": self.n_params, "steps": self.steps,
                  "processes": self.acc.num_processes, "device": str(self.acc.device),
                  "compute_dtype": "bfloat16" if self.bf16 else "float32", "data_workers": self.workers,
                  "first_loss": st.first_loss, "final_loss": last["loss"], **protocol,
                  "checkpoint_samples": st.best_samples, "last_validation_em": last["eval_em"],
                  "data": str(self.store.path) if self.store else "fresh samples every step",
                  "attempts": st.attempts, "state_bytes_at_max_len": self.state_bytes, "max_len": self.task.max_len,
                  "train_seconds": round(st.train_s, 2), "data_seconds": round(st.data_s, 2),
                  # every optimizer step's wall time (the loop without evaluations and saves): the planner predicts it
                  "steps_seconds": round(st.train_s - st.eval_s, 2),  # rounded as train_seconds: never above it
                  "samples_per_second": round(self.steps * cfg.batch_size / max(st.train_s, 1e-9), 1),
                  "curve": st.curve,
                  # which Mamba scan trained it (and whether the Triton scan was checked in that dtype first)
                  "scans": scans_ran(self.model),
                  "packed_rows": {"ran": self.packing, "packed_share": self.packed_share,  # --packing is "packing"
                                  **({"layout": "one row a batch" if self.one_row else "rows of the batch's width"}
                                     if self.packing == "on" else {})},
                  "train_step": self.graphed.describe() if self.graphed is not None else (
                      f"eager ({self.graphs_check['why']})" if self.graphs_check else "eager"),
                  **({"graphs_check": self.graphs_check} if self.graphs_check is not None else {})}
        if cfg.live_eval:
            t1 = time.perf_counter()
            live = _only(evaluate(model, tok, out, cfg.task, self.task.eval_args, cfg.eval_batch_size,
                                  cfg.eval_max_new_tokens, self.show)["metrics"])
            result.update(accuracy=live["accuracy"], accuracy_se=live["accuracy_se"],
                          eval_seconds=round(time.perf_counter() - t1, 2))
        write_json(out / "result.json", result, indent=2)
        drop_state(out)
        return result

def model_state_bytes(model, task: TrainTask, tokens: int) -> int:
    """Bytes of decoding state (KV cache, conv and SSM state) the model holds after ``tokens`` tokens: the
    quantity the paper's argument is about, measured as the eval engine measures it, on a copy: the engine
    prepares a model for inference in place (its attention function, fused activations, eval mode), and the
    model measured here is the one about to train (on the engine's attention a packed Transformer step ran 4x
    slower, under a dense mask)."""
    clone = copy.deepcopy(model)
    dev = next(clone.parameters()).device
    backend = TransformersBackend("", model=clone, tok=task.tokenizer(), device=str(dev),
                                  dtype="float32" if next(clone.parameters()).dtype == torch.float32 else "bfloat16")
    return backend.state_bytes(tokens)


def _only(by_condition: dict) -> dict:
    """The metrics of a run with a single condition (a trained model is evaluated at its own size)."""
    (only,) = by_condition.values()
    return only


def evaluate(model, tok, run_dir: Path, task: str, task_args: dict, batch_size: int,
             max_new_tokens: int | None = None, progress: bool = False, wrap=None) -> dict:
    """Greedy evaluation on held-out samples through the eval engine (the tool live for retrieval). The
    evaluation's rows are keyed by the checkpoint's content (the files in ``run_dir``); rows of another
    checkpoint (a killed attempt's, a retrained model's) are moved aside, never counted. ``wrap``: a function of
    the model's backend giving the one to run (``measure_live_eval``'s gold traces)."""
    backend = TransformersBackend(str(run_dir), model=model, tok=tok, device=str(next(model.parameters()).device),
                                  dtype="float32" if next(model.parameters()).dtype == torch.float32 else "bfloat16")
    backend = wrap(backend) if wrap else backend
    cfg = RunConfig(model=str(run_dir), task=task, task_args=task_args, batch_size=str(batch_size),
                    max_new_tokens=max_new_tokens, output=str(run_dir / "eval"), seed=0, prefix_reuse="none")
    try:
        return run_eval(cfg, backend=backend, progress=progress)
    except ResumeMismatchError as e:
        log.warning("%s: the live evaluation's earlier rows are of another checkpoint or settings (%s); they are "
                    "moved aside and the evaluation starts over", run_dir / "eval", e)
        return run_eval(dataclasses.replace(cfg, overwrite=True), backend=backend, progress=progress)


def plot_curves(curve: list[dict], path: Path, title: str) -> None:
    """Training loss and teacher-forced exact match against samples seen: one PNG per run."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot([r["samples"] for r in curve], [r["loss"] for r in curve], color="tab:blue", label="train loss")
    ax.set_xlabel("training samples")
    ax.set_ylabel("loss", color="tab:blue")
    ax.set_yscale("log")
    em = [r for r in curve if "eval_em" in r]
    ax2 = ax.twinx()
    ax2.plot([r["samples"] for r in em], [100 * r["eval_em"] for r in em], "o-", color="tab:red",
             label="teacher-forced EM")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("teacher-forced EM (%)", color="tab:red")
    ax.set_title(title, fontsize=9)
    save(fig, path, dpi=120)


