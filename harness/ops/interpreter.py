"""Triton's CPU interpreter (``TRITON_INTERPRET=1``: how the tests run GPU kernels on a machine without one) with
its associative scan vectorised.

The interpreter runs ``tl.associative_scan`` with a custom combine function one element at a time, ~100 µs an
element, which made the Mamba scan's kernels (a prefix scan per state and chunk) take minutes at test sizes.
``vectorise_scans`` replaces that fallback with one that calls the same combine function on whole slices, one
step along the scanned axis at a time: each element goes through the same float operations in the same order
as before, so the results are the same bits (``tests/test_scan_triton.py`` checks it against the stock
fallback). Patched here because the interpreter is Triton's and has no hook for it; a GPU never runs this."""
from __future__ import annotations

import os

import numpy as np


def vectorise_scans() -> bool:
    """Install the vectorised fallback in Triton's interpreter (once; a no-op unless ``TRITON_INTERPRET=1``).
    Returns whether it is installed."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from triton.runtime import interpreter

    ops = interpreter.ScanOps
    if getattr(ops.generic_scan, "vectorised", False):
        return True
    stock = ops.generic_scan

    def generic_scan(self, input):
        axis, data = self.axis, [arg.handle.data for arg in input]
        out, acc = [np.zeros_like(d) for d in data], []
        for i in range(data[0].shape[axis]):
            here = [np.take(d, i, axis=axis) for d in data]
            if i:
                tensors = [self.to_tensor(x, arg.dtype) for x, arg in zip(acc + here, input + input)]
                combined = self.combine_fn.fn(*tensors)
                combined = combined if isinstance(combined, tuple) else (combined,)
                here = [getattr(c, "handle", None).data.reshape(here[0].shape) if hasattr(c, "handle") else c
                        for c in combined]
            for o, x in zip(out, here):
                _along(o, axis, i)[...] = x
            acc = [np.take(o, i, axis=axis) for o in out]  # as stored: the next step reads the stored dtype
        return [self.to_tensor(o, arg.dtype) for o, arg in zip(out, input)]

    generic_scan.vectorised = True
    generic_scan.stock = stock
    ops.generic_scan = generic_scan
    return True


def _along(array: np.ndarray, axis: int, i: int) -> np.ndarray:
    """The view of ``array`` at index ``i`` of ``axis``."""
    return array[(slice(None),) * axis + (i,)]
