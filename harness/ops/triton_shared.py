"""What the project's Triton kernels share: a store that rounds to nearest in half precision (the check a kernel
passes on a device before a run uses it is ``harness.ops.checked``)."""
from __future__ import annotations

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
