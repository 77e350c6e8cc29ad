"""Run configuration: frozen dataclasses (schema.py), a strict YAML loader (loader.py), the
cross-component checks (validate.py) and the runtime values resolved from the model (resolve.py).

    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.validation import validate
    run = load_config("configs/tiny_moe.yaml", overrides=["learner.optimizer.lr=3e-5"])
    spec = validate(run, world_size=1)     # ModelSpec, or None when the model's config.json is not here
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from megatron_sparse_rl.config.loader import ConfigError, from_dict, merge_overrides, read_yaml, to_dict
from megatron_sparse_rl.config.schema import RunConfig


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> RunConfig:
    """Read the YAML overrides at `path`, apply `--set` style `overrides` ("a.b=v") and build a RunConfig.

    Raises ConfigError naming the dotted field for unknown keys, wrong types and out-of-range values.
    """
    return from_dict(RunConfig, merge_overrides(read_yaml(path), list(overrides)))


__all__ = ["ConfigError", "RunConfig", "load_config", "to_dict"]
