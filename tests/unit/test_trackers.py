"""W&B and MLflow trackers (`logging.trackers`) checked against the files they write: the W&B offline run's
`.wandb` log (read record by record here: LevelDB log framing, wandb's own protobuf `Record`) and MLflow's file
store (mlruns/<experiment>/<run>/metrics/<name> lines "<ms> <value> <step>", params/<key>, artifacts/config.json),
against the values a hand-written list logged. Also: unknown tracker names refused at load, a missing package's
ImportError naming the extra, rank 0 alone opening trackers, a resumed run continuing the same tracker run, a run
that raises ending its tracker runs as failed (MLflow meta.yaml status, the W&B exit record), and what each sink holds
after a resume replays the steps logged after its checkpoint.

    .venv/bin/python -m pytest -q tests/unit/test_trackers.py
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_sparse_rl import _optional
from megatron_sparse_rl.config.loader import ConfigError, from_dict
from megatron_sparse_rl.config.schema import LoggingConfig, RunConfig
from megatron_sparse_rl.observability.features import tensorboard_layout
from megatron_sparse_rl.observability.metrics import MetricsWriter, read_metrics
from megatron_sparse_rl.observability.trackers import open_trackers, require_trackers

RUN_ID = "0123456789abcdef0123456789abcdef"
CONFIG = {"trainer": {"steps": 3, "lr": 1e-3}, "algorithm": {"name": "grpo", "clip": [0.2, 0.28]}, "note": "x"}
# What a run logs: (step, metrics, phase); the numbers tracked are these under the names below.
LOGGED = [(1, {"sft/loss": 2.5, "eval/accuracy": 0.25}, "sft"),
          (1, {"rollout/reward": 0.5, "loss/clip_frac": 0.125, "stopped": True, "note": "text", "gone": None}, "rl"),
          (2, {"rollout/reward": 0.75, "loss/clip_frac": 0.0, "stopped": False}, "rl")]
TRACKED = [(1, {"sft/sft/loss": 2.5, "sft/eval/accuracy": 0.25}),
           (1, {"rollout/reward": 0.5, "loss/clip_frac": 0.125, "stopped": 1.0}),
           (2, {"rollout/reward": 0.75, "loss/clip_frac": 0.0, "stopped": 0.0})]


def _logging(tmp_path: Path, trackers: list[str], **extra) -> LoggingConfig:
    return from_dict(LoggingConfig, {"dir": str(tmp_path), "tensorboard": False, "trackers": trackers, **extra},
                     "logging")


# metrics.png's panels over the rl metrics LOGGED (bools count: "stopped" fills no panel)
PANELS = {"reward": ["Multiline", ["rollout/reward"]], "clip fraction": ["Multiline", ["loss/clip_frac"]]}


def _log_run(tmp_path: Path, cfg: LoggingConfig, logged=LOGGED, config: dict = CONFIG) -> None:
    trackers = open_trackers(cfg, tmp_path, RUN_ID, config)
    with MetricsWriter(tmp_path, tensorboard=False, trackers=trackers, layout=tensorboard_layout) as writer:
        for step, metrics, phase in logged:
            writer.log(step, metrics, phase=phase)
    written = read_metrics(tmp_path / "metrics.jsonl")[-len(logged):]  # metrics.jsonl still gets every record
    assert [(r["step"], r["phase"]) for r in written] == [(s, phase) for s, _, phase in logged]


def wandb_records(path: Path):
    """The protobuf records of a .wandb file: a 7-byte file header (":W&B", 0xBEE1, version 0), then LevelDB log
    blocks of 32 KiB whose chunks (checksum, length, type: 1 full, 2 first, 3 middle, 4 last) carry the records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, head = path.read_bytes(), 32768, 7
    assert struct.unpack("<4sHB", data[:head]) == (b":W&B", 0xBEE1, 0)
    pos, pending = head, b""
    while pos + head <= len(data):
        if block - pos % block < head:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + head])
        if length == 0 and kind == 0:
            break
        pending += data[pos + head:pos + head + length]
        pos += head + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _wandb_run(tmp_path: Path) -> tuple[dict, list[dict]]:
    """(the run's config, its history rows without W&B's own _step/_runtime/_timestamp) of the offline run(s)."""
    files = sorted((tmp_path / "wandb").glob(f"offline-run-*-{RUN_ID}/run-{RUN_ID}.wandb"))
    assert files, sorted(p.name for p in (tmp_path / "wandb").iterdir())
    config, rows = {}, []
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == RUN_ID and record.run.display_name == tmp_path.name
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                # a name with "/" is stored as its parts (nested_key), others as key
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return config, rows


def test_wandb_offline_run_holds_the_metrics_and_config(tmp_path):
    pytest.importorskip("wandb")
    _log_run(tmp_path, _logging(tmp_path, ["wandb"]))
    config, rows = _wandb_run(tmp_path)
    assert {k: config[k] for k in CONFIG} == CONFIG
    assert config["panels"] == PANELS
    assert rows == [{**values, "step": step} for step, values in TRACKED]


def _mlflow_store(tmp_path: Path, monkeypatch) -> LoggingConfig:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own switch for its file store
    return _logging(tmp_path, ["mlflow"], mlflow={"tracking_uri": (tmp_path / "mlruns").as_uri(), "experiment": "e"})


def _mlflow_run_dir(tmp_path: Path) -> Path:
    (run,) = [p.parents[1] for p in (tmp_path / "mlruns").glob("*/*/tags/msrl.run_id")]
    assert (run / "tags" / "msrl.run_id").read_text() == RUN_ID
    return run


def _mlflow_metric(run: Path, name: str) -> list[tuple[int, float]]:
    lines = (run / "metrics" / name).read_text().split("\n")
    return [(int(step), float(value)) for _, value, step in (ln.split() for ln in lines if ln)]


def test_mlflow_file_store_holds_the_metrics_and_config(tmp_path, monkeypatch):
    _log_run(tmp_path, _mlflow_store(tmp_path, monkeypatch))
    run = _mlflow_run_dir(tmp_path)
    expected: dict[str, list] = {}
    for step, values in TRACKED:
        for name, value in values.items():
            expected.setdefault(name, []).append((step, value))
    found = {p.relative_to(run / "metrics").as_posix() for p in (run / "metrics").rglob("*") if p.is_file()}
    assert found == set(expected)
    assert {name: _mlflow_metric(run, name) for name in expected} == expected
    params = {p.relative_to(run / "params").as_posix(): p.read_text() for p in (run / "params").rglob("*")
              if p.is_file()}
    assert params == {"trainer.steps": "3", "trainer.lr": "0.001", "algorithm.name": "grpo",
                      "algorithm.clip": "[0.2, 0.28]", "note": "x"}
    assert json.loads((run / "artifacts" / "config.json").read_text()) == CONFIG
    assert json.loads((run / "artifacts" / "panels.json").read_text()) == PANELS


def test_mlflow_resume_continues_the_run(tmp_path, monkeypatch):
    """A second start with the same run id logs to the same MLflow run; a param keeps its first value and a new
    key is added (MLflow refuses to change a param)."""
    cfg = _mlflow_store(tmp_path, monkeypatch)
    _log_run(tmp_path, cfg, logged=LOGGED[1:2])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.mlflow.tracking_uri)
    (reopened,) = open_trackers(cfg, tmp_path, RUN_ID, CONFIG)  # a resumed run is running again until it closes
    assert client.get_run(reopened.run_id).info.status == "RUNNING"
    reopened.close()
    _log_run(tmp_path, cfg, logged=LOGGED[2:], config={**CONFIG, "trainer": {"steps": 9, "lr": 1e-3}, "extra": 1})
    run = _mlflow_run_dir(tmp_path)  # still one run
    assert _mlflow_metric(run, "rollout/reward") == [(1, 0.5), (2, 0.75)]
    data = client.get_run(run.name).data
    assert data.params["trainer.steps"] == "3" and data.params["extra"] == "1"
    assert client.get_run(run.name).info.status == "FINISHED"


def test_unknown_tracker_refused_at_load():
    with pytest.raises(ConfigError, match=r"logging\.trackers\[1\]: 'tensorboard' is not allowed; choose one of "
                                          r"'wandb', 'mlflow'"):
        from_dict(RunConfig, {"logging": {"trackers": ["wandb", "tensorboard"]}})
    with pytest.raises(ConfigError, match="logging.trackers names mlflow more than once"):
        from_dict(RunConfig, {"logging": {"trackers": ["mlflow", "mlflow"]}})


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(_optional, "_has", lambda module: module != "sqlalchemy")
    require_trackers(("wandb",))
    with pytest.raises(ImportError, match=r"logging.trackers: mlflow needs the 'sqlalchemy' package.*"
                                          r"pip install -e \.\[trackers\]"):
        require_trackers(("wandb", "mlflow"))


@pytest.mark.parametrize("rank", [0, 1])
def test_rank0_alone_opens_trackers(tmp_path, rank):
    """open_metrics as the trainer calls it: rank 0 gets a writer with a W&B run carrying the resolved config and
    the run's id; other ranks get nothing."""
    pytest.importorskip("wandb")
    from megatron_sparse_rl.training.context import open_metrics

    run = from_dict(RunConfig, {"logging": {"dir": str(tmp_path), "tensorboard": False, "trackers": ["wandb"]}})
    ctx = SimpleNamespace(run=run, run_dir=tmp_path, is_main=rank == 0, owner=SimpleNamespace(run_id=RUN_ID),
                          writer=None)
    open_metrics(ctx, 0)
    if rank:
        assert ctx.writer is None and not (tmp_path / "wandb").exists()
        return
    ctx.writer.log(4, {"rollout/reward": 0.5, "mismatch/k1": math.inf})
    ctx.writer.close()
    config, rows = _wandb_run(tmp_path)
    assert config["logging"]["trackers"] == ["wandb"] and config["trainer"]["steps"] == run.trainer.steps
    assert rows == [{"rollout/reward": 0.5, "mismatch/k1": math.inf, "step": 4}]


def _train_that_fails(tmp_path: Path, monkeypatch, trackers: list[str], logging_extra: dict) -> None:
    """`trainer.train` whose loop logs one step to the trackers and then raises, as a crashed run does (the
    context and the loop stand in for the learner and engines; the failure path under test is train's own)."""
    from megatron_sparse_rl import trainer

    run = from_dict(RunConfig, {"logging": {"dir": str(tmp_path), "tensorboard": False, "trackers": trackers,
                                            **logging_extra}})
    ctx = SimpleNamespace(run=run, run_dir=tmp_path, is_main=True, owner=SimpleNamespace(run_id=RUN_ID), writer=None,
                          placement=SimpleNamespace(shutdown=lambda: None))

    def loop(ctx, stops):
        from megatron_sparse_rl.training.context import open_metrics

        open_metrics(ctx, 0)
        ctx.writer.log(1, {"rollout/reward": 0.5})
        raise RuntimeError("the learner crashed")

    monkeypatch.setattr(trainer, "build_context", lambda run, total_steps: ctx)
    monkeypatch.setattr(trainer, "rl_loop", loop)
    with pytest.raises(RuntimeError, match="the learner crashed"):
        trainer.train(run)


def test_a_crashed_run_ends_its_mlflow_run_failed(tmp_path, monkeypatch):
    """The MLflow file store's meta.yaml of the run holds status 4 (MLflow's RunStatus FAILED; 3 is FINISHED, 1
    RUNNING, as a crash left it before) and the step logged before the crash."""
    import yaml

    cfg = _mlflow_store(tmp_path, monkeypatch)
    _train_that_fails(tmp_path, monkeypatch, ["mlflow"], {"mlflow": {"tracking_uri": cfg.mlflow.tracking_uri,
                                                                     "experiment": "e"}})
    run = _mlflow_run_dir(tmp_path)
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    assert meta["status"] == 4 and meta["end_time"] is not None
    assert _mlflow_metric(run, "rollout/reward") == [(1, 0.5)]


def test_a_crashed_run_ends_its_wandb_run_with_exit_code_1(tmp_path, monkeypatch):
    """The offline run's .wandb file ends with an exit record of exit code 1 (0 when a run finishes)."""
    pytest.importorskip("wandb")
    _train_that_fails(tmp_path, monkeypatch, ["wandb"], {})
    (path,) = (tmp_path / "wandb").glob(f"offline-run-*-{RUN_ID}/run-{RUN_ID}.wandb")
    exits = [r.exit.exit_code for r in wandb_records(path) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]
    assert _wandb_run(tmp_path)[1] == [{"rollout/reward": 0.5, "step": 1}]


def _rows_per_start(tmp_path: Path) -> list[list[tuple[int, float]]]:
    """(step, r) of each W&B offline directory's history, in the order of the directories' start times."""
    rows = []
    for path in sorted((tmp_path / "wandb").glob(f"offline-run-*-{RUN_ID}/run-{RUN_ID}.wandb")):
        items = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                 for r in wandb_records(path) if r.WhichOneof("record_type") == "history"]
        rows.append([(row["step"], row["r"]) for row in items])
    return rows


def test_a_resume_logs_the_replayed_steps_again(tmp_path, monkeypatch):
    """docs/data.md, "What a resumed run writes": steps 1-4 logged, a checkpoint after step 2 (it records the
    writer's record count), the run raises; the resume from that checkpoint logs steps 3-5 with new values.
    metrics.jsonl and TensorBoard's reader hold each step once; W&B offline has a second directory; MLflow's one
    run holds both values of steps 3 and 4."""
    import time

    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = _mlflow_store(tmp_path, monkeypatch).mlflow.tracking_uri
    cfg = _logging(tmp_path, ["wandb", "mlflow"], mlflow={"tracking_uri": uri, "experiment": "e"})
    first = MetricsWriter(tmp_path, keep_records=0, trackers=open_trackers(cfg, tmp_path, RUN_ID, CONFIG))
    for step in range(1, 5):
        first.log(step, {"r": float(step)})
        if step == 2:
            saved = first.records  # what the checkpoint after step 2 records (training/state.py save_run)
    first.close(failed=True)
    time.sleep(1.0)  # W&B names an offline directory by the start's second
    second = MetricsWriter(tmp_path, keep_records=saved, trackers=open_trackers(cfg, tmp_path, RUN_ID, CONFIG))
    for step in range(3, 6):
        second.log(step, {"r": 10.0 + step})
    second.close()
    resumed = [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert [(r["step"], r["r"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == resumed
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("r")] == resumed
    assert _rows_per_start(tmp_path) == [[(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)], [(3, 13.0), (4, 14.0), (5, 15.0)]]
    assert _mlflow_metric(_mlflow_run_dir(tmp_path), "r") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (3, 13.0),
                                                              (4, 14.0), (5, 15.0)]
