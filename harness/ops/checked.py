"""The check a fast kernel passes on a device before a run uses it: its outputs and gradients against a
reference's on the same inputs (``agrees``), shared by the Triton kernels and the varlen attention."""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch


def agrees(run: Callable[[], Sequence[Sequence[torch.Tensor]]], tolerance: float, kernel: str, reference: str,
           device: str, where: str, fallback: str) -> bool:
    """Whether ``kernel``'s tensors equal its ``reference``'s within ``tolerance`` (relative to each one's largest
    value): ``run()`` returns both lists (the kernel's first), run on ``device`` outside inference mode and
    autocast. A kernel that fails to compile or launch, or differs, gives False and one warning naming ``where``
    (the device and the launch class) and the ``fallback`` the run takes instead of wrong numbers."""
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(torch.device(device).type,
                                                                               enabled=False):
            ours, theirs = run()
    except Exception as e:  # noqa: BLE001 (a kernel that does not compile or launch here, for any reason)
        warnings.warn(f"the {kernel} failed on {where} ({type(e).__name__}: {e}); {fallback}", stacklevel=3)
        return False
    worst = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                for a, b in zip(ours, theirs))
    if not worst <= tolerance:
        warnings.warn(f"the {kernel} differs from the {reference} on {where} by {worst:.1e} (relative); "
                      f"{fallback}", stacklevel=3)
        return False
    return True
