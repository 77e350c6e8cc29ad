"""Training curves from metrics.jsonl to a PNG that follows the run: the core panels (reward, accuracy (train and
eval), k1/k3 mismatch, clip fraction) that carry information (one whose metrics are constant or never logged is a
note under the plots instead), one panel per feature whose metrics the run logged and a steps x layers heat map per
per-layer metric (routing flip rate, DSA indexer agreement, expert drift): observability/features.py. Uses
matplotlib's Agg canvas directly (no pyplot, no global backend switch); non-finite points are skipped.

    python -m megatron_sparse_rl.observability.plot runs/demo/metrics.jsonl runs/demo/curves.png
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from megatron_sparse_rl._optional import require
from megatron_sparse_rl.observability import metrics as M
from megatron_sparse_rl.observability.features import CORE_PANELS, HeatMap, Panel, panels_in


def series(records: list[dict], keys: tuple[str, ...], phase: str = "rl") -> tuple[list[int], list[float]]:
    """(steps, values) of records of `phase` (records without a phase count as "rl") holding any of
    `keys` (summed), finite values only."""
    xs, ys = [], []
    for r in records:
        if r.get("phase", "rl") != phase:
            continue
        present = [r[k] for k in keys if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        if not present:
            continue
        value = float(sum(present))
        if math.isfinite(value):
            xs.append(int(r["step"]))
            ys.append(value)
    return xs, ys


def _draw(ax, panel: Panel, records: list[dict]) -> int:
    """The panel's lines on `ax`; returns how many had points."""
    drawn = 0
    for line in panel.lines:
        xs, ys = series(records, line.keys)
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=line.label)
            drawn += 1
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    return drawn


def _heat_map(fig, ax, heat: HeatMap, records: list[dict]) -> None:
    """Steps x layers of a per-layer metric (a step missing a layer's value is left blank)."""
    layers = heat.layers({k for r in records if r.get("phase", "rl") == "rl" for k in r})
    steps = sorted({int(r["step"]) for r in records if r.get("phase", "rl") == "rl"
                    and any(r.get(k) is not None for k in layers.values())})
    column = {step: j for j, step in enumerate(steps)}
    grid = [[math.nan] * len(steps) for _ in layers]
    for i, key in enumerate(layers.values()):
        for x, y in zip(*series(records, (key,))):
            grid[i][column[x]] = y
    mesh = ax.pcolormesh(steps, list(layers), grid, shading="nearest", cmap="viridis")
    fig.colorbar(mesh, ax=ax)
    ax.set_title(heat.title)
    ax.set_xlabel("step")
    ax.set_ylabel("layer")


def constant_note(panel: Panel, records: list[dict], tol: float = 1e-6) -> str | None:
    """Why a core panel carries no information, or None when it does: none of its metrics was logged, or every
    line it would draw holds at least two points within `tol` (relative to its size, at least absolute) of each
    other (a clip fraction of 0 at every step, an fp32 engine's k1 around 1e-8)."""
    lines = [(line.label, series(records, line.keys)[1]) for line in panel.lines]
    lines = [(label, ys) for label, ys in lines if ys]
    if not lines:
        return f"{panel.title}: not logged"
    parts = []
    for label, ys in lines:
        lo, hi = min(ys), max(ys)
        if len(ys) < 2 or hi - lo > tol * max(1.0, abs(lo), abs(hi)):
            return None
        parts.append(f"{label} {lo:.3g} at every step" if lo == hi else f"{label} within [{lo:.3g}, {hi:.3g}]")
    return f"{panel.title}: " + ", ".join(parts)


def figure(records: list[dict], *, title: str = ""):
    """The figure of a run's records: the core panels that carry information (the others become a note under the
    plots), one panel per feature whose metrics the records hold and one heat map per per-layer metric
    (observability/features.py). Panel titles are the axes' titles (colour bars have none)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    notes = [(p, constant_note(p, records)) for p in CORE_PANELS]
    panels = [p for p, note in notes if note is None]
    feature_panels, heat_maps = panels_in(records)
    panels += feature_panels
    n = max(len(panels) + len(heat_maps), 1)
    cols = 2 if n <= 4 else 3
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(5 * cols, 3.5 * rows + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax, panel in zip(axes, panels):
        _draw(ax, panel, records)
    for ax, heat in zip(axes[len(panels):], heat_maps):
        _heat_map(fig, ax, heat, records)
    for ax in axes[len(panels) + len(heat_maps):]:
        fig.delaxes(ax)
    text = "; ".join(note for _, note in notes if note is not None)
    if text:
        fig.text(0.01, 0.005, "not drawn (no information): " + text, fontsize=8, color="gray", wrap=True)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04 if text else 0, 1, 1))
    return fig


def panel_titles(fig) -> list[str]:
    """The titles of a figure's panels, in order."""
    return [ax.get_title() for ax in fig.axes if ax.get_title()]


def save_png(fig, out_png: str | Path) -> Path:
    """Write `fig` to `out_png` atomically (temp file, then rename)."""
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path, *, title: str | None = None) -> Path:
    """Write the figure of `metrics_jsonl` (`figure`) to `out_png` (atomically: temp file, then rename)."""
    require("matplotlib", "Plotting metrics", "Install it with `pip install matplotlib` (or `pip install -e .[plot]`).")
    return save_png(figure(M.read_metrics(metrics_jsonl), title=title or str(metrics_jsonl)), out_png)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m megatron_sparse_rl.observability.plot METRICS_JSONL OUT_PNG")
    print(plot_metrics(sys.argv[1], sys.argv[2]))
