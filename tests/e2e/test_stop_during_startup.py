"""SIGTERM to the process group of `msrl train` while vLLM's engine starts (what torchrun's stop and a terminal's
Ctrl-C do) ends the run cleanly before its first step: exit 75, no traceback, no checkpoint. The signal is sent
while vLLM's model-registry inspection child runs (found among the trainer's children), the moment that used to kill
the child and fail the engine start with tracebacks, exit 1 (patches/vllm_registry_session.py). Real Megatron-Core
and vLLM, tiny MoE; about a minute on two CPU cores.

    .venv/bin/python -m pytest -q tests/e2e/test_stop_during_startup.py
"""
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from tests.msrl import MSRL

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
REGISTRY_CHILD = "vllm.model_executor.models.registry"


def _registry_child(pid: int):
    """The trainer's vLLM model-registry inspection child, if it runs now."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if REGISTRY_CHILD in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.timeout(600)
def test_sigterm_to_the_process_group_during_engine_start_up_stops_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*MSRL, "train", str(REPO / "configs/tiny_moe.yaml"), "--set", f"logging.dir={run_dir}",
                             f"model.path={tmp_path / 'model'}", "trainer.steps=1", "logging.tensorboard=false"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # a cold vLLM cache of its own: the registry child runs
                            env={**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache")})
    try:
        deadline, child = time.monotonic() + 400, None
        while child is None and proc.poll() is None and time.monotonic() < deadline:
            child = _registry_child(proc.pid)
            time.sleep(0.05)
        assert child is not None, "vLLM's registry child never ran"
        os.killpg(proc.pid, signal.SIGTERM)  # the trainer and its children, as torchrun and Ctrl-C signal them
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 75, err[-4000:]
    assert "Traceback" not in out + err and "Error raised in subprocess" not in err
    assert "SIGTERM received: finishing start-up, then exiting before the first step" in err
    assert ("stopped (SIGTERM received) at RL step 0, SFT step 0; no new checkpoint (stopped before the first step)"
            in err)
    checkpoints = run_dir / "checkpoints"
    assert not checkpoints.exists() or sorted(p.name for p in checkpoints.iterdir()) == []
