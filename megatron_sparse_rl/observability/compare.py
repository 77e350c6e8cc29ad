"""Several runs on shared axes (`msrl compare RUN_DIR... [--metric NAME...]`, tools/compare_cmd.py).

A run is a directory holding metrics.jsonl (or the file itself); its arm is the directory's name, so the seeds of
one arm (seed0/sparse, seed1/sparse) share it. Per metric (default: the core panels' metrics, `DEFAULT_METRICS`,
that any of the runs logged) one panel draws every run's `rl` records against the step; the runs of an arm that
holds several are drawn as their mean with a band from the lowest to the highest run at each step. The table
lists, per run and metric, the final value (the last step's that holds it) and the peak (the largest value) with
their steps. A metric that some runs logged and others did not is refused, naming the runs without it and the
metric; metrics no one asked about may differ.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_sparse_rl._optional import require
from megatron_sparse_rl.config.loader import ConfigError
from megatron_sparse_rl.observability import metrics as M
from megatron_sparse_rl.observability.plot import save_png, series

DEFAULT_METRICS = (M.REWARD, M.TRAIN_ACCURACY, M.EVAL_ACCURACY, M.MISMATCH_K1)


@dataclass(frozen=True)
class Run:
    name: str
    """The path as the user gave it (the table's run column)."""
    arm: str
    """The run directory's name: runs sharing it are drawn as one arm (mean and band)."""
    records: list[dict]

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        return series(self.records, (metric,))


@dataclass(frozen=True)
class Row:
    run: str
    metric: str
    final: float
    final_step: int
    peak: float
    peak_step: int


def load_run(path: str | Path) -> Run:
    """The run at `path`: a directory with metrics.jsonl, or a metrics.jsonl."""
    p = Path(path)
    file = p / M.FILENAME if p.is_dir() else p
    if not file.is_file():
        what = "a run directory without" if p.is_dir() else "no such run directory or"
        raise ConfigError(f"msrl compare: {str(path)!r} is {what} {M.FILENAME} (a run directory is the "
                          "logging.dir of `msrl train`)")
    try:
        records = M.read_metrics(file)
    except ValueError as e:
        raise ConfigError(f"msrl compare: {e}") from None
    arm = (file.parent if file.name == M.FILENAME else file).resolve().name
    return Run(str(path), arm, records)


def logged(run: Run) -> set[str]:
    """The metrics of the run's `rl` records that hold a finite number at some step."""
    return {k for r in run.records if r.get("phase", "rl") == "rl" for k, v in r.items()
            if k not in M.RESERVED and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def choose_metrics(runs: list[Run], metrics: list[str] | None) -> list[str]:
    """The metrics to compare: `metrics`, or the default ones any run logged; refused (ConfigError) where some runs
    logged one and others did not, naming those runs and the metric, or where no run logged it."""
    have = {run.name: logged(run) for run in runs}
    chosen = list(dict.fromkeys(metrics)) if metrics else [m for m in DEFAULT_METRICS
                                                            if any(m in h for h in have.values())]
    if not chosen:
        raise ConfigError(f"msrl compare: none of the runs logged any of {', '.join(DEFAULT_METRICS)}; name the "
                          "metrics to compare with --metric NAME")
    problems = []
    for metric in chosen:
        missing = [name for name, h in have.items() if metric not in h]
        if len(missing) == len(runs):
            near = sorted(m for m in set().union(*have.values()) if m.split("/")[0] == metric.split("/")[0])
            problems.append(f"no run logged the metric {metric!r}" +
                            (f" (logged under {metric.split('/')[0]}/: {', '.join(near[:8])})" if near else ""))
        elif missing:
            problems.append(f"the metric {metric!r} is in {len(runs) - len(missing)} of the runs but not in "
                            f"{', '.join(repr(m) for m in missing)}")
    if problems:
        raise ConfigError("msrl compare: the runs' metrics differ where compared: " + "; ".join(problems) +
                          " (compare other metrics with --metric NAME)")
    return chosen


def common_metrics(runs: list[Run]) -> list[str]:
    """The default metrics every one of the runs logged (for a caller that draws what it can instead of refusing:
    the experiments' runs.png)."""
    have = [logged(run) for run in runs]
    return [m for m in DEFAULT_METRICS if all(m in h for h in have)]


def table(runs: list[Run], metrics: list[str]) -> list[Row]:
    """Per run and metric: the final value (the last step holding one) and the peak (the largest), with steps."""
    rows = []
    for run in runs:
        for metric in metrics:
            xs, ys = run.series(metric)
            peak = max(range(len(ys)), key=lambda i: ys[i])  # the first step at the largest value
            rows.append(Row(run.name, metric, ys[-1], xs[-1], ys[peak], xs[peak]))
    return rows


def format_table(rows: list[Row]) -> str:
    head = ("run", "metric", "final", "(step)", "peak", "(step)")
    cells = [head] + [(r.run, r.metric, f"{r.final:.4g}", str(r.final_step), f"{r.peak:.4g}", str(r.peak_step))
                      for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip() for cell in cells)


def arms(runs: list[Run]) -> dict[str, list[Run]]:
    """The runs grouped by arm, in the order the arms first appear."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.arm, []).append(run)
    return out


def band(runs: list[Run], metric: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, low, high) over the runs at each step that every one of them holds."""
    values = [dict(zip(*run.series(metric))) for run in runs]
    steps = sorted(set.intersection(*(set(v) for v in values)))
    rows = [[v[s] for v in values] for s in steps]
    return steps, [sum(r) / len(r) for r in rows], [min(r) for r in rows], [max(r) for r in rows]


def figure(runs: list[Run], metrics: list[str], *, title: str = ""):
    """One panel per metric (its title the metric's name); an arm of one run is its line, an arm of several its
    mean line and min-max band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(len(metrics), 2 if len(metrics) <= 4 else 3)
    rows = math.ceil(len(metrics) / cols)
    fig = Figure(figsize=(5 * cols, 3.5 * rows + 0.4), dpi=100)
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    grouped = arms(runs)
    for ax, metric in zip(axes, metrics):
        for i, (arm, members) in enumerate(grouped.items()):
            color = f"C{i % 10}"
            if len(members) == 1:
                xs, ys = members[0].series(metric)
                ax.plot(xs, ys, color=color, label=arm, marker="o" if len(xs) < 30 else None, markersize=3)
                continue
            xs, mean, lo, hi = band(members, metric)
            ax.plot(xs, mean, color=color, label=f"{arm} (mean of {len(members)})")
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[len(metrics):]:
        fig.delaxes(ax)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def compare(paths: list[str | Path], out_png: str | Path, metrics: list[str] | None = None) -> tuple[Path, list[Row]]:
    """Load the runs, check their metrics, draw them into `out_png` (atomically) and return it with the table."""
    require("matplotlib", "msrl compare", "Install it with `pip install matplotlib` (or `pip install -e .[plot]`).")
    runs = [load_run(p) for p in paths]
    chosen = choose_metrics(runs, metrics)
    rows = table(runs, chosen)
    names = ", ".join(arms(runs))
    return save_png(figure(runs, chosen, title=f"{len(runs)} runs: {names}"), out_png), rows
