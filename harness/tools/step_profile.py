"""One training step of the trainer's own model, data and step under ``torch.profiler``: where its time goes,
by kernel family (the Mamba scan's, the causal convolution's, the rest). The scan benchmark
(``benchmarks/scan.py --profile``) prints it; the GPU quick suite records it beside its scan rows."""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from harness.models.istree import scans_ran
from harness.training.config import TrainConfig
from harness.training.data import TrainTask, batch_from_tokens
from harness.training.step import new_model, new_optimizer, optimizer_step, uses_bf16

# On a GPU the Triton kernels by name (the PyTorch scan's many small kernels fall in the rest); on a CPU the
# autograd functions, whose time includes the ops they ran.
FAMILIES = {"cuda": {"scan": ("_scan_forward", "_scan_backward"), "convolution": ("_conv_forward", "_conv_backward")},
            "cpu": {"scan": ("SelectiveScan", "SelectiveScanBackward", "TritonScan", "TritonScanBackward"),
                    "convolution": ("CausalConv", "CausalConvBackward", "TritonCausalConv",
                                    "TritonCausalConvBackward")}}


def profile_step(cfg: TrainConfig, batch: int, device: str, top: int = 10) -> dict:
    """The second of two training steps of ``cfg``'s model on a batch of its task, profiled: its tokens, the
    scans that ran, the total device (CPU) time in ms, each family's ms, and the ``top`` kernels (ops)."""
    gpu = device == "cuda"
    task = TrainTask(cfg)
    vocab = {t: i for i, t in enumerate(task.vocab)}
    stream = task.stream(seed=0)
    torch.manual_seed(0)
    model = new_model(cfg, task).to(device)
    opt = new_optimizer(cfg, model, torch.device(device))
    ids, mask = batch_from_tokens([next(stream) for _ in range(batch)], vocab, device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=uses_bf16(cfg, torch.device(device)))

    def step():  # the trainer's own step
        optimizer_step(model, opt, ids, mask, autocast)
        if gpu:
            torch.cuda.synchronize()

    step()  # compiles and checks kernels, warms the allocator
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        step()
    rows = [e for e in prof.key_averages() if (e.device_type.name == "CUDA") == gpu]
    own = (lambda e: e.self_device_time_total) if gpu else (lambda e: e.self_cpu_time_total)
    inside = own if gpu else (lambda e: e.cpu_time_total)
    named = (lambda e, keys: any(k in e.key for k in keys)) if gpu else (lambda e, keys: e.key in keys)
    total = sum(own(e) for e in rows)
    families = {name: sum(inside(e) for e in rows if named(e, keys)) / 1e3
                for name, keys in FAMILIES["cuda" if gpu else "cpu"].items()}
    return {"tokens": ids.shape[1], "batch": batch, "scans": scans_ran(model), "total_ms": total / 1e3,
            "families_ms": families,
            "top": [(e.key, own(e) / 1e3, e.count) for e in sorted(rows, key=own, reverse=True)[:top]]}
