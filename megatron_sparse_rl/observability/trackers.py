"""W&B and MLflow as metric sinks beside metrics.jsonl and TensorBoard (`logging.trackers`, config/trackers.py).

`MetricsWriter` hands each tracker the numbers of a record (observability/metrics.py `scalars`: bools as 0/1,
strings and None stay JSONL-only) under the names TensorBoard gets: the metric's name, prefixed with the phase when
it is not "rl" ("sft/eval/accuracy"), at the record's step. Each tracker gets the run's resolved config once, when
it opens. Only rank 0 opens trackers (training/context.py open_metrics).

- W&B: `wandb.init(mode=logging.wandb.mode, dir=<logging.dir>)` (offline by default: the run is written under
  <logging.dir>/wandb/, no network), run id = this run's id (run.json), `resume="allow"` when there is one. The
  config is the W&B run config. Each record is one `log` call whose row carries the metrics and `step` (every
  metric is charted against `step`: an SFT stage and the RL steps after it both count from 1, which W&B's own
  step, strictly increasing, could not hold). Offline, each start (a resume too) writes its own
  offline-run-<time>-<id>/ directory under that id.
- MLflow: `MlflowClient(logging.mlflow.tracking_uri)` (default: sqlite:///<logging.dir>/mlflow.db, its artifacts in
  <logging.dir>/mlflow_artifacts), experiment `logging.mlflow.experiment`, a run tagged `msrl.run_id` = this run's
  id (a resumed run finds it and goes on logging to it). The config is logged as the run's params (flattened
  dotted keys, values as text; a param keeps its first value, so a resume with an accepted change logs only the keys
  that are new) and as the artifact `config.json`, rewritten at every start. Each record is one `log_batch` at the
  record's step.

Each tracker's `close(failed)` ends its run: FINISHED (W&B exit code 0) when the trainer finished or stopped on
request, FAILED (W&B exit code 1) when it raised (trainer.py).

Steps replayed after a resume (those logged after the checkpoint it resumes from) are logged again: the first W&B
offline directory keeps the old rows and the new one holds the new; the MLflow run holds both values at each such
step; metrics.jsonl drops the old ones and TensorBoard's reader hides them (observability/metrics.py;
docs/data.md, "What a resumed run writes").
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Mapping

from megatron_sparse_rl._optional import require
from megatron_sparse_rl.observability.logging import reroute

log = logging.getLogger(__name__)

PACKAGES = {"wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}
"""The modules each tracker imports (sqlalchemy and alembic: MLflow's sqlite store, the default)."""
HINT = "Install the trackers extra: pip install -e .[trackers] (wandb, mlflow-skinny, sqlalchemy, alembic)."
TAG = "msrl.run_id"
"""The MLflow run tag holding this project's run id (run.json)."""
PARAM_BATCH = 100  # MLflow's limit of params per log_batch
ARTIFACT_DIR = "mlflow_artifacts"
"""Where the default MLflow store (<logging.dir>/mlflow.db) keeps the runs' artifacts (config.json), in the run
directory."""


def require_trackers(names: tuple[str, ...]) -> None:
    """Raise an ImportError naming the tracker, its missing package and the pip extra, before anything starts."""
    for name in names:
        for module in PACKAGES[name]:
            require(module, f"logging.trackers: {name}", HINT)


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """A nested dict of the config -> {"logging.dir": "runs/x", "trainer.steps": "40", ...}; lists stay whole
    (as JSON text)."""
    if isinstance(config, Mapping):
        out: dict[str, str] = {}
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: config if isinstance(config, str) else json.dumps(config)}


class WandbTracker:
    """One W&B run for this run (module docstring)."""

    def __init__(self, cfg, run_dir: Path, run_id: str | None, config: dict):
        require_trackers(("wandb",))
        import wandb

        settings = wandb.Settings(console="off", silent=True)
        # W&B's own terminal lines (its tips on start) follow the settings of wandb.setup, not init's
        wandb.setup(settings=settings)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, dir=str(run_dir),
                              id=run_id, resume="allow" if run_id else None, name=run_dir.name,
                              config=config, settings=settings)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        log.info("W&B run %s (%s) in %s", self.run.id, cfg.mode, Path(self.run.dir).parent)

    def log(self, step: int, values: dict[str, float]) -> None:
        if values:
            self.run.log({**values, "step": int(step)})

    def close(self, failed: bool = False) -> None:
        """Finish the run (exit code 1 when `failed`: W&B marks it failed) and stop W&B's service process: `finish`
        alone returns before the service has written the run's last records to its .wandb file (seen with wandb
        0.31.0 offline: a file read right after `finish` could lack them)."""
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        wandb.teardown()


class MlflowTracker:
    """One MLflow run for this run (module docstring)."""

    def __init__(self, cfg, run_dir: Path, run_id: str | None, config: dict):
        require_trackers(("mlflow",))
        from mlflow.tracking import MlflowClient

        reroute("mlflow")  # its INFO lines (creating the sqlite store's tables) go to the log file, not the console

        uri = cfg.tracking_uri or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        # The default store keeps its artifacts beside it (MLflow would put a sqlite store's in ./mlruns of the
        # current directory); a store the user names keeps MLflow's own artifact location.
        artifacts = None if cfg.tracking_uri else (run_dir.resolve() / ARTIFACT_DIR).as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        exp_id = (experiment.experiment_id if experiment
                  else self.client.create_experiment(cfg.experiment, artifact_location=artifacts))
        found = self.client.search_runs([exp_id], filter_string=f"tags.`{TAG}` = '{run_id}'") if run_id else []
        run = found[0] if found else self.client.create_run(exp_id, run_name=run_dir.name,
                                                              tags={TAG: run_id} if run_id else None)
        self.run_id = run.info.run_id
        if found:  # a resumed run: FINISHED when it stopped, running again
            self.client.update_run(self.run_id, status="RUNNING")
        self._log_config(config, set(run.data.params))
        log.info("MLflow run %s (experiment %r) at %s", self.run_id, cfg.experiment, uri)

    def _log_config(self, config: dict, present: set[str]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flatten(config).items() if k not in present]
        for i in range(0, len(params), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + PARAM_BATCH])
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        if values:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, int(step)) for k, v in values.items()])

    def close(self, failed: bool = False) -> None:
        """End the run: status FAILED when `failed` (the trainer raised), else FINISHED."""
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_trackers(logging_cfg, run_dir: Path, run_id: str | None, config: dict) -> list:
    """The trackers `logging_cfg.trackers` names, open, each holding `config` (rank 0 only)."""
    opened = []
    try:
        for name in logging_cfg.trackers:
            opened.append(TRACKERS[name](getattr(logging_cfg, name), Path(run_dir), run_id, config))
    except BaseException:
        for tracker in opened:
            tracker.close(failed=True)
        raise
    return opened
