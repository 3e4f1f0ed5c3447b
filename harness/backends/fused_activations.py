"""GELU's tanh form as one kernel: a checkpoint's Python-written tanh GELU swapped for PyTorch's fused one.

``gelu_new`` (Phi, GPT-2, CodeGen, GPT-J) and ``gelu_fast`` are written in transformers as eight elementwise
operations (a power, four products, two sums, a tanh), each a pass over the MLP's widest activation: on a CPU
7.5 ms for a 1,063-token segment of the tiny Phi against 1.2 ms for ``F.gelu(approximate="tanh")``, the same
function in one kernel (transformers' own ``gelu_pytorch_tanh``, its documented faster equivalent, which the
Phi-Mamba models here use already); on a GPU eight kernels become one per layer and step. The two round apart by
at most an ulp or two (2.4e-7 in float32), the kind of difference SDPA's kernels make against eager attention,
so the run records the swap (results.json's ``backend.fused``).
"""
from __future__ import annotations

from torch import nn
from transformers.activations import FastGELUActivation, NewGELUActivation, get_activation

TANH_GELU = (NewGELUActivation, FastGELUActivation)  # the same tanh approximation, written out in Python


def fuse_activations(model: nn.Module) -> list[str]:
    """Swap every Python-written tanh GELU in ``model`` for the fused one, in place; what was swapped, by class
    (empty: nothing)."""
    swapped: dict[str, int] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in TANH_GELU:
                setattr(parent, name, get_activation("gelu_pytorch_tanh"))
                swapped[type(child).__name__] = swapped.get(type(child).__name__, 0) + 1
    return [f"{cls} x{n} -> gelu(approximate='tanh')" for cls, n in sorted(swapped.items())]
