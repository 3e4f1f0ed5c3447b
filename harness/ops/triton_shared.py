"""What the project's Triton kernels share: a store that rounds to nearest in half precision, and the check a
kernel passes on a device before a run uses it (``agrees``)."""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from harness.ops.interpreter import speed_up

speed_up()  # under TRITON_INTERPRET=1 only: the tests' CPU interpreter, without the work it repeats

@triton.jit
def store_rounded(ptr, value, mask):
    """float32 ``value`` stored in the pointer's precision, rounded to nearest even. A GPU's store rounds so;
    Triton's CPU interpreter truncates to bf16, so bf16 is rounded here by hand (the store is then exact on
    both, and the interpreter's numbers are the GPU's)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        value = bits.to(tl.float32, bitcast=True)
    tl.store(ptr, value, mask=mask)


def agrees(run: Callable[[], Sequence[Sequence[torch.Tensor]]], tolerance: float, kernel: str, reference: str,
           device: str, where: str, fallback: str) -> bool:
    """Whether the Triton ``kernel``'s tensors equal its ``reference``'s within ``tolerance`` (relative to each
    one's largest value): ``run()`` returns both lists (the kernel's first), run on ``device`` outside inference
    mode and autocast. A kernel that fails to compile or launch, or differs, gives False and one warning naming
    ``where`` (the device and the launch class) and the ``fallback`` the run takes instead of wrong numbers."""
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(torch.device(device).type,
                                                                               enabled=False):
            ours, theirs = run()
    except Exception as e:  # noqa: BLE001 (a kernel that does not compile or launch here, for any reason)
        warnings.warn(f"the Triton {kernel} failed on {where} ({type(e).__name__}: {e}); {fallback}", stacklevel=3)
        return False
    worst = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                for a, b in zip(ours, theirs))
    if not worst <= tolerance:
        warnings.warn(f"the Triton {kernel} differs from the {reference} on {where} by {worst:.1e} (relative); "
                      f"{fallback}", stacklevel=3)
        return False
    return True
