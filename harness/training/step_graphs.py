"""The trainer's optimizer step replayed from CUDA graphs (``--cuda-graphs auto``/``on``).

The paper's models are small: on an H100 a 0.5M Transformer's step at 48 tokens is 3 ms of GPU work and 26-40
ms of Python and kernel launches (about 1,000 launches a step), so most of the paper grid's hours are launch
overhead. A graph replays the whole step (forward under autocast, the masked loss, backward, the fused AdamW
update) at fixed addresses, following PyTorch's whole-network capture recipe:

- one graph per batch shape (an IsTree cell pads every batch to few lengths); a shape's first ``WARMUP`` steps
  run eagerly on a side stream (they are real steps: lazy initialisation, autotuning, the Triton scan's check
  happen there), its next step is captured and replayed; past ``MAX_SHAPES`` shapes, new ones run eagerly.
- the optimizer is capturable, its learning rate a device tensor that the scheduler fills in place, so a
  replay reads the current rate (a Python float would be frozen into the graph).
- gradients are the graph's own buffers: rewritten by every replay, never accumulated; before an eager step
  they are set to None, as an eager step expects.
- its steps, eager and graphed, use SDPA's memory-efficient, flash or math attention (``GRAPH_ATTENTION``): a
  graphed cuDNN attention step parts from its eager twin.
- a step that cannot be captured (an op that syncs with the host) or memory that runs out turns the graphs off
  for the run with a warning: the run goes on eagerly, never wrongly (``harness.cuda_graphs.GraphCache``, the
  decode graphs' cache and policy too).

``capture=False`` runs the same code eagerly (what the CPU tests compare with ``optimizer_step``); the GPU check
(``check_graphed_steps``, in the quick GPU suite) compares losses and weights of graphed and eager steps under a
moving learning rate on a GPU."""
from __future__ import annotations

import gc
import logging
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.cuda_graphs import GraphCache, ReplayedStep, on_side_stream
from harness.training.data import TrainingBatches, TrainTask
from harness.training.step import lr_at, logits_of, masked_loss, new_model, new_optimizer, optimizer_step, uses_bf16

log = logging.getLogger("harness")

WARMUP = 2  # eager steps of a new batch shape before it is captured
# The attention kernels a graphed run's steps (eager ones too) may use: not cuDNN's. On an H100 (torch 2.11) a
# Transformer step replayed from a graph with cuDNN attention parted from its eager twin by 1.4e-3 in the loss
# while two eager runs agreed exactly; with the memory-efficient kernel the graphed step was within 3.3e-4.
GRAPH_ATTENTION = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)
MAX_SHAPES = 4  # graphs kept at most (each holds its activations' memory); further shapes run eagerly
# How far graphed steps may part from eager ones (relative): the same kernels, a float32 rate tensor instead of a
# Python float; a rate frozen into a graph or a leaked gradient moves weights by whole update sizes
LOSS_TOL, WEIGHT_TOL = 1e-3, 1e-4
# ...or, where eager steps part from themselves (a GPU's attention backward adds in no fixed order, and bf16
# steps carry that on), at most this many times as far as a second eager run parts from the first
FLOOR_FACTOR = 2.0


class _Step(ReplayedStep):
    """One batch shape's optimizer step over static inputs; ``output`` is its loss."""

    def __init__(self, steps: "GraphedSteps", ids: torch.Tensor, mask: torch.Tensor):
        self.steps, self.ids, self.mask = steps, ids.clone(), mask.clone()

    def load(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.ids.copy_(ids)
        self.mask.copy_(mask)

    def run(self) -> None:
        model, opt = self.steps.model, self.steps.opt
        # fresh gradients every step, as a replay writes them (captured from None: no accumulation kernel)
        opt.zero_grad(set_to_none=True)
        with self.steps.autocast(cache=False):  # cached casts would outlive a capture
            logits = logits_of(model, self.ids)  # the eager step's forward, its attention kernels included
        loss = masked_loss(logits, self.ids, self.mask)
        loss.backward()
        opt.step()
        if self.output is None:
            self.output = loss.detach()
        else:
            self.output.copy_(loss.detach())


class GraphedSteps:
    """Callable as ``(ids, mask) -> loss``, one optimizer step. The loss is the graph's static output, valid
    until the next call: read it (or add it to a sum on the device) before the next step."""

    def __init__(self, model, opt, device_type: str, bf16: bool, capture: bool = True):
        self.model, self.opt, self.capture = model, opt, capture
        self.device_type, self.bf16 = device_type, bf16
        self.cache = GraphCache("training steps", capture, max_graphs=MAX_SHAPES)
        self.seen: dict[tuple[int, ...], int] = {}
        self._grads_static = False  # whether parameters' .grad are a graph's buffers (set None before eager steps)

    @property
    def disabled(self) -> str | None:
        return self.cache.disabled

    @property
    def replays(self) -> int:
        return self.cache.replays

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(list(GRAPH_ATTENTION)):
            return self._step(ids, mask)

    def _step(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        shape = tuple(ids.shape)
        if not self.cache.covers(shape):
            return self._eager_step(ids, mask)
        if shape not in self.cache.graphs and self.seen.get(shape, 0) < WARMUP:
            self.seen[shape] = self.seen.get(shape, 0) + 1
            return self._eager_step(ids, mask, side_stream=self.capture)

        def replay():
            loss = self.cache.replay(shape, lambda pool: self._build(ids, mask, pool), lambda s: s.load(ids, mask))
            self._grads_static = True
            return loss

        loss = self.cache.attempt(replay, on_give_up=self._forget_grads)
        return self._eager_step(ids, mask) if loss is None else loss

    def describe(self) -> str:
        if self.cache.graphs and not self.cache.disabled and self.capture:
            shapes = ", ".join("x".join(map(str, s)) for s in self.cache.graphs)
            return f"CUDA graphs ({len(self.cache.graphs)} batch shapes: {shapes})"
        return self.cache.describe()

    # ---------------------------------------------------------------------------------------------------
    def _eager_step(self, ids, mask, side_stream: bool = False) -> torch.Tensor:
        if self._grads_static:  # an eager backward must not add to a graph's gradient buffers
            self.opt.zero_grad(set_to_none=True)
            self._grads_static = False
        step = lambda: optimizer_step(self.model, self.opt, ids, mask, self.autocast())  # noqa: E731
        # warm-up before a capture runs on a side stream, as PyTorch's capture recipe asks
        return on_side_stream(step, ids.device) if side_stream else step()

    def _build(self, ids, mask, pool) -> _Step:
        """Static inputs for this shape and its step, captured (with capture off: run on them eagerly); each
        replay's inputs are copied in by ``_Step.load``."""
        step = _Step(self, ids, mask)
        if self.capture:  # the rate a replay reads is a device tensor already (``new_optimizer``, a resume)
            step.record(ids.device, pool, warm=False)  # the shape's eager steps were its warm-up
        return step

    def autocast(self, cache: bool = True):
        return torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16, cache_enabled=cache)

    def _forget_grads(self) -> None:
        """Graphs off: the next (eager) step starts from no gradients, not from a graph's buffers."""
        self.opt.zero_grad(set_to_none=True)
        self._grads_static = False


def check_graphed_steps(cell, device: torch.device, batch: int, steps: int = 8) -> dict:
    """Graphed steps against eager ones from the same weights and batches under a learning rate that moves every
    step (the run's cosine schedule, compressed): the largest relative difference of the losses and of the
    final weights, each path's seconds a step after its warm-up, and the same differences between two eager
    runs (the floor: nonzero where the device's kernels are not deterministic), which widens the tolerance."""
    task = TrainTask(cell)
    source = TrainingBatches(task, batch, cell.seed, 0, cell.bucket)
    batches = [b for k in range(-(-steps // cell.bucket)) for b in source.pool(k)][:steps]
    capture, bf16 = device.type == "cuda", uses_bf16(cell, device)
    runs = {}
    for graphs in (False, True, "again"):
        torch.manual_seed(cell.seed)
        model = new_model(cell, task).to(device)
        opt = new_optimizer(cell, model, device, graphs=graphs is True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, 2))
        step = GraphedSteps(model, opt, device.type, bf16, capture=capture) if graphs is True else None
        losses, times = [], []
        for ids, mask in batches:
            ids, mask = ids.to(device), mask.to(device)
            if capture:
                torch.cuda.synchronize()
            t = time.perf_counter()
            if step is not None:
                loss = step(ids, mask)
            else:  # the attention kernels graphed steps use: the comparison is of graphs, not of kernels
                with sdpa_kernel(list(GRAPH_ATTENTION)):
                    loss = optimizer_step(model, opt, ids, mask, torch.autocast(device.type, dtype=torch.bfloat16,
                                                                               enabled=bf16))
            losses.append(float(loss.detach()))  # a sync: the timing includes it on both paths
            times.append(time.perf_counter() - t)
            sched.step()
        weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        runs[graphs] = (losses, weights, times, step)
    (l0, w0, t0, _), (l1, w1, t1, step), (l2, w2, _, _) = runs[False], runs[True], runs["again"]

    def apart(la, wa, lb, wb) -> tuple[float, float]:
        return (max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(la, lb)),
                float((wa - wb).abs().max() / wa.abs().max()))

    (loss_diff, weight_diff), (loss_floor, weight_floor) = apart(l0, w0, l1, w1), apart(l0, w0, l2, w2)
    loss_tol, weight_tol = max(LOSS_TOL, FLOOR_FACTOR * loss_floor), max(WEIGHT_TOL, FLOOR_FACTOR * weight_floor)
    timed = slice(WARMUP + 1, None)  # after the graphed path's warm-up and capture
    eager_s, graphed_s = (sum(t[timed]) / max(1, len(t[timed])) for t in (t0, t1))
    varied = len({round(x, 6) for x in l0}) > 1  # equal losses that never move would prove nothing
    ok = loss_diff <= loss_tol and weight_diff <= weight_tol and varied and step.replays > 0 and not step.disabled
    why = (None if ok else step.describe() if step.disabled else
           f"no step was replayed within {len(batches)} (a batch shape is captured after {WARMUP} eager steps of "
           f"it, and this cell's batches pad to varying lengths)"
           if step.replays == 0 else "the losses did not move: nothing was compared" if not varied else
           f"graphed steps differ from eager ones (losses {loss_diff:.1e}, weights {weight_diff:.1e}; two eager runs "
           f"{loss_floor:.1e}, {weight_floor:.1e})")
    result = {"cell": cell.name, "steps": len(batches), "graphed": step.describe(), "replays": step.replays,
            "loss_diff": float(f"{loss_diff:.2e}"), "weight_diff": float(f"{weight_diff:.2e}"),
            "eager_loss_floor": float(f"{loss_floor:.2e}"), "eager_weight_floor": float(f"{weight_floor:.2e}"),
            "eager_step_s": round(eager_s, 4), "graphed_step_s": round(graphed_s, 4),
            "speedup": round(eager_s / max(graphed_s, 1e-9), 2), "varied": varied,
            "ok": ok, **({"why": why} if why else {})}
    # the three models, their optimizers and graph pools hold each other in cycles: free them for what follows
    # (a run that checks first, then trains)
    runs.clear()
    del step
    gc.collect()
    if capture:
        torch.cuda.empty_cache()
    return result
