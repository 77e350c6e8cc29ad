"""Plot pieces shared by the arms x seeds experiments (experiments/sparse_rl_compare_plot.py,
experiments/routing_stability_plot.py): a metric's mean over seeds with a ± standard-error band, the panels' titles
and legends, and an atomic PNG write. matplotlib's Agg canvas directly (no pyplot).
"""
from __future__ import annotations

from pathlib import Path

import study_stats as T
from megatron_sparse_rl.observability.plot import series


def band(ax, records: list[list[dict]], keys: tuple[str, ...], window: int, color: str, label: str, *,
         phase: str = "rl", **line) -> bool:
    """Mean ± s.e. over seeds (`records`: one run's metrics records each) of the `window`-step trailing mean of
    `keys` (summed where several are logged); False when no run logged it."""
    curve = T.mean_curve([series(recs, keys, phase) for recs in records], window)
    return curve is not None and draw_band(ax, curve, color, label, **line)


def draw_band(ax, curve: dict, color: str, label: str, **line) -> bool:
    """A mean_curve's mean as a line and its ± s.e. as a band (the band only with two runs or more)."""
    xs, mean, se = curve["steps"], curve["mean"], curve["se"]
    ax.plot(xs, mean, color=color, label=label, **line)
    if any(s is not None for s in se):
        lo = [m - (s or 0.0) for m, s in zip(mean, se)]
        hi = [m + (s or 0.0) for m, s in zip(mean, se)]
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)
    return True


def finish_axes(panels, fontsize: int = 7) -> None:
    """(ax, title, x label or None) each: title, label, grid, and a legend, or "no data" on an empty panel."""
    for ax, title, xlabel in panels:
        ax.set_title(title, fontsize=9)
        if xlabel:
            ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=fontsize)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def save_png(fig, out_png: Path) -> Path:
    """Write `fig` to `out_png` through a temporary file and a rename."""
    tmp = out_png.with_name(out_png.name + ".tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(out_png)
    return out_png
