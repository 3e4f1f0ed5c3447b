"""What every benchmark's command line shares: ``--help`` with the docstring as written and every flag's default,
and output that reaches a pipe line by line (a benchmark that runs for minutes says where it is as it goes); and
``AllocatedBytes``, the bytes a piece of code allocates, for memory rows measured the same way on any device."""
from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every flag's default, flags without a help text included (argparse shows
    nothing for those)."""

    def _format_action(self, action):
        if not action.help and action.option_strings and action.default not in (argparse.SUPPRESS, None):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser; its rows are printed as they are measured, also into a pipe or a log file."""
    if hasattr(sys.stdout, "reconfigure"):  # a real stream (not one a caller redirected into a buffer)
        sys.stdout.reconfigure(line_buffering=True)
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)


class AllocatedBytes(TorchDispatchMode):
    """The bytes of the tensors that the PyTorch ops run inside ``with AllocatedBytes() as counted:`` create
    (``counted.bytes``), each storage once: what a piece of code allocates outside its kernels, on any device
    (a CPU has no allocator statistics). Views, in-place ops and outputs that alias an input count nothing."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in given:
                    self.storages.setdefault(storage.data_ptr(), storage.nbytes())
        return out
