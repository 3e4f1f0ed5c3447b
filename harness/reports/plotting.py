"""Figures the project writes: matplotlib without a display, each PNG laid out, written atomically (a kill
leaves the old file or the new one, never half) and closed."""
from __future__ import annotations

import os
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display is needed, or used), with text drawn as written: run and
    model names reach titles and legends, and a name holding two ``$`` must not be parsed as mathtext (an error,
    or an italic letter in a label)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path, dpi: int, tight: bool = True) -> Path:
    path = Path(path)
    if tight:
        fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=dpi)
    os.replace(tmp, path)
    pyplot().close(fig)
    return path
