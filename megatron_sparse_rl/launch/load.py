"""Load a run config together with its `LaunchConfig` (megatron_sparse_rl/config/launch.py).

    run, launch = load_run("configs/tiny_moe.yaml", ["launch.slurm.partition=debug"])
    job_args = job_overrides(["launch.slurm.partition=debug", "learner.seed=3"])

Until `RunConfig.launch` is the `LaunchConfig` of config/launch.py, the `launch` section is read here
with that class and the rest of the run with the schema's own (narrower) launch section, and the
`launch.*` overrides the schema does not know are kept out of the job's command line (the job re-reads
the config with the schema). Once the schema imports config/launch.py both paths are the plain loader.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from pathlib import Path

from megatron_sparse_rl.config.launch import LaunchConfig
from megatron_sparse_rl.config.loader import from_dict, merge_overrides, parse_override, read_yaml
from megatron_sparse_rl.config.schema import RunConfig


def _schema_launch_type() -> type:
    return typing.get_type_hints(RunConfig)["launch"]


def load_run(path: str | Path, overrides: Iterable[str] = ()):
    """(RunConfig, LaunchConfig) from the YAML at `path` plus `--set` overrides; ConfigError names the field."""
    overrides = list(overrides)
    data = merge_overrides(read_yaml(path), overrides)
    schema_launch = _schema_launch_type()
    if schema_launch is LaunchConfig:
        run = from_dict(RunConfig, data)
        return run, run.launch
    launch_data = data.pop("launch", None) or {}
    launch = from_dict(LaunchConfig, launch_data, "launch")
    known = {f.name for f in dataclasses.fields(schema_launch)}
    data["launch"] = {k: v for k, v in launch_data.items() if k in known}
    return from_dict(RunConfig, data), launch


def job_overrides(overrides: Iterable[str]) -> list[str]:
    """The overrides to forward to the job's own `load_config`: all of them, except `launch.*` keys the
    schema's launch section does not know yet (they only steer the launcher)."""
    known = {f.name for f in dataclasses.fields(_schema_launch_type())}
    kept = []
    for text in overrides:
        parts, _ = parse_override(text)
        if parts[0] == "launch" and len(parts) > 1 and parts[1] not in known:
            continue
        kept.append(text)
    return kept
