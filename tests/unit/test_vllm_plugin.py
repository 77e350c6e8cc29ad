"""The `msrl_sparse_kv` vLLM general plugin acts only for an engine of ours: without the request in the environment
it leaves vLLM's classes as they were and never raises (not even when the version check would fail); requested,
it installs the sparse-KV runner hooks, and a version mismatch is loud.
Run: .venv/bin/python -m pytest -q tests/unit/test_vllm_plugin.py
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sparse_rl.kv import vllm_plugin

REPO = Path(__file__).resolve().parents[2]
HOOKED = ("_update_states", "_prepare_inputs", "execute_model")


@pytest.fixture
def runner_cls():
    """vLLM's GPUModelRunner with our hooks removed before and after the test."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from megatron_sparse_rl.kv import vllm_hooks

    vllm_hooks.revert()
    yield GPUModelRunner
    vllm_hooks.revert()


def _methods(cls) -> dict:
    return {name: cls.__dict__[name] for name in HOOKED}


def test_the_entry_point_in_setup_py_is_the_plugin():
    text = (REPO / "setup.py").read_text()
    target = re.search(r'"msrl_sparse_kv = ([\w.]+):(\w+)"', text)
    assert target is not None, "setup.py has no msrl_sparse_kv entry point"
    assert getattr(importlib.import_module(target.group(1)), target.group(2)) is vllm_plugin.plugin


@pytest.mark.parametrize("value", [None, "0", "", "yes"])
def test_without_the_request_nothing_changes_even_on_a_foreign_vllm_version(runner_cls, monkeypatch, value):
    import vllm

    if value is None:
        monkeypatch.delenv(vllm_plugin.REQUEST_ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_plugin.REQUEST_ENV, value)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")  # the version check would raise if it ran
    before = _methods(runner_cls)
    assert vllm_plugin.plugin() is None
    assert _methods(runner_cls) == before
    assert not any(hasattr(fn, "_msrl_sparse_kv_patched") for fn in _methods(runner_cls).values())


def test_without_the_request_loading_the_plugin_imports_nothing():
    """A foreign vLLM process that loads and calls the entry point imports neither vLLM (from us) nor the patch."""
    code = ("import sys; from megatron_sparse_rl.kv import vllm_plugin; vllm_plugin.plugin(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or 'patches' in m))")
    env = {k: v for k, v in os.environ.items() if k != vllm_plugin.REQUEST_ENV}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_requested_it_installs_the_hooks(runner_cls, monkeypatch):
    monkeypatch.setenv(vllm_plugin.REQUEST_ENV, "1")
    originals = _methods(runner_cls)
    vllm_plugin.plugin()
    vllm_plugin.plugin()  # idempotent: vLLM may load plugins more than once
    hooked = _methods(runner_cls)
    assert all(getattr(hooked[n], "_msrl_sparse_kv_patched", False) for n in HOOKED)
    assert all(hooked[n]._msrl_original is originals[n] for n in HOOKED)


def test_requested_on_a_wrong_vllm_version_it_is_loud_and_patches_nothing(runner_cls, monkeypatch):
    import vllm

    monkeypatch.setenv(vllm_plugin.REQUEST_ENV, "1")
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    before = _methods(runner_cls)
    with pytest.raises(RuntimeError, match=r"written for vllm 0\.32\.0 \(found 0\.99\.0\)"):
        vllm_plugin.plugin()
    assert _methods(runner_cls) == before


def test_a_sparse_kv_engine_requests_the_plugin_for_its_processes(runner_cls, monkeypatch):
    from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig
    from megatron_sparse_rl.kv.engine_extension import SparseKV

    monkeypatch.setenv(vllm_plugin.REQUEST_ENV, "0")  # restored (removed) after the test
    cfg = RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1,
                        kv=KVConfig(policy="streamingllm", budget=24, interval=16, window=8, block_size=32))
    args = SparseKV().engine_args(cfg)
    assert os.environ[vllm_plugin.REQUEST_ENV] == "1" and vllm_plugin.requested()
    assert "msrl_sparse_kv" in args["additional_config"]
