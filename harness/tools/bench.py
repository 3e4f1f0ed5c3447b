"""What every benchmark's command line shares: ``--help`` with the docstring as written and every flag's default,
and output that reaches a pipe line by line (a benchmark that runs for minutes says where it is as it goes)."""
from __future__ import annotations

import argparse
import copy
import sys


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
