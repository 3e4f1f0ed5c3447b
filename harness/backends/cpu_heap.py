"""On a CPU, memory that a forward's tensors free stays in the process for the next forward's.

PyTorch's CPU allocator takes every tensor from malloc and hands it back when it is freed, and glibc's malloc
gives a freed block above its mmap threshold (at most 32 MB while it adapts), or a heap top above its trim
threshold, back to the system: the next call's activations and a join's cache buffers then fault their pages in
again, zeroed by the kernel. On the 24 HotpotQA prompts of ``benchmarks/throughput.py`` that was ~220k page
faults (0.9 GB) and 0.35 s of system time a run, and two to seven times that while another process (an idle
vLLM engine) held memory. Raising both thresholds keeps freed memory for reuse: a few hundred faults a run.
vLLM's CPU guide asks for tcmalloc preloaded for the same reason; glibc's own ``mallopt`` needs no library and
no restart, and the vLLM backend's in-process engine takes it too (without it vLLM's CPU prefill faulted 1.4M
pages a run in some starts: 3.9 s against 2.45 s). The cost: the process keeps its peak memory until it exits,
and one large size freed and taken again in a loop grows glibc's heap for some rounds before it is reused
(200 MB: 5 to 9 rounds, 1-2 GB held; ``tests/test_cpu_heap.py``); the 24 prompts' runs peaked at 2.3 GB either
way. ``ICR_CPU_HEAP=release`` leaves malloc as it is.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import torch

ENV = "ICR_CPU_HEAP"
CHOICES = ("keep", "release")
# mallopt's parameters (malloc.h) and the thresholds set: blocks up to 1 GiB from the heap, 2 GiB free kept
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 1 << 30, (1 << 31) - 1


def asked() -> str:
    """``ICR_CPU_HEAP`` (default ``keep``); a ValueError that names the fix for anything else."""
    value = os.environ.get(ENV, "keep").strip().lower()
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: use {' or '.join(CHOICES)}")
    return value


def keep_freed_memory(device: torch.device) -> str | None:
    """For a run on a CPU, glibc's malloc told to keep freed memory (once a process); what was set, for the
    run's record (None: nothing, as on another device, another C library or ``ICR_CPU_HEAP=release``)."""
    return _keep() if device.type == "cpu" and asked() == "keep" else None


@functools.cache
def _keep() -> str | None:
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        libc.gnu_get_libc_version  # glibc's mallopt: musl's and others' take other parameters
    except (OSError, AttributeError, TypeError):
        return None
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return None
    return (f"heap: freed memory kept for reuse (glibc mallopt: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim "
            f"threshold {TRIM_THRESHOLD >> 20} MiB; {ENV}=release to leave malloc as it is)")
