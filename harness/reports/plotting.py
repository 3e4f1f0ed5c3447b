"""Figures the project writes: matplotlib without a display, each PNG laid out, written atomically (a kill
leaves the old file or the new one, never half) and closed."""
from __future__ import annotations

import os
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display is needed, or used)."""
    import matplotlib

    matplotlib.use("Agg")
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
