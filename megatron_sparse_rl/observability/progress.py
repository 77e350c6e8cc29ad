"""One line per step: a text progress bar with step/total and ETA, then the key metrics compactly.

    [######..............]  30/100  30% eta 4m12s | roll 1.20s train 0.45s sync 0.10s | 812 tok/s kv 41% |
    reward 0.412 acc 0.380 eval 0.350 | k1 1.2e-03 k3 4.0e-04 | clip 0.021 rej 0.050

(one line; wrapped here). A metric that is missing from a step is left out of its line. Each feature the run has
on adds its own group at the end (observability/features.py; docs/data.md, "What a run shows"), e.g. with
episodes and sparse KV: `| turns 1.80 tools 0.75 err 0.02 | saved 33% p5 0.93`. The ETA is the mean
time per step since the first line (or since `restart(step)`) times the steps left; so the one-off start-up
before the first step (engine and learner start, the SFT stage, the warm-start evaluation, a resume's skipped
steps) never counts. At the first line, where no step has been timed between two lines yet, it is that step's
own phase times (`STEP_TIMES`: rollout + train + sync) times the steps left, or "?" without them.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TextIO

from megatron_sparse_rl.observability import metrics as M


@dataclass(frozen=True, slots=True)
class Field:
    """One item of the line: `label` and the value of `keys` (the first present, or their sum)."""

    label: str
    keys: tuple[str, ...]
    fmt: str = "{:.3f}"
    reduce: str = "first"  # "first": the first key present; "sum": the sum of those present
    suffix: str = ""


CLIP_FIELD = Field("clip", M.CLIP_FRACTION[1:], reduce="sum")
DEFAULT_GROUPS: tuple[tuple[Field, ...], ...] = (
    (Field("roll", ("time/rollout_s",), "{:.2f}", suffix="s"), Field("train", ("time/train_s",), "{:.2f}", suffix="s"),
     Field("sync", ("time/sync_s",), "{:.2f}", suffix="s")),
    (Field("", ("rollout/tokens_per_s", "train/tokens_per_s"), "{:.0f}", suffix=" tok/s"),
     Field("kv", ("rollout/kv_peak_occupancy",), "{:.0%}")),
    (Field("reward", (M.REWARD,)), Field("acc", (M.TRAIN_ACCURACY,)), Field("eval", (M.EVAL_ACCURACY,))),
    (Field("k1", (M.MISMATCH_K1,), "{:.1e}"), Field("k3", (M.MISMATCH_K3,), "{:.1e}")),
    (Field("clip", M.CLIP_FRACTION[:1]), CLIP_FIELD, Field("rej", M.REJECTION)),
)


def step_line_groups(features: tuple[tuple[Field, ...], ...] = ()) -> tuple[tuple[Field, ...], ...]:
    """The line's fields for a run: DEFAULT_GROUPS, then one group per feature the run has on (observability/
    features.py `step_line_fields(run)`)."""
    return DEFAULT_GROUPS + tuple(features)


# The phases of one step whose sum estimates its duration before two lines have been timed.
STEP_TIMES = Field("step", ("time/rollout_s", "time/train_s", "time/sync_s"), reduce="sum")


def _pick(f: Field, metrics: Mapping[str, Any]) -> float | None:
    present = [metrics[k] for k in f.keys if metrics.get(k) is not None]
    if not present:
        return None
    return float(sum(float(v) for v in present)) if f.reduce == "sum" else float(present[0])


def format_duration(seconds: float) -> str:
    """Compact h/m/s: 42s, 4m12s, 1h03m."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def progress_bar(step: int, total: int, width: int = 20) -> str:
    """`[#####...............]` filled in proportion to step/total."""
    frac = min(max(step / total, 0.0), 1.0) if total > 0 else 1.0
    filled = int(frac * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def format_metrics(metrics: Mapping[str, Any], groups=DEFAULT_GROUPS) -> str:
    """The metric part of the line: groups joined by " | ", missing metrics left out."""
    parts = []
    for group in groups:
        items = []
        shown = set()
        for f in group:
            value = _pick(f, metrics)
            if value is None or f.label in shown:  # "clip": loss/clip_frac wins over the low+high sum
                continue
            shown.add(f.label)
            text = "nan" if not math.isfinite(value) else f.fmt.format(value)
            items.append(f"{f.label} {text}{f.suffix}".strip())
        if items:
            parts.append(" ".join(items))
    return " | ".join(parts)


class ProgressPrinter:
    """Prints one line per `update(step, metrics)`; returns the line too."""

    def __init__(self, total: int, *, width: int = 20, stream: TextIO | None = None, groups=DEFAULT_GROUPS,
                 clock: Callable[[], float] = time.monotonic):
        self.total = total
        self.width = width
        self.stream = stream if stream is not None else sys.stdout
        self.groups = groups
        self.clock = clock
        self._start: tuple[int, float] | None = None  # (step, time) of the first line; set by line()

    def restart(self, step: int) -> None:
        """Restart the ETA clock now, at `step` (the last step already done)."""
        self._start = (step, self.clock())

    def eta(self, step: int, metrics: Mapping[str, Any] | None = None) -> float:
        """Seconds left: mean seconds per step since the first line (or restart), times the steps left; before a
        step has been timed that way, the step's own STEP_TIMES in `metrics`; nan when neither is known."""
        left = max(self.total - step, 0)
        if self._start is not None and step > self._start[0]:
            start_step, t0 = self._start
            return (self.clock() - t0) / (step - start_step) * left
        own = _pick(STEP_TIMES, metrics or {})
        return float("nan") if own is None else own * left

    def line(self, step: int, metrics: Mapping[str, Any]) -> str:
        pct = 100.0 * step / self.total if self.total > 0 else 100.0
        n = len(str(self.total))
        eta = self.eta(step, metrics)
        if self._start is None:
            self._start = (step, self.clock())
        head = f"{progress_bar(step, self.total, self.width)} {step:>{n}}/{self.total} {pct:3.0f}% " \
               f"eta {format_duration(eta)}"
        body = format_metrics(metrics, self.groups)
        return f"{head} | {body}" if body else head

    def update(self, step: int, metrics: Mapping[str, Any]) -> str:
        text = self.line(step, metrics)
        print(text, file=self.stream, flush=True)
        return text
