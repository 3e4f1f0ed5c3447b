"""A forward that keeps only its last positions' logits computes its last layer for those positions alone.

A prefill (and a prefix-tree extend) keeps the last position's logits; every other position of the last layer
feeds nothing but logits nobody reads, while its keys and values, made before attention, are cached whole. So
within ``chunked_attention.known(kept=n)``, which the backend's forward enters with its ``logits_to_keep``, the
last layer's attention computes its last ``n`` queries (``chunked_attention.kept_queries``, on the module marked
here) and its MLP takes its last ``n`` rows (hooks set here); the other rows come out as zeros. llama.cpp's graphs
do the same (their output ids). On the 24 HotpotQA prompts the prefill ran 1.13x (docs/results/cpu.md).

Installed on a CPU, where attention goes through ``chunked_attention.chunked_sdpa``, on an attention-only stack
(a masked-padding family, ``Family.padding``) whose last decoder layer has one attention module and an ``mlp``;
kept only where a probe prefill's last logits match the whole layer's. The kept position's attention is then one
query's and its MLP one row's, which round apart from the whole block's, so it is part of a CPU run's settings
(``identity``); ``ICR_KEPT_POSITIONS=off`` computes every position.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch
from torch import nn

from harness.backends import chunked_attention
from harness.backends.chunked_attention import KEPT_LAST

log = logging.getLogger("harness")

ENV = "ICR_KEPT_POSITIONS"
IDENTITY = "the last layer for the kept positions only"
TOLERANCE = 1e-4  # the probe's last logits against the whole layer's, relative to their largest value


def enabled() -> bool:
    value = os.environ.get(ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: use on or off (or leave it unset)")
    return value == "on"


def identity(device: torch.device) -> dict:
    """What a run's settings hold of it, decided before the model loads: on a CPU, where it may be installed."""
    return {"kept_positions": IDENTITY} if device.type == "cpu" and enabled() else {}


def install(model: nn.Module, family, probe: Callable[[], torch.Tensor]) -> str | None:
    """Mark the last layer's attention and hook its MLP (see the module docstring); ``probe`` returns the logits a
    prefill keeps. What changed, for the run's record (None: nothing; said why where the probe refused it)."""
    if not enabled() or family.padding != "masked" or family.module_state or family.own_cache:
        return None
    last = _last_layer(model)
    attention = ([m for name, m in last.named_modules() if name and getattr(m, "layer_idx", None) is not None]
                 if last is not None else [])
    mlp = getattr(last, "mlp", None)
    if len(attention) != 1 or not isinstance(mlp, nn.Module):
        return None
    whole = probe().float()
    setattr(attention[0], KEPT_LAST, True)
    hooks = [mlp.register_forward_pre_hook(_kept_rows), mlp.register_forward_hook(_padded_back)]
    try:
        kept = probe().float()
        why = None if torch.allclose(kept, whole, rtol=0, atol=TOLERANCE * whole.abs().max().item()) else \
            f"on a probe its kept logits moved by {(kept - whole).abs().max().item():.2e}"
    except Exception as e:  # noqa: BLE001  an MLP that returns more than a tensor, or takes its rows otherwise
        why = f"a probe failed ({type(e).__name__}: {e})"
    if why is not None:
        delattr(attention[0], KEPT_LAST)
        for hook in hooks:
            hook.remove()
        log.info("the last layer computes every position: %s", why)
        return None
    return f"{IDENTITY}: its attention's last queries, its MLP's last rows (verified on a probe prefill)"


def _last_layer(model: nn.Module) -> nn.Module | None:
    """The decoder's last layer: the last of the first module list as long as the config's layer count."""
    count = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and count and len(module) == count:
            return module[-1]
    return None


def _kept_rows(mlp, args):
    n = chunked_attention.kept()
    if n and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 3 and args[0].shape[1] > n:
        mlp._icr_positions = args[0].shape[1]
        return (args[0][:, -n:], *args[1:])
    if not torch.compiler.is_compiling():
        mlp._icr_positions = 0
    return None


def _padded_back(mlp, args, out):
    positions = 0 if torch.compiler.is_compiling() else getattr(mlp, "_icr_positions", 0)
    if not positions:
        return None
    full = out.new_zeros(out.shape[0], positions, *out.shape[2:])
    full[:, -out.shape[1]:] = out
    return full
