"""The trackers' start-up checks (observability/trackers.py `check_trackers`, training/preflight.py
`tracker_problems`): a missing or broken install, a tracking server that refuses or does not answer (within
logging.mlflow.check_timeout_s), a store path that cannot be made, a file store MLflow refuses and W&B online
without credentials are each named with their setting, before anything starts and with nothing written; `msrl
validate` and `msrl train` print them as one `error:` line (exit 2) before the run directory or the model exist.
The servers are local sockets and a local HTTP server; W&B is never contacted (connecting is refused by the test).

    .venv/bin/python -m pytest -q tests/unit/test_tracker_checks.py
"""
from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_sparse_rl import _optional
from megatron_sparse_rl.config.loader import from_dict
from megatron_sparse_rl.config.schema import LoggingConfig
from megatron_sparse_rl.training.preflight import tracker_problems
from tests.msrl import MSRL
from tests.snapshot import snapshot

ROOT = Path(__file__).resolve().parents[2]
HINT = "Install the trackers extra: pip install -e .[trackers] (wandb, mlflow-skinny, sqlalchemy, alembic)."


def _logging(tmp_path: Path, trackers: list[str], **extra) -> LoggingConfig:
    return from_dict(LoggingConfig, {"dir": str(tmp_path / "run"), "trackers": trackers, **extra}, "logging")


def _mlflow(tmp_path: Path, uri: str, **extra) -> LoggingConfig:
    pytest.importorskip("mlflow")
    return _logging(tmp_path, ["mlflow"], mlflow={"tracking_uri": uri, **extra})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_missing_package_is_named_with_its_setting(tmp_path, monkeypatch):
    monkeypatch.setattr(_optional, "_has", lambda module: module != "alembic")
    before = snapshot(tmp_path)
    assert tracker_problems(_logging(tmp_path, ["mlflow"])) == [
        f"logging.trackers: mlflow needs the 'alembic' package, which is not installed. {HINT}"]
    assert snapshot(tmp_path) == before


def test_a_broken_install_is_named_with_its_setting(tmp_path, monkeypatch):
    """A wandb that is found but fails to import (here a package whose import raises as a missing shared library
    does): find_spec alone passed it, and the run failed only when the tracker opened, after start-up."""
    fake = tmp_path / "site" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libwandb_core.so: cannot open shared object file')\n")
    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    _optional._has.cache_clear()
    try:
        before = snapshot(tmp_path)
        assert tracker_problems(_logging(tmp_path, ["wandb"])) == [
            "logging.trackers: wandb: 'import wandb' fails (ImportError: libwandb_core.so: cannot open shared object "
            f"file), so its install is broken; reinstall it ({HINT}) or remove wandb from logging.trackers"]
        assert snapshot(tmp_path) == before
    finally:
        _optional._has.cache_clear()


def test_a_server_that_refuses_is_named_within_its_bound(tmp_path):
    uri = f"http://127.0.0.1:{_free_port()}"
    cfg = _mlflow(tmp_path, uri, check_timeout_s=4)
    before, start = snapshot(tmp_path), time.monotonic()
    problems = tracker_problems(cfg)
    assert time.monotonic() - start < 4 + 1
    assert problems == [
        f"logging.mlflow.tracking_uri {uri!r}: no MLflow tracking server answered within "
        "logging.mlflow.check_timeout_s = 4 s (3 tries; last: Connection refused). Start the server or correct the "
        "URI, or leave logging.mlflow.tracking_uri null for a store in logging.dir"]
    assert snapshot(tmp_path) == before


def test_a_server_that_does_not_answer_is_named_within_its_bound(tmp_path):
    """A server that accepts connections and never answers: the check ends within check_timeout_s (MLflow's client
    alone would wait 120 s a try, 7 retries)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes the connections; nothing ever reads or answers
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        problems = tracker_problems(_mlflow(tmp_path, uri, check_timeout_s=3))
        took = time.monotonic() - start
    assert 2 < took < 3 + 1, took
    assert problems == [
        f"logging.mlflow.tracking_uri {uri!r}: no MLflow tracking server answered within "
        "logging.mlflow.check_timeout_s = 3 s (3 tries; last: no answer (timed out)). Start the server or correct "
        "the URI, or leave logging.mlflow.tracking_uri null for a store in logging.dir"]


class _Server(http.server.BaseHTTPRequestHandler):
    """Answers every request with the status and JSON body of the server's `reply`, recording the paths asked."""

    def do_GET(self):
        status, body = self.server.reply
        self.server.asked.append(self.path)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("reply, expected", [
    ((404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no experiment"}), []),
    ((200, {"experiment": {"experiment_id": "1", "name": "e"}}), []),
    ((401, {"error_code": "UNAUTHENTICATED"}), ["the tracking server refused this client's credentials (HTTP 401): "
                                                "set MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
                                                "MLFLOW_TRACKING_PASSWORD, to an account it accepts"]),
])
def test_a_server_that_answers_passes_and_one_that_refuses_credentials_is_named(tmp_path, reply, expected):
    server = http.server.HTTPServer(("127.0.0.1", 0), _Server)
    server.reply, server.asked = reply, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        problems = tracker_problems(_mlflow(tmp_path, uri, experiment="e"))
    finally:
        server.shutdown()
        server.server_close()
    assert problems == [f"logging.mlflow.tracking_uri {uri!r}: {p}" for p in expected]
    assert server.asked == ["/api/2.0/mlflow/experiments/get-by-name?experiment_name=e"]


@pytest.mark.parametrize("scheme", ["sqlite", "file"])
def test_a_store_path_that_cannot_be_made_is_named(tmp_path, monkeypatch, scheme):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (tmp_path / "a_file").write_text("not a directory\n")
    store = tmp_path / "a_file" / "sub"
    uri = f"sqlite:///{store / 'mlflow.db'}" if scheme == "sqlite" else store.as_uri()
    before = snapshot(tmp_path)
    assert tracker_problems(_mlflow(tmp_path, uri)) == [
        f"logging.mlflow.tracking_uri {uri!r}: its directory {str(store)!r} cannot be created: "
        f"{str(tmp_path / 'a_file')!r} is not a writable directory"]
    assert snapshot(tmp_path) == before
    assert tracker_problems(_mlflow(tmp_path, uri.replace("a_file", "new"))) == []  # creatable: no problem
    assert snapshot(tmp_path) == before


def test_a_file_store_mlflow_refuses_is_named(tmp_path, monkeypatch):
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    before = snapshot(tmp_path)
    assert tracker_problems(_mlflow(tmp_path, uri)) == [
        f"logging.mlflow.tracking_uri {uri!r} is a file store, which MLflow refuses unless "
        "MLFLOW_ALLOW_FILE_STORE=true: set that (MLflow's own switch for this store), or use a database store such as "
        "sqlite:///path/mlflow.db "
        "(null: <logging.dir>/mlflow.db)"]
    assert snapshot(tmp_path) == before
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert tracker_problems(_mlflow(tmp_path, uri)) == []


def test_wandb_online_without_credentials_is_named_without_the_network(tmp_path, monkeypatch):
    """No WANDB_API_KEY and no netrc entry for the W&B host: named, with no connection attempted; a netrc entry for
    the host, or WANDB_API_KEY, passes."""
    wandb = pytest.importorskip("wandb")

    def no_network(self, address):
        raise AssertionError(f"the check connected to {address}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine other.example.com login user password " + "x" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    wandb.teardown()  # W&B's settings are read once per process: read them again with this environment
    cfg = _logging(tmp_path, ["wandb"], wandb={"mode": "online"})
    before = snapshot(tmp_path)
    try:
        assert tracker_problems(cfg) == [
            "logging.wandb.mode is 'online' but no W&B credentials were found for https://wandb.example.com: no "
            f"WANDB_API_KEY (or WANDB_IDENTITY_TOKEN_FILE) and no entry for its host in {netrc}. Run `wandb login` "
            "or set WANDB_API_KEY; or set logging.wandb.mode=offline (`wandb sync` uploads the run later)"]
        assert snapshot(tmp_path) == before
        assert tracker_problems(_logging(tmp_path, ["wandb"])) == []  # offline needs nothing
        netrc.write_text("machine wandb.example.com login user password " + "k" * 40 + "\n")
        assert tracker_problems(cfg) == []
        netrc.write_text("")
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        assert tracker_problems(cfg) == []
    finally:
        wandb.teardown()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", ["validate", "train"])
def test_validate_and_train_refuse_an_unreachable_server_before_anything_starts(tmp_path, command):
    """One `error:` line naming logging.mlflow.tracking_uri, exit 2, no traceback, within the bound (the process's
    own start-up aside), and no run directory or tiny model made: Megatron and vLLM never started."""
    pytest.importorskip("mlflow")
    uri = f"http://127.0.0.1:{_free_port()}"
    before = snapshot(tmp_path)
    done = subprocess.run([*MSRL, command, str(ROOT / "configs" / "tiny_moe.yaml"), "--set",
                           f"model.path={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}",
                           "logging.trackers=[mlflow]", f"logging.mlflow.tracking_uri={uri}",
                           "logging.mlflow.check_timeout_s=2"], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-4000:]
    assert "Traceback" not in done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: logging.mlflow.tracking_uri {uri!r}: no MLflow tracking server answered within "
                      "logging.mlflow.check_timeout_s = 2 s (3 tries; last: Connection refused). Start the server or "
                      "correct the URI, or leave logging.mlflow.tracking_uri null for a store in logging.dir"]
    assert snapshot(tmp_path) == before
