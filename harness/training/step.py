"""One optimizer step as a run takes it, and what it is built from: the run's model and optimizer, the masked
loss, the learning-rate schedule, the precision. The trainer's loop, the planner's timings (``grid.measure_cell``)
and the graphed steps (``step_graphs``) all take their step from here, so what is timed is what trains."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from harness.models.istree import build_model
from harness.models.masks import causal_rows
from harness.models.packing import Packed, packed_rows
from harness.training.config import TrainConfig
from harness.training.data import TrainTask


def lr_at(step: int, total: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to zero (a multiplier of the peak learning rate)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def masked_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the loss mask's targets (next-token prediction)."""
    logits, tgt, m = logits[:, :-1].float(), ids[:, 1:], mask[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    return (ce * m.reshape(-1)).sum() / m.sum().clamp_min(1)


def uses_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether a run trains under bf16 autocast: ``--precision bf16``, or ``auto`` on CUDA."""
    return cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")


def new_model(cfg: TrainConfig, task: TrainTask):
    """The run's fresh model (the current torch seed draws its weights), its Mamba layers on the run's scan."""
    return build_model(cfg.arch, cfg.size, len(task.vocab), max_positions=max(4096, 2 * task.max_len),
                       d_model=cfg.d_model, layers=cfg.layers, scan=cfg.scan)


def new_optimizer(cfg: TrainConfig, model, device: torch.device, graphs: bool = False) -> torch.optim.Optimizer:
    """The run's AdamW (weight decay 0, the paper's); on CUDA its fused kernel (one launch for every parameter:
    the small models' steps are bound by kernel launches), capturable, with the learning rate a float32 device
    tensor the scheduler fills in place (``rate_on_device``), graphs or not: the fused kernel takes a tensor rate
    in float32 and a Python rate in float64, and with a tensor rate for graphed steps only, a 0.5M Mamba's graphed
    weights parted from its eager ones by 3.5e-8 in 8 steps where two eager runs agree exactly (0 with one kind,
    H100): graphs on or off must not change what a run computes.
    ``graphs`` on a CPU (capture off, the tests): the tensor rate too, on the single-tensor implementation. Also
    switches on TF32 for float32 matmuls on CUDA, as the run does: what the planner times is what the run runs."""
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    params = [p for p in model.parameters() if p.requires_grad]
    if cuda or graphs:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, fused=cuda, capturable=cuda,
                                foreach=False if not cuda else None)
        return rate_on_device(opt, device)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)


def rate_on_device(opt: torch.optim.Optimizer, device: torch.device) -> torch.optim.Optimizer:
    """Each group's learning rate as a float32 tensor on ``device``, the form graphed and eager CUDA steps share
    (also after a resumed run's optimizer state, loaded on the CPU, replaced it)."""
    for group in opt.param_groups:
        if not isinstance(group["lr"], torch.Tensor) or group["lr"].device != torch.device(device):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
    return opt


def logits_of(model, ids: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
    """The model's logits for a padded batch's ``ids``, or for ``packed`` rows (``ids`` is then ``packed.ids``):
    positions restart per sample (transformers' packed-sequence masking reads them) and the Mamba mixers
    restart their states at each sample's first token."""
    if packed is None:
        with causal_rows():  # right-padded rows, no mask: SDPA's causal kernels (``masks.causal_rows``)
            return model(input_ids=ids).logits
    with packed_rows(packed.starts, packed.where):
        config = getattr(getattr(model, "module", model), "config", None)  # a data-parallel wrapper's model
        if getattr(config, "model_type", "") == "mamba":  # no positions: the scan is its own order
            return model(input_ids=ids).logits
        # no cache: transformers reads packed sequences from the positions only when no cache is passed
        return model(input_ids=ids, position_ids=packed.positions, use_cache=False).logits


def optimizer_step(model, opt, ids: torch.Tensor, mask: torch.Tensor, autocast, backward=None,
                   packed: Packed | None = None) -> torch.Tensor:
    """One training step as the trainer takes it (and the planner times it): forward under ``autocast``, the
    masked loss in float32, backward (``backward``: accelerate's, in a run), the update; returns the loss.
    ``packed``: the batch as packed rows (``ids`` and ``mask`` are then its own)."""
    with autocast:
        logits = logits_of(model, ids, packed)
    loss = masked_loss(logits, ids, mask)
    (backward or torch.Tensor.backward)(loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
