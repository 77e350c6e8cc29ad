"""The plots of experiments/routing_stability.py: one PNG per group of arms (OUT/plots/<group>.png), six panels of
per-step curves, each the mean over seeds with a ± standard-error band, read from summary.json's "curves" (the same
numbers the summary reports): held-out accuracy (warm start at step 0), rollout reward, train-inference k3, routing
flip rate (solid) with the expert drift pi_old -> pi_theta (dashed, when logged), token entropy, clipped fraction.
"""
from __future__ import annotations

from pathlib import Path

import study_plot as P

# (curve, title, dashed companion curve or None)
PANELS = (
    ("heldout", "held-out accuracy (step 0: warm start)", None),
    ("reward", "rollout reward (own engine)", None),
    ("k3", "train-inference mismatch/k3 (mu vs pi_old)", None),
    ("flip_rate", "routing flip rate (solid), expert drift pi_old -> pi_theta (dashed)", "drift"),
    ("entropy", "token entropy (loss/entropy)", None),
    ("clip_frac", "clipped token fraction", None),
)


def plot_group(summary: dict, group: str, out_png: Path) -> Path:
    """The six panels of `group`'s arms."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 8.5), dpi=72)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).ravel()
    n, arms = summary["seeds"], summary["groups"][group]
    for i, arm in enumerate(arms):
        color, curves = f"C{i % 10}", summary["curves"][arm]
        collapsed = sum(r["collapsed"] for r in summary["runs"] if r["arm"] == arm)
        label = f"{arm} (collapsed {collapsed}/{n})"
        for ax, (name, _, dashed) in zip(axes, PANELS):
            if name in curves:
                P.draw_band(ax, curves[name], color, label, marker="o" if name == "heldout" else None, markersize=3)
            if dashed in curves:
                P.draw_band(ax, curves[dashed], color, f"{arm}: drift", linestyle="--")
    P.finish_axes([(ax, title, "RL step") for ax, (_, title, _) in zip(axes, PANELS)], fontsize=6)
    fig.suptitle(f"{summary['title']}: {group}; lines: mean over {n} seed(s), bands: ± standard error", fontsize=11)
    fig.tight_layout()
    return P.save_png(fig, out_png)


def plot_all(summary: dict, out_dir: Path) -> dict[str, str]:
    """{group: PNG path} for every group of the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {g: str(plot_group(summary, g, out_dir / f"{g}.png")) for g in summary["groups"]}
