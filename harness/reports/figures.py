"""A report's figures: each task's runs on the task's own axis (lines, slots or a heatmap) and the metric
against a per-row quantity (the model state a prompt left)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from evals import task_class
from harness.reports.plotting import pyplot, save


def plot(df: pd.DataFrame, metric: str, path: Path, subset: int | None = None) -> Path:
    """One task's runs on the task's own axis (``Task.axis_position``): by a statistic (HotpotQA's gold-paragraph
    slot); a two-part condition (the needle's length x depth) as a heatmap per run; a size-swept task (pairs,
    nodes, length) as one line per run over the size."""
    plt = pyplot()

    df = df[df["n"] > 0]
    task = df["task"].iloc[0]
    name = df["condition_name"].iloc[0]
    if df["series"].notna().any():
        return _heatmaps(df, metric, path, plt)
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    _run_lines(ax, df, "x", metric)
    if task_class(task).axis_statistic:  # conditions placed by a statistic: integer slots, names under them
        _slot_ticks(ax, df)
    else:
        values = sorted({v for v in df["x"].dropna()})
        if values and values[0] > 0 and values[-1] / values[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(values, [f"{v:g}" for v in values])
    ax.set_xlabel(task_class(task).axis_label or name)
    title = f"{task}: {metric} by {name}"
    ax.set_ylabel(f"{metric} (%)")
    ax.set_ylim(-3, 103)  # a line at 0 or 100 stays visible
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title + (f" ({subset} questions every oracle run answers)" if subset is not None else ""),
                 fontsize=10)
    save(fig, path, dpi=150)
    return path


AGAINST = {"state_bytes": ("model state the prompt left (bytes)", "state_memory"),
           "prompt_tokens": ("context length (prompt tokens)", "context_length")}


def plot_against(df: pd.DataFrame, metric: str, column: str, path: Path) -> Path:
    """The paper's axes: one line per run of the metric against the mean model-state bytes (or prompt length)
    of each condition: a Transformer's KV cache grows with the context, a recurrent model's state does not."""
    plt = pyplot()

    df = df[(df["n"] > 0) & df[column].notna()]
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    _run_lines(ax, df, column, metric)
    if len(df) and df[column].max() / max(df[column].min(), 1) >= 8:
        ax.set_xscale("log", base=2)
    if column == "state_bytes":
        from matplotlib.ticker import FuncFormatter

        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _human_bytes(v)))
    ax.set_xlabel(AGAINST[column][0])
    ax.set_ylabel(f"{metric} (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{df['task'].iloc[0]}: {metric} against {AGAINST[column][0].split(' (')[0]}", fontsize=10)
    save(fig, path, dpi=150)
    return path


def _run_lines(ax, df: pd.DataFrame, x: str, metric: str) -> None:
    """One line per run of the metric (percent, with its standard error) over column ``x``."""
    for run, g in df.groupby("run", sort=False):
        g = g.sort_values(x)
        ax.errorbar(g[x], 100 * g[metric], yerr=100 * g[f"{metric}_se"].fillna(0), marker="o", capsize=3, label=run)


def _human_bytes(v: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.3g} {unit}"
        v /= 1024
    return str(v)


def _slot_ticks(ax, df: pd.DataFrame) -> None:
    """One tick per slot, the named positions (first, middle, last) under their slot."""
    slots = sorted({int(round(s)) for s in df["x"].dropna()})
    if not slots:
        return
    ticks = list(range(0, max(slots) + 1))
    names: dict[int, list[str]] = {t: [] for t in ticks}
    for pos, s in zip(df["condition"], df["x"]):
        if not pos.isdigit() and s == s and pos not in names[int(round(s))]:
            names[int(round(s))].append(pos)
    step = 1 if len(ticks) <= 26 else 2
    ax.set_xticks(ticks, ["\n".join([str(t), *names[t]]) if names[t] or t % step == 0 else "" for t in ticks],
                  fontsize=8)


def _heatmaps(df: pd.DataFrame, metric: str, path: Path, plt) -> Path:
    """A grid per run of a two-part condition (the needle's length x depth), each cell the metric in percent;
    the axes are titled by the task."""
    task = task_class(df["task"].iloc[0])
    runs = list(dict.fromkeys(df["run"]))
    fig, axes = plt.subplots(1, len(runs), figsize=(1.6 + 3.6 * len(runs), 3.8), squeeze=False,
                             constrained_layout=True)
    for ax, run in zip(axes[0], runs):
        g = df[df["run"] == run]
        grid = g.pivot_table(index="series", columns="x", values=metric, aggfunc="mean")
        grid = grid.sort_index()
        im = ax.imshow(100 * grid.values, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(grid.columns)), [f"{c:g}" for c in grid.columns])
        ax.set_yticks(range(len(grid.index)), [f"{s:g}" for s in grid.index])
        for (i, j), v in np.ndenumerate(grid.values):
            ax.text(j, i, "" if v != v else f"{100 * v:.0f}", ha="center", va="center", fontsize=8,
                    color="white" if v == v and v < 0.6 else "black")
        ax.set_xlabel(task.axis_label or df["condition_name"].iloc[0].split("@")[0])
        if ax is axes[0][0]:
            ax.set_ylabel(task.series_label or df["condition_name"].iloc[0].split("@")[-1])
        ax.set_title(run, fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), label=f"{metric} (%)")
    first, second = df["condition_name"].iloc[0].split("@", 1)  # the axes' titles say more
    fig.suptitle(f"{task.name}: {metric} by {first} and {second}", fontsize=10)

    save(fig, path, dpi=150, tight=False)
    return path
