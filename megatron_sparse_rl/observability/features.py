"""What each feature of a run shows: its step-line fields, its metrics.png panel and its per-layer heat maps, in one
table (`FEATURES`) that the step line (progress.py), the figure (plot.py), TensorBoard's layout (metrics.py) and
`msrl compare` read.

A feature is on when the run's config switches it on (`Feature.on`); the step line shows the fields of the
features on (`features_on(run)`), the figure the panels of the features whose metrics a run's metrics.jsonl holds
(`panels_in(records)`, so a figure drawn from a file alone follows the run that wrote it). The fields and panels
(docs/data.md, "What a run shows"):

| feature | on when | step line | panel | heat map |
| episodes | env.kind != none | turns, tools, err (per episode) | episodes | - |
| sparse KV | rollout.kv.policy != none | saved (KV share compaction freed), p5 (rho 5th pct) | sparse KV | - |
| KV budget schedule | rollout.kv.budget_schedule.enabled | budget (this step's) | KV budget | - |
| routing flips | routing.record_stats, engine routes captured (R3 or capture_rollout_routes) | flip | routing flips |
  routing flip rate per layer |
| async | trainer.max_staleness > 0 | stale (mean staleness) | staleness | - |
| DSA indexer | routing.indexer_replay != none | agree (indexer agreement) | DSA indexer | indexer agreement per layer |
| expert drift | routing.record_stats | - | - | expert drift per layer |

A low-precision (bf16) engine's routing flips are what "routing flips" pictures: capture the engine's routes
(routing.capture_rollout_routes: true) to record them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from megatron_sparse_rl.observability import metrics as M
from megatron_sparse_rl.observability.progress import Field


@dataclass(frozen=True, slots=True)
class Line:
    """One curve of a panel: `label` and the metric keys it draws (summed when several are present)."""

    label: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Panel:
    """One plot of metrics.png (and one chart of TensorBoard's custom-scalars layout): `title` and its lines."""

    title: str
    lines: tuple[Line, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for line in self.lines for k in line.keys)

    def in_records(self, keys: set[str]) -> bool:
        """Whether a run logged this panel's first line (its own metric: a sparse-KV run's KV saved, not the rho
        percentile every run logs)."""
        return bool(keys.intersection(self.lines[0].keys))


@dataclass(frozen=True, slots=True)
class HeatMap:
    """A per-layer metric drawn as steps x layers: the keys `<prefix><layer>` (layer a number)."""

    title: str
    prefix: str

    def layers(self, keys: Iterable[str]) -> dict[int, str]:
        """{layer: key} of the keys of this metric among `keys`, in layer order."""
        pattern = re.compile(re.escape(self.prefix) + r"(\d+)$")
        found = {int(m.group(1)): k for k in keys if (m := pattern.match(k))}
        return dict(sorted(found.items()))


@dataclass(frozen=True, slots=True)
class Feature:
    name: str
    on: Callable[[Any], bool]
    """Whether a run config (RunConfig) switches the feature on."""
    fields: tuple[Field, ...] = ()
    panel: Panel | None = None
    heat_maps: tuple[HeatMap, ...] = ()


KV_SAVED = "kv/saved_frac"
"""1 - kv/retention: the share of a sample's KV entries that compaction freed (training/sparse_kv.py)."""
KV_BUDGET = "kv/budget"
"""The budget a step's rollouts were sampled at (rollout.kv.budget_schedule moves it: kv/budget_schedule.py)."""

# The four core panels: every run has them; one whose lines are constant is replaced by a note (plot.py).
CORE_PANELS: tuple[Panel, ...] = (
    Panel("reward", (Line("train", (M.REWARD,)),)),
    Panel("accuracy", (Line("train", (M.TRAIN_ACCURACY,)), Line("eval (held-out)", (M.EVAL_ACCURACY,)))),
    Panel("mismatch", (Line("k1", (M.MISMATCH_K1,)), Line("k3", (M.MISMATCH_K3,)))),
    Panel("clip fraction", (Line("clip", M.CLIP_FRACTION[:1]), Line("clip low+high", M.CLIP_FRACTION[1:]))),
)

FEATURES: tuple[Feature, ...] = (
    Feature("episodes", lambda run: run.env.kind != "none",
            (Field("turns", ("episode/turns",), "{:.2f}"), Field("tools", ("episode/tool_calls",), "{:.2f}"),
             Field("err", ("episode/tool_errors",), "{:.2f}")),
            Panel("episodes", (Line("turns", ("episode/turns",)), Line("tool calls", ("episode/tool_calls",)),
                               Line("tool errors", ("episode/tool_errors",))))),
    Feature("sparse KV", lambda run: run.rollout.kv.policy != "none",
            (Field("saved", (KV_SAVED,), "{:.0%}"), Field("p5", (M.MISMATCH_RHO_P5,), "{:.2f}")),
            Panel("sparse KV", (Line("KV saved", (KV_SAVED,)),
                                Line("rejected (Sparse-RL)", ("sparse_rl/rejected_seq_frac",)),
                                Line("rho p5", (M.MISMATCH_RHO_P5,))))),
    Feature("KV budget schedule",
            lambda run: run.rollout.kv.policy != "none" and run.rollout.kv.budget_schedule.enabled,
            (Field("budget", (KV_BUDGET,), "{:.0f}"),),
            Panel("KV budget", (Line("next step's budget", ("kv/budget_next",)), Line("budget", (KV_BUDGET,))))),
    Feature("routing flips", lambda run: run.routing.record_stats and run.routing.capture,
            (Field("flip", ("routing/flip_rate_mean",)),),
            Panel("routing flips", (Line("flip rate (mean over layers)", ("routing/flip_rate_mean",)),
                                    Line("tokens flipped in any layer", ("routing/flipped_token_fraction",)))),
            (HeatMap("routing flip rate per layer", "routing/flip_rate/layer"),)),
    Feature("async", lambda run: run.trainer.max_staleness > 0,
            (Field("stale", ("async/staleness_mean",), "{:.2f}"),),
            Panel("staleness", (Line("mean", ("async/staleness_mean",)), Line("max", ("async/staleness_max",))))),
    Feature("DSA indexer", lambda run: run.routing.indexer_replay != "none",
            (Field("agree", ("indexer/agreement",)),),
            Panel("DSA indexer", (Line("agreement", ("indexer/agreement",)),
                                  Line("flip rate", ("indexer/flip_rate",)))),
            (HeatMap("indexer agreement per layer", "indexer/agreement/layer_"),)),
    Feature("expert drift", lambda run: run.routing.record_stats,
            heat_maps=(HeatMap("expert drift per layer", "routing/drift/layer"),)),
)


def features_on(run) -> tuple[Feature, ...]:
    """The features the run config `run` switches on, in `FEATURES` order."""
    return tuple(f for f in FEATURES if f.on(run))


def step_line_fields(run) -> tuple[tuple[Field, ...], ...]:
    """One step-line group per feature on that has fields (progress.py `step_line_groups` appends them)."""
    return tuple(f.fields for f in features_on(run) if f.fields)


def _keys(records: Iterable[Mapping[str, Any]]) -> set[str]:
    return {k for r in records if r.get("phase", "rl") == "rl" for k, v in r.items() if v is not None}


def panels_in(records: Iterable[Mapping[str, Any]]) -> tuple[list[Panel], list[HeatMap]]:
    """(the feature panels, the heat maps) whose metrics the `rl` records hold, in `FEATURES` order."""
    keys = _keys(records)
    panels = [f.panel for f in FEATURES if f.panel is not None and f.panel.in_records(keys)]
    heat = [h for f in FEATURES for h in f.heat_maps if h.layers(keys)]
    return panels, heat


def tensorboard_layout(keys: Iterable[str]) -> dict:
    """TensorBoard's custom-scalars layout of the panels a record with `keys` fills: {"msrl": {title: ["Multiline",
    [tags]]}}, the core panels first, each heat map as one chart of its per-layer tags."""
    keys = set(keys)
    charts: dict[str, list] = {}
    for panel in CORE_PANELS + tuple(f.panel for f in FEATURES if f.panel is not None):
        tags = [k for k in panel.keys if k in keys]
        if tags and (panel in CORE_PANELS or panel.in_records(keys)):
            charts[panel.title] = ["Multiline", tags]
    for f in FEATURES:
        for h in f.heat_maps:
            tags = list(h.layers(keys).values())
            if tags:
                charts[h.title] = ["Multiline", tags]
    return {"msrl": charts}
