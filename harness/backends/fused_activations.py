"""GELU's tanh form as one kernel: a checkpoint's Python-written tanh GELU swapped for PyTorch's fused one.

``gelu_new`` (Phi, GPT-2, CodeGen, GPT-J) and ``gelu_fast`` are written in transformers as eight elementwise
operations (a power, four products, two sums, a tanh), each a pass over the MLP's widest activation: on a CPU
7.5 ms for a 1,063-token segment of the tiny Phi against 1.2 ms for ``F.gelu(approximate="tanh")``, the same
function in one kernel (transformers' own ``gelu_pytorch_tanh``, its documented faster equivalent, which the
Phi-Mamba models here use already); on a GPU eight kernels become one per layer and step. The two round apart by
at most an ulp or two (2.4e-7 in float32), the kind of difference SDPA's kernels make against eager attention,
so the run records the swap (results.json's ``backend.fused``).

Where the linear layers run on oneDNN (``onednn_linear``), a GELU that takes a layer's output goes one step
further, into that layer's epilogue (``gelu_into_linear``): found and checked on the loaded model, not listed
per family.
"""
from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import FastGELUActivation, NewGELUActivation, get_activation

from harness.backends import onednn_linear

log = logging.getLogger("harness")

TANH_GELU = (NewGELUActivation, FastGELUActivation)  # the same tanh approximation, written out in Python
FUSED_GELU = type(get_activation("gelu_pytorch_tanh"))  # GELUTanh (PytorchGELUTanh before transformers 5.x)
PROBE_TOLERANCE = 1e-4  # the fused probe's output against the unfused one, relative to its largest value


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


def is_tanh_gelu(module: nn.Module) -> bool:
    """A module that is the tanh GELU alone (transformers' fused one, or PyTorch's ``nn.GELU("tanh")``)."""
    if isinstance(module, nn.GELU):
        return module.approximate == "tanh"
    act = getattr(module, "act", None)  # GELUTanh's: F.gelu's tanh form, or the same written in Python
    return type(module) is FUSED_GELU and (act is None or (isinstance(act, functools.partial) and act.func is F.gelu
                                                           and act.keywords == {"approximate": "tanh"}))


@torch.inference_mode()
def gelu_into_linear(model: nn.Module, probe: Callable[[], torch.Tensor]) -> str | None:
    """Where a tanh GELU module only ever takes a oneDNN linear layer's output as it comes (seen through hooks
    on one ``probe`` forward), the layer applies the GELU in its epilogue (``OneDNNLinearGELU``) and the module
    becomes an identity. Kept only if the probe's output then matches the unfused one (so a layer whose output
    is also read elsewhere is never fused); what changed, for the run's record (None: nothing)."""
    pairs = _linear_then_gelu(model, probe)
    if not pairs:
        return None
    before = probe().float()
    places = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if child in pairs]
    for parent, name, act in places:
        pairs[act].__class__ = onednn_linear.OneDNNLinearGELU
        setattr(parent, name, nn.Identity())
    after = probe().float()
    if not torch.allclose(after, before, rtol=0, atol=PROBE_TOLERANCE * before.abs().max().item()):
        for parent, name, act in places:
            pairs[act].__class__ = onednn_linear.OneDNNLinear
            setattr(parent, name, act)
        log.info("GELU not fused into the linear layers: the probe's output moved by %.2e",
                 (after - before).abs().max().item())
        return None
    return f"linear -> tanh GELU x{len(places)} -> oneDNN's epilogue (verified on a probe forward)"


def _linear_then_gelu(model: nn.Module, probe: Callable[[], torch.Tensor]) -> dict:
    """{GELU module: the oneDNN linear layer whose output is all it took} over one probe forward; a module held
    in two places, or fed anything else, is left out."""
    made: dict[int, tuple[nn.Module, torch.Tensor]] = {}  # id(output) -> (layer, output), kept alive
    fed: dict[nn.Module, set] = {}

    def made_by(layer, args, out):
        made[id(out)] = (layer, out)

    def feeds(act, args):
        src = made.get(id(args[0])) if args else None
        fed.setdefault(act, set()).add(src[0] if src is not None and src[1] is args[0] else None)

    acts = [m for m in model.modules() if is_tanh_gelu(m)]
    layers = [m for m in model.modules() if type(m) is onednn_linear.OneDNNLinear]
    if not acts or not layers:
        return {}
    hooks = [m.register_forward_hook(made_by) for m in layers] + [a.register_forward_pre_hook(feeds) for a in acts]
    try:
        probe()
    finally:
        for h in hooks:
            h.remove()
    places = Counter(child for parent in model.modules() for child in parent.children())
    pairs = {act: next(iter(src)) for act, src in fed.items() if len(src) == 1 and None not in src
             and places[act] == 1}
    feeding = Counter(pairs.values())
    return {act: layer for act, layer in pairs.items() if feeding[layer] == 1}
