"""A step under ``torch.profiler``: one training step of the trainer's own model, data and step, by kernel family
(the Mamba scan's, the causal convolution's, the rest: ``benchmarks/scan.py --profile`` prints it, the GPU quick
suite records it beside its scan rows); and one decode step of a backend, by kernel (how many a step launches,
which take its time, which attention ran: the quick suite's decode rows)."""
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


# ATen ops that only make a tensor or a view of one: no kernel of their own on a CPU
NOT_KERNELS = {f"aten::{op}" for op in ("empty", "empty_strided", "empty_like", "as_strided", "view", "reshape",
                                        "_reshape_alias", "_unsafe_view", "expand", "transpose", "t", "slice",
                                        "select", "unsqueeze", "squeeze", "permute", "detach", "alias", "narrow",
                                        "split", "split_with_sizes", "chunk", "unbind", "contiguous", "lift_fresh",
                                        "resolve_conj", "resolve_neg", "_to_copy", "to", "unflatten", "flatten",
                                        "view_as", "expand_as", "item", "_local_scalar_dense", "is_nonzero")}
ATTENTION_KERNELS = ("attention", "attn", "fmha", "flash")  # names of the kernels (ops on a CPU) attention runs in


@torch.inference_mode()
def profile_decode(backend, length: int, batch: int = 1, steps: int = 4, top: int = 8) -> dict:
    """``steps`` decode steps of ``backend`` after ``batch`` prompts of ``length`` tokens, profiled, per step:
    the kernels launched (on a CPU the ATen ops that ran one: leaf ops), the device (CPU) ms, the ``top`` kernels
    by time and the attention kernels that ran."""
    gpu = backend.device.type == "cuda"
    ids = torch.randint(1, backend.tokenizer.vocab_size, (batch, length),
                        generator=torch.Generator().manual_seed(0)).to(backend.device)
    mask = torch.ones_like(ids)
    logits, state = backend.prefill(ids, mask)
    tok = logits.argmax(-1, keepdim=True)

    def step():
        nonlocal mask, tok
        mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
        tok = backend.step(state, tok, mask).argmax(-1, keepdim=True)

    for _ in range(3):  # warm-up: lazy set-up, the graphs' capture, autotuning
        step()
    for n in (1, steps):  # the first profile, a step long, is thrown away: the profiler's own start-up lands in it
        if gpu:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                step()
            if gpu:
                torch.cuda.synchronize()
    if gpu:
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        own = lambda e: e.self_device_time_total  # noqa: E731
    else:  # an ATen op that computes, most of its time in itself (not a composite like linear: its addmm), or
        # one of the project's own CPU kernels (``icr::``, harness/ops/cpu_flash.py: a C call no ATen op shows)
        kernels = [e for e in prof.events() if e.name.startswith(("aten::", "icr::")) and e.name not in NOT_KERNELS
                   and e.self_cpu_time_total >= 0.5 * e.cpu_time_total]
        own = lambda e: e.self_cpu_time_total  # noqa: E731
    by_name: dict[str, list] = {}
    for e in kernels:
        t = by_name.setdefault(e.name, [0.0, 0])
        t[0], t[1] = t[0] + own(e), t[1] + 1
    ranked = sorted(by_name.items(), key=lambda kv: kv[1][0], reverse=True)
    return {"batch": batch, "context": length, "kernels_per_step": round(len(kernels) / steps, 1),
            "ms_per_step": round(sum(own(e) for e in kernels) / steps / 1e3, 3),
            "top": [(name, round(t / steps / 1e3, 3), round(n / steps, 1)) for name, (t, n) in ranked[:top]],
            "attention": sorted(name for name in by_name if any(k in name.lower() for k in ATTENTION_KERNELS))}
