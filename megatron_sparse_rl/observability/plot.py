"""Training curves from metrics.jsonl to a PNG: reward, accuracy (train and eval), k1/k3 mismatch, clip
fraction. Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch). A metric that
was never logged leaves its panel empty with a "no data" note; non-finite points are skipped.

    python -m megatron_sparse_rl.observability.plot runs/demo/metrics.jsonl runs/demo/curves.png
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from megatron_sparse_rl._optional import require
from megatron_sparse_rl.observability import metrics as M

# (panel title, [(line label, metric keys summed when several)])
PANELS: tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    ("reward", (("train", (M.REWARD,)),)),
    ("accuracy", (("train", (M.TRAIN_ACCURACY,)), ("eval (held-out)", (M.EVAL_ACCURACY,)))),
    ("mismatch", (("k1", (M.MISMATCH_K1,)), ("k3", (M.MISMATCH_K3,)))),
    ("clip fraction", (("clip", M.CLIP_FRACTION[:1]), ("clip low+high", M.CLIP_FRACTION[1:]))),
)


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


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path, *, title: str | None = None) -> Path:
    """Write the curves of `metrics_jsonl` to `out_png` (atomically: temp file, then rename)."""
    require("matplotlib", "Plotting metrics", "Install it with `pip install matplotlib` (or `pip install -e .[plot]`).")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = M.read_metrics(metrics_jsonl)
    fig = Figure(figsize=(10, 7), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).ravel()
    for ax, (panel, lines) in zip(axes, PANELS):
        drawn = 0
        for label, keys in lines:
            xs, ys = series(records, keys)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
                drawn += 1
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(title or str(metrics_jsonl))
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m megatron_sparse_rl.observability.plot METRICS_JSONL OUT_PNG")
    print(plot_metrics(sys.argv[1], sys.argv[2]))
