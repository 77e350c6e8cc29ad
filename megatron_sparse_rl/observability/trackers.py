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

At the close, each tracker gets metrics.png's panels over those names (`panels(layout)`, the layout TensorBoard's
custom scalars get: observability/features.py `tensorboard_layout`, {panel title: ["Multiline", [metric names]]}):
W&B as the run config's `panels` entry, MLflow as the artifact `panels.json`.

Each tracker's `close(failed)` ends its run: FINISHED (W&B exit code 0) when the trainer finished or stopped on
request, FAILED (W&B exit code 1) when it raised (trainer.py).

Steps replayed after a resume (those logged after the checkpoint it resumes from) are logged again: the first W&B
offline directory keeps the old rows and the new one holds the new; the MLflow run holds both values at each such
step; metrics.jsonl drops the old ones and TensorBoard's reader hides them (observability/metrics.py;
docs/data.md, "What a resumed run writes").

Before anything starts, `check_trackers` (training/preflight.py runs it in `msrl validate` and on rank 0 of `msrl
train`) says why a tracker could not open, writing nothing and contacting nothing but an MLflow tracking server:
its packages missing or failing to import, an MLflow file store MLflow refuses (MLFLOW_ALLOW_FILE_STORE), a
tracking server that refuses or does not answer within `logging.mlflow.check_timeout_s` (3 tries), W&B online
without credentials (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE or a netrc entry for its host, looked up by W&B's
own functions, no network call). `mlflow_store_dir` is the directory a local MLflow store the user names writes
into (preflight checks it can be made). Written for wandb 0.31 and mlflow 3.18 (the internals used are named where
used).
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit

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


SERVER_TRIES = 3
"""Tries of the start-up check of an MLflow tracking server, within logging.mlflow.check_timeout_s in all."""
SERVER_PAUSE_S = 1.0
"""Pause between two tries (cut short by the check's deadline)."""


def require_trackers(names: tuple[str, ...]) -> None:
    """Raise an ImportError naming the tracker, its missing package and the pip extra, before anything starts."""
    for name in names:
        for module in PACKAGES[name]:
            require(module, f"logging.trackers: {name}", HINT)


def check_trackers(logging_cfg) -> list[str]:
    """Why each tracker `logging_cfg.trackers` names could not open (module docstring), each problem naming its
    setting; [] when all can. Writes nothing."""
    problems = []
    for name in logging_cfg.trackers:
        broken = _import_problem(name)
        problems += [broken] if broken else CHECKS[name](getattr(logging_cfg, name))
    return problems


def _import_problem(name: str) -> str | None:
    """A package of tracker `name` missing, or failing to import (a broken install: a missing dependency or
    shared library would otherwise surface when the tracker opens, after the engines and learners started)."""
    for module in PACKAGES[name]:
        try:
            require(module, f"logging.trackers: {name}", HINT)
        except ImportError as e:
            return str(e)
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - an install can be broken in any way; the message says which
            return (f"logging.trackers: {name}: 'import {module}' fails ({type(e).__name__}: {e}), so its install "
                    f"is broken; reinstall it ({HINT}) or remove {name} from logging.trackers")
    return None


def mlflow_store_dir(cfg) -> Path | None:
    """The directory a local MLflow store named by `cfg.tracking_uri` writes into: a sqlite database's folder, a file
    store's root. None for the default store (in logging.dir, checked with it), a server or another database."""
    uri = cfg.tracking_uri
    if uri is None:
        return None
    if uri.startswith("sqlite://"):
        path = uri[len("sqlite://"):].split("?")[0]
        path = path[1:] if path.startswith("/") else path  # sqlite:///rel.db, sqlite:////abs/x.db
        return Path(path).parent if path and path != ":memory:" else None
    scheme = urlsplit(uri).scheme
    if scheme == "file":
        return Path(unquote(urlsplit(uri).path))
    return Path(uri) if scheme == "" else None


def _mlflow_problems(cfg) -> list[str]:
    uri = cfg.tracking_uri
    if uri is None:
        return []
    scheme = urlsplit(uri).scheme
    if scheme in ("http", "https"):
        return _server_problems(cfg)
    if scheme in ("", "file"):
        return _file_store_problems(uri)
    return []


def _file_store_problems(uri: str) -> list[str]:
    """MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE is true (mlflow FileStore.__init__); asked of
    MLflow's own variable (none in an MLflow without that rule), so that nothing is made to find out."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:
        return []
    try:
        allowed = MLFLOW_ALLOW_FILE_STORE.get()
    except ValueError as e:  # MLflow refuses a value other than true/false/1/0
        allowed, why = False, f" (MLFLOW_ALLOW_FILE_STORE: {e})"
    else:
        why = ""
    if allowed:
        return []
    return [f"logging.mlflow.tracking_uri {uri!r} is a file store, which MLflow refuses unless "
            f"MLFLOW_ALLOW_FILE_STORE=true{why}: set that (MLflow's own switch for this store), or use a database "
            "store such as sqlite:///path/mlflow.db (null: <logging.dir>/mlflow.db)"]


def _server_problems(cfg) -> list[str]:
    """Ask the tracking server for the experiment (MLflow's REST call, its credentials from the MLFLOW_TRACKING_*
    variables) up to SERVER_TRIES times within cfg.check_timeout_s; MLflow's client alone would retry for minutes
    (7 retries, 120 s each: a refused server stopped a run after 4 min 47 s, after the engines had started)."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    uri, budget = cfg.tracking_uri, cfg.check_timeout_s
    where = f"logging.mlflow.tracking_uri {uri!r}"
    creds, deadline, why = get_default_host_creds(uri), time.monotonic() + budget, "no try started"
    for attempt in range(SERVER_TRIES):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            response = http_request(creds, "/api/2.0/mlflow/experiments/get-by-name", "GET", max_retries=0,
                                    backoff_factor=0, backoff_jitter=0, timeout=min(budget / SERVER_TRIES, left),
                                    raise_on_status=False, params={"experiment_name": cfg.experiment})
        except MlflowException as e:
            why = _reason(str(e))
        else:
            if response.status_code == 200 or _error_code(response) == "RESOURCE_DOES_NOT_EXIST":
                return []
            if response.status_code in (401, 403):
                return [f"{where}: the tracking server refused this client's credentials (HTTP "
                        f"{response.status_code}): set MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
                        "MLFLOW_TRACKING_PASSWORD, to an account it accepts"]
            why = f"it answered HTTP {response.status_code}, not as an MLflow tracking server"
        if attempt + 1 < SERVER_TRIES:
            time.sleep(max(0.0, min(SERVER_PAUSE_S, deadline - time.monotonic())))
    return [f"{where}: no MLflow tracking server answered within logging.mlflow.check_timeout_s = {budget:g} s "
            f"({SERVER_TRIES} tries; last: {why}). Start the server or correct the URI, or leave "
            "logging.mlflow.tracking_uri null for a store in logging.dir"]


def _reason(text: str) -> str:
    """The cause in MLflow's 'API request to ... failed with exception ...' text: 'Connection refused', 'Read timed
    out', ..., else the text itself (shortened)."""
    if "timed out" in text.lower():
        return "no answer (timed out)"
    found = re.search(r"\[Errno -?\d+\] ([^\"')(]+)", text)
    return found[1].strip() if found else text[:300]


def _error_code(response) -> str | None:
    try:
        return response.json().get("error_code")
    except ValueError:
        return None


def _wandb_problems(cfg) -> list[str]:
    """W&B online needs credentials, found without a network call where `wandb.init` looks for them: WANDB_API_KEY
    or WANDB_IDENTITY_TOKEN_FILE, the settings' api_key, a netrc entry for the settings' base URL (wandb 0.31's
    sdk/lib/wbauth/authenticate.py `_use_system_auth`; its settings singleton starts no service process)."""
    if cfg.mode != "online":
        return []
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import read_netrc_auth

    settings = wandb_setup.singleton().settings
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or settings.api_key:
        return []
    if read_netrc_auth(host=settings.base_url):
        return []
    netrc = os.environ.get("NETRC") or "~/.netrc"
    return [f"logging.wandb.mode is 'online' but no W&B credentials were found for {settings.base_url}: no "
            f"WANDB_API_KEY (or WANDB_IDENTITY_TOKEN_FILE) and no entry for its host in {netrc}. Run `wandb login` "
            "or set WANDB_API_KEY; or set logging.wandb.mode=offline (`wandb sync` uploads the run later)"]


CHECKS = {"wandb": _wandb_problems, "mlflow": _mlflow_problems}


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

    def panels(self, layout: dict) -> None:
        """metrics.png's panels (observability/features.py tensorboard_layout: {"msrl": {title: ["Multiline", [metric
        names]]}}) as the run config's `panels` entry."""
        self.run.config.update({"panels": layout["msrl"]}, allow_val_change=True)

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

    def panels(self, layout: dict) -> None:
        """metrics.png's panels (observability/features.py tensorboard_layout) as the artifact `panels.json`."""
        self.client.log_dict(self.run_id, layout["msrl"], "panels.json")

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
