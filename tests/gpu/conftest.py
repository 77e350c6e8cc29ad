"""tests/gpu set-up: the `device` fixture, the `figure` fixture, the results file and a per-test time limit.

- `device` ("cuda" | "cpu", module scope): tests/gpu/devices.py `DEVICES` says when each variant runs.
- `figure(name, value, unit="")`: record a named number the test measured (a max |logprob difference|, a step
  time); it goes into the test's report (pytest's user properties) and from there into the results file.
- Results file: with MSRL_GPU_SUMMARY_DIR set (scripts/gpu_check.sh sets it to $OUT), every test phase rewrites
  `gpu_summary.json` and `gpu_summary.md` there (tests/gpu/summary.py), with the run's environment.
- Per-test limit: pytest-timeout's `--timeout` where that plugin is installed; without it, MSRL_GPU_TEST_TIMEOUT
  seconds arm a SIGALRM around each test (setup, call and teardown), which fails it. Tests keep their GPU work in
  spawned ranks (devices.py `run_on`), which the failing test's rank spawner then kills.
"""
from __future__ import annotations

import os
import platform
import signal
from importlib import metadata

import pytest

from tests.gpu.devices import DEVICES
from tests.gpu.summary import Summary

SUMMARY_DIR = "MSRL_GPU_SUMMARY_DIR"
TEST_TIMEOUT = "MSRL_GPU_TEST_TIMEOUT"
_SUMMARY = pytest.StashKey[Summary]()


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def figure(record_property):
    """`figure(name, value, unit="")`: record a number this test measured (see the module docstring)."""
    def record(name: str, value, unit: str = "") -> None:
        record_property(name, {"value": float(value), "unit": unit})
    return record


def _version(dist: str) -> str:
    try:
        found = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return "absent"
    return f"{found.version} ({found.locate_file('')})"


def _environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
           "megatron-core": _version("megatron-core"), "transformers": _version("transformers"),
           "pytest-timeout": _version("pytest-timeout")}
    if torch.cuda.is_available():
        env["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        env["gpu"] = "none (cpu variants only)"
    if os.environ.get("MSRL_GPU_COMMIT"):
        env["commit"] = os.environ["MSRL_GPU_COMMIT"]
    return env


def pytest_sessionstart(session):
    out = os.environ.get(SUMMARY_DIR)
    if out:
        session.config.stash[_SUMMARY] = Summary(out, _environment())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    summary = item.config.stash.get(_SUMMARY, None)
    if summary is not None:
        summary.add(outcome.get_result())


def pytest_sessionfinish(session, exitstatus):
    summary = session.config.stash.get(_SUMMARY, None)
    if summary is not None:
        summary.finish(exitstatus)


def _on_alarm(signum, frame):
    pytest.fail(f"over the per-test limit of {os.environ.get(TEST_TIMEOUT)} s ({TEST_TIMEOUT})", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = int(os.environ.get(TEST_TIMEOUT, "0") or 0)
    armed = seconds > 0 and not item.config.pluginmanager.hasplugin("timeout")
    if armed:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(seconds)
    try:
        yield
    finally:
        if armed:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
