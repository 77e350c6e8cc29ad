"""Plot pieces shared by the arms x seeds experiments (experiments/sparse_rl_compare_plot.py,
experiments/routing_stability_plot.py): a metric's mean over seeds with a ± standard-error band, the panels' titles
and legends, an atomic PNG write, and `runs_png`: `msrl compare`'s picture of every run (its per-step metrics on
shared axes, each arm's seeds as mean and min-max band; observability/compare.py). The studies' own figures draw
what `msrl compare` does not: trailing-window means with ± standard-error bands, each arm's collapses, the final
weights' accuracies under several evaluation engines. matplotlib's Agg canvas directly (no pyplot).
"""
from __future__ import annotations

from pathlib import Path

import study_stats as T
from megatron_sparse_rl.observability.plot import save_png, series  # noqa: F401  (save_png: the studies' PNG writer)


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


def runs_png(rows: list[dict], out_png: Path) -> Path:
    """`msrl compare OUT/seed*/<arm> ...` of the study's runs (`rows`' run_dir: OUT/seed<s>/<arm>, so an arm's seeds
    share a band), over the default metrics every run logged, into `out_png`."""
    from megatron_sparse_rl.observability.compare import common_metrics, figure, load_run

    runs = [load_run(row["run_dir"]) for row in rows]
    arms = list(dict.fromkeys(run.arm for run in runs))
    fig = figure(runs, common_metrics(runs), title=f"msrl compare: {len(runs)} runs of {', '.join(arms)}")
    return save_png(fig, out_png)
