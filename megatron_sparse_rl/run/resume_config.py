"""What a resumed run may change in its config. Every checkpoint of a run holds the resolved config of the run that
saved it (`run_config.json`); a resume compares it with its own, field by field (run/run_dir.py):

- a change to what the resumed steps compute (the model, the data and rewards, the SFT stage, the algorithm,
  sampling, the optimizer and schedule, seeds, the engine's precision and KV policy...) is refused unless
  `checkpoint.allow_config_change` is on;
- a change to how long the run goes on, how it is evaluated, logged, checkpointed, laid out or resourced (`ALLOWED`)
  is allowed, and listed.

A field not covered by `ALLOWED` counts as changing what is computed: a field added later is refused on resume
until someone decides otherwise here.

    changes = compare(saved, to_dict(run), defaults=to_dict(RunConfig()))
    [str(c) for c in changes if not c.allowed]        # ["trainer.sft.max_steps: 3 -> 5"]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ALLOWED = (
    # how long the run goes on, and its evaluation (held-out accuracy is measured, never trained on)
    "trainer.steps", "trainer.eval_every", "trainer.eval_prompts", "trainer.eval_temperature", "trainer.eval_samples",
    # the learner -> engine weight transport and its check
    "trainer.sync_bucket_mb", "trainer.sync_engine_slices", "trainer.verify_sync_every", "trainer.verify_sync_tol",
    # how a stop request is honoured
    "trainer.stop_timeout_s",
    # where and how the run is kept and logged
    "checkpoint", "logging",
    # the layout: checkpoints reshard on load; another layout changes rounding and which rank draws which sample
    "parallel", "launch", "rollout.tensor_parallel_size",
    # the same computation, split or scheduled differently
    "learner.micro_batch_size", "learner.group_by_length", "model.recompute_activations",
    # engine resources (the KV policy's own pool settings are not among them: they decide what compaction keeps)
    "rollout.kv_cache_gb", "rollout.max_num_seqs", "rollout.gpu_memory_utilization", "rollout.enforce_eager",
    # what is recorded for metrics only
    "rollout.kv.record_keep", "rollout.record_sampling_mask", "routing.record_stats",
    "routing.capture_rollout_routes", "routing.engine_routes", "routing.attribute_mismatch",
)
"""Dotted config paths (a section covers every field under it) a resume may change without
`checkpoint.allow_config_change`."""


class _Absent:
    """A side of a change where the field does not exist."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


NOT_RECORDED = _Absent("(not recorded)")
"""The old side of a field the checkpoint's config lacks (saved by a version without that field) when this run
sets it to something other than its default."""
REMOVED = _Absent("(no longer a field)")
"""The new side of a field the checkpoint's config has but this version does not."""


def allowed(path: str) -> bool:
    """Whether a resume may change the field at dotted `path` without `checkpoint.allow_config_change`."""
    return any(path == p or path.startswith(p + ".") for p in ALLOWED)


def _show(value: Any, limit: int = 160) -> str:
    """`value` as JSON; past `limit` characters the middle gives way to "...", so a long path keeps its ends."""
    if isinstance(value, _Absent):
        return value.text
    text = json.dumps(value, sort_keys=True)
    if len(text) <= limit:
        return text
    head = (limit - 3) // 2
    return text[:head] + "..." + text[len(text) - (limit - 3 - head):]


@dataclass(frozen=True)
class Change:
    """One field that differs between the checkpoint's config (`old`) and this run's (`new`)."""

    path: str
    old: Any
    new: Any

    @property
    def allowed(self) -> bool:
        """Allowed: a field in `ALLOWED`, or one this version no longer has (nothing reads it any more)."""
        return allowed(self.path) or self.new is REMOVED

    def __str__(self) -> str:
        return f"{self.path}: {_show(self.old)} -> {_show(self.new)}"


def _lookup(tree: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return REMOVED
        tree = tree[key]
    return tree


def compare(old: dict, new: dict, defaults: dict | None = None, path: str = "") -> list[Change]:
    """The fields that differ between the config mappings `old` (the checkpoint's) and `new` (this run's), both as
    `config.to_dict` writes them (then JSON: tuples are lists), in dotted-path order. A section that is a mapping
    on one side only (e.g. `model.tiny` null -> {...}) is one change. A field `old` lacks (added to the schema since
    the checkpoint) is a change only when `new` holds something other than its value in `defaults` (the dataclass
    defaults, which keep the behaviour from before the field existed)."""
    changes = []
    for key in sorted(set(old) | set(new)):
        here = f"{path}.{key}" if path else str(key)
        if key not in old:
            if new[key] != _lookup(defaults or {}, here):
                changes.append(Change(here, NOT_RECORDED, new[key]))
        elif key not in new:
            changes.append(Change(here, old[key], REMOVED))
        elif isinstance(old[key], dict) and isinstance(new[key], dict):
            changes += compare(old[key], new[key], defaults, here)
        elif old[key] != new[key]:
            changes.append(Change(here, old[key], new[key]))
    return changes
