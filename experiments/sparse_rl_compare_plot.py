"""The one PNG of experiments/sparse_rl_compare.py: rollout reward per arm (mean ± standard error over seeds as a
band), held-out accuracy of every arm's final weights under the three evaluation engines (mean with s.e. error
bars, seeds as faint dots), the k1 mismatch and the Sparse-RL rejection rate (bands). matplotlib's Agg canvas
directly (no pyplot); written atomically.
"""
from __future__ import annotations

from pathlib import Path

import sparse_rl_compare_stats as S
from megatron_sparse_rl.observability import metrics as M
from megatron_sparse_rl.observability.plot import series

COLORS = {"dense": "tab:blue", "naive_sparse": "tab:red", "sparse_rl": "tab:green"}


def _band(ax, records: list[list[dict]], key: str, window: int, color: str, label: str, **line) -> bool:
    """Mean ± s.e. over seeds of the `window`-step trailing mean of `key`; False when no run logged it."""
    curves = [series(recs, (key,)) for recs in records]
    curves = [(xs, S.trailing_mean(ys, window)) for xs, ys in curves if xs]
    if not curves:
        return False
    xs = min((c[0] for c in curves), key=len)
    mean, se = S.band([ys for _, ys in curves])
    ax.plot(xs[:len(mean)], mean, color=color, label=label, **line)
    if len(curves) > 1:
        lo = [m - (s or 0.0) for m, s in zip(mean, se)]
        hi = [m + (s or 0.0) for m, s in zip(mean, se)]
        ax.fill_between(xs[:len(mean)], lo, hi, color=color, alpha=0.2, linewidth=0)
    return True


def _accuracy(ax, summary: dict, labels: dict[str, str]) -> None:
    arms, modes = summary["arms"], summary["eval_modes"]
    for i, arm in enumerate(arms):
        dx = (i - (len(arms) - 1) / 2) * 0.22
        for j, mode in enumerate(modes):
            vals = [r[f"eval_{mode}"] for r in summary["runs"] if r["arm"] == arm and r[f"eval_{mode}"] is not None]
            ax.plot([j + dx] * len(vals), vals, "o", color=COLORS[arm], alpha=0.3, markersize=4)
        stats = [summary["per_arm"][arm][f"eval_{m}"] for m in modes]
        ax.errorbar([j + dx for j in range(len(modes))], [s["mean"] for s in stats],
                    yerr=[s["se"] or 0.0 for s in stats], fmt="s", color=COLORS[arm], capsize=4, label=labels[arm])
    ax.set_xticks(range(len(modes)), [summary["eval_mode_labels"][m] for m in modes], fontsize=8)


def plot(summary: dict, records: dict[str, list[list[dict]]], labels: dict[str, str], window: int,
         out_png: Path) -> Path:
    """`records[arm]`: the metrics records of that arm's runs, one list per seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 8.5), dpi=72)
    FigureCanvasAgg(fig)
    ax_r, ax_a, ax_k, ax_j = fig.subplots(2, 2).ravel()
    n = summary["seeds"]
    for arm in summary["arms"]:
        c, recs = COLORS[arm], records[arm]
        collapsed = sum(r["collapsed"] for r in summary["runs"] if r["arm"] == arm)
        _band(ax_r, recs, M.REWARD, window, c, f"{labels[arm]} (collapsed {collapsed}/{n})")
        _band(ax_k, recs, M.MISMATCH_K1, window, c, f"{labels[arm]}: mismatch/k1")
        _band(ax_k, recs, S.K1_AFTER, window, c, f"{labels[arm]}: kv/k1_after_compression", linestyle="--")
        _band(ax_k, recs, S.K1_BEFORE, window, c, f"{labels[arm]}: kv/k1_before_compression", linestyle=":")
        _band(ax_j, recs, S.REJECTED_SEQ, window, c, f"{labels[arm]}: rejected sequences")
        _band(ax_j, recs, S.REJECTED_TOKEN, window, c, f"{labels[arm]}: rejected tokens", linestyle="--")
    _accuracy(ax_a, summary, labels)
    titles = ((ax_r, f"rollout reward (own engine), mean of {window} steps; band: ± s.e. over {n} seed(s)", "RL step"),
              (ax_a, f"held-out accuracy of the final weights: mean ± s.e. over {n} seed(s) (dots: seeds)", None),
              (ax_k, f"k1 = mean(log mu - log pi_old), mean of {window} steps", "RL step"),
              (ax_j, f"Sparse-RL rejection rate, mean of {window} steps", "RL step"))
    for ax, title, xlabel in titles:
        ax.set_title(title, fontsize=9)
        if xlabel:
            ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(summary["title"], fontsize=11)
    fig.tight_layout()
    tmp = out_png.with_name(out_png.name + ".tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(out_png)
    return out_png
