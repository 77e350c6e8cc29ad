"""The experiment trackers a run may log to beside metrics.jsonl and TensorBoard: W&B and MLflow
(`logging.trackers`, observability/trackers.py writes to them). Each has its own settings section,
`logging.wandb` and `logging.mlflow`, read only when `logging.trackers` names it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_sparse_rl.config.checks import check as _check

Tracker = Literal["wandb", "mlflow"]
"""The names `logging.trackers` accepts."""


@dataclass(kw_only=True, frozen=True, slots=True)
class WandbConfig:
    """Weights & Biases (`logging.trackers: [wandb]`, the `wandb` package: pip install -e .[trackers])."""

    project: str = "megatron_sparse_rl"
    """W&B project the run belongs to."""
    entity: str | None = None
    """W&B team or user (None: the account's default; unused offline)."""
    mode: Literal["offline", "online"] = "offline"
    """offline: the run is written under <logging.dir>/wandb/ and needs no network or login (`wandb sync
    <logging.dir>/wandb/offline-run-*` uploads it later); online: streamed to the W&B server (needs `wandb login`
    or WANDB_API_KEY)."""

    def __post_init__(self):
        _check(bool(self.project.strip()), "logging.wandb.project must not be empty (allowed: a W&B project name)")


@dataclass(kw_only=True, frozen=True, slots=True)
class MlflowConfig:
    """MLflow (`logging.trackers: [mlflow]`, the `mlflow-skinny`, `sqlalchemy` and `alembic` packages: pip install
    -e .[trackers])."""

    tracking_uri: str | None = None
    """Where runs are stored. None: `sqlite:///<logging.dir>/mlflow.db`, a local store that needs no server (its
    artifacts in <logging.dir>/mlflow_artifacts).
    A server (`http://host:5000`) or another database URI works as MLflow accepts it; a file store
    (`file:///path/mlruns`) also needs MLFLOW_ALLOW_FILE_STORE=true, MLflow's own switch for that store."""
    experiment: str = "megatron_sparse_rl"
    """MLflow experiment the run is filed under (created when missing)."""
    check_timeout_s: float = 30.0
    """How long `msrl train` and `msrl validate` wait in all, over up to 3 tries, for the tracking server of an
    http(s) `tracking_uri` to answer before refusing the run (observability/trackers.py `check_trackers`); the run's
    own calls later use MLflow's retries."""

    def __post_init__(self):
        _check(self.check_timeout_s > 0, f"logging.mlflow.check_timeout_s must be > 0 (got {self.check_timeout_s})")
        _check(bool(self.experiment.strip()),
               "logging.mlflow.experiment must not be empty (allowed: an MLflow experiment name)")
        _check(self.tracking_uri is None or bool(self.tracking_uri.strip()),
               "logging.mlflow.tracking_uri must not be empty (allowed: null for <logging.dir>/mlflow.db, or an "
               "MLflow tracking URI such as sqlite:///path/mlflow.db or http://host:5000)")
