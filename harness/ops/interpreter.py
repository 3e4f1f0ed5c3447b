"""Triton's CPU interpreter (``TRITON_INTERPRET=1``: how the tests run GPU kernels on a machine without one), made
faster in two places where it repeats work, without changing what it computes.

- ``tl.associative_scan`` with a custom combine function ran one element at a time, ~100 µs an element, which
  made the Mamba scan's kernels (a prefix scan per state and chunk) take minutes at test sizes. The fallback
  installed here calls the same combine function on whole slices, one step along the scanned axis at a time:
  each element goes through the same float operations in the same order as before, so the results are the same
  bits (``tests/test_scan_triton.py`` checks it against the stock fallback).
- Every call of a ``@triton.jit`` helper from inside a kernel re-patched ``triton.language`` for the interpreter
  (``inspect.getmembers`` over three modules a call: a third of the scan tests' time). The kernel's launch has
  patched the same modules already and restores them when it ends, so a helper call inside a launch now patches
  only modules the launch has not (the stock path, as before, for anything else).

Patched here because the interpreter is Triton's and has no hook for either; a GPU never runs this."""
from __future__ import annotations

import inspect
import os

import numpy as np


def speed_up() -> bool:
    """Install both speed-ups in Triton's interpreter (once; a no-op unless ``TRITON_INTERPRET=1``). Returns
    whether they are installed."""
    return vectorise_scans() and patch_once_per_launch()


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


_launch: dict = {"patched": None}  # the triton.language modules the running kernel launch has patched (ids)


def _languages(fn) -> frozenset:
    """The ids of the modules the interpreter patches for ``fn`` (``triton.language`` and its ``core``, as its
    ``_patch_lang`` finds them in the function's globals)."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def patch_once_per_launch() -> bool:
    """A ``@triton.jit`` helper called inside a kernel launch skips the interpreter's re-patching of
    ``triton.language`` where the launch has patched every module the helper sees; any other call patches as the
    stock interpreter does (and its modules count as patched for the rest of the launch)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from triton.runtime import interpreter

    helper, launch = interpreter.InterpretedFunction, interpreter.GridExecutor
    if getattr(helper.__call__, "once_per_launch", False):
        return True
    stock_call, stock_launch = helper.__call__, launch.__call__
    if not all(part in _source(stock_call) for part in ("_patch_lang(self.fn)", "self.rewrite()")):
        return False  # another Triton's helper call: not the one replicated below, left as it is

    def launch_call(self, *args, **kwargs):
        _launch["patched"] = _languages(self.fn)
        try:
            return stock_launch(self, *args, **kwargs)
        finally:
            _launch["patched"] = None

    def helper_call(self, *args, **kwargs):
        patched, needs = _launch["patched"], _languages(self.fn)
        if patched is None or not needs or not needs <= patched:
            if patched is not None:
                _launch["patched"] = patched | needs
            return stock_call(self, *args, **kwargs)
        fn = self.rewrite()  # the stock call without its _patch_lang
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    helper_call.once_per_launch = True
    helper_call.stock = stock_call
    launch_call.stock = stock_launch
    helper.__call__, launch.__call__ = helper_call, launch_call
    return True


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
