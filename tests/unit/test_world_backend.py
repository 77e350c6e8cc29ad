"""`parallel.backend` decides the backend of the torch.distributed world `msrl train` starts (init_world ->
parallel/world.py), not CUDA availability alone; a backend this machine cannot run fails before anything starts.

    .venv/bin/python -m pytest -q tests/unit/test_world_backend.py
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_sparse_rl.config import ConfigError, load_config
from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.parallel import ParallelLayout, world
from megatron_sparse_rl.training.context import init_world

WORLD_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
IS_INITIALIZED = dist.is_initialized  # the real one (`started` replaces it while a test runs)


@pytest.fixture
def no_world(monkeypatch):
    """No process group and no rendezvous variables; the test's own world is torn down after it."""
    assert not dist.is_initialized()
    for name in WORLD_ENV:  # set, then deleted: the undo also removes what join_world sets
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    yield
    if IS_INITIALIZED():
        dist.destroy_process_group()


@pytest.fixture
def started(monkeypatch):
    """Record the backend init_process_group is asked for instead of starting a world."""
    seen = []

    def fake_init(backend, **kwargs):
        seen.append(backend)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda: 0)
        monkeypatch.setattr(dist, "get_world_size", lambda: 1)

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    return seen


@pytest.mark.parametrize("cuda, backend, expected", [
    (True, "gloo", "gloo"),  # named: kept even with CUDA (before: nccl whenever CUDA was there)
    (True, "auto", "nccl"),
    (False, "auto", "gloo"),
    (True, "nccl", "nccl"),
])
def test_the_configured_backend_is_the_one_started(no_world, started, monkeypatch, cuda, backend, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    devices = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    assert init_world(ParallelConfig(backend=backend)) == (0, 1)
    assert started == [expected]
    assert devices == ([0] if expected == "nccl" else [])  # nccl: this rank's GPU (LOCAL_RANK) is selected first


def test_nccl_without_cuda_fails_before_anything_starts(no_world, started, monkeypatch):
    import os

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"parallel\.backend = 'nccl' needs CUDA, which this machine does not "
                                          r"have; use 'auto' or 'gloo'"):
        init_world(ParallelConfig(backend="nccl"))
    assert started == [] and not any(name in os.environ for name in WORLD_ENV)  # nothing started or set


def test_the_backend_comes_from_the_run_config(no_world, started, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = tmp_path / "run.yaml"
    path.write_text("parallel: {backend: gloo}\n")
    init_world(load_config(path).parallel)
    assert started == ["gloo"]


def test_a_world_of_one_really_starts_on_gloo(no_world):
    assert init_world(ParallelConfig(backend="gloo")) == (0, 1)
    assert dist.get_backend() == "gloo"


def test_a_world_started_on_another_backend_is_named(no_world):
    init_world(ParallelConfig(backend="gloo"))
    with pytest.raises(ConfigError, match=r"parallel\.backend = 'nccl', but torch\.distributed was already "
                                          r"initialised with 'gloo'"):
        world.join_world(ParallelConfig(backend="nccl"))
    assert world.join_world(ParallelConfig(backend="auto")) == (0, 1)  # auto takes the world it finds


def test_layout_resolves_auto_with_the_same_rule():
    assert ParallelLayout.from_config(ParallelConfig(backend="auto"), 1, cuda=True).backend == "nccl"
    assert ParallelLayout.from_config(ParallelConfig(backend="auto"), 1, cuda=False).backend == "gloo"
    assert ParallelLayout.from_config(ParallelConfig(backend="gloo"), 1, cuda=True).backend == "gloo"


def test_layout_initialize_refuses_nccl_without_cuda(no_world, started, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    layout = ParallelLayout.from_config(ParallelConfig(backend="nccl"), 1)
    with pytest.raises(ConfigError, match=r"parallel\.backend = 'nccl' needs CUDA"):
        layout.initialize()
    assert started == []
