"""The device a tests/gpu test runs on, and its one-rank world there.

Every test in tests/gpu takes the `device` fixture (tests/gpu/conftest.py), parametrised by `DEVICES`:
- "cuda": marked `gpu`, so tests/conftest.py skips it without CUDA; the rank joins an NCCL world through
  `join_world` (parallel/world.py), which selects the GPU of its local rank;
- "cpu": the same test on a gloo world with the CPU shims (patches/megatron_cpu.py), to show that the test
  itself is right on a machine without a GPU. Run only by hand (`make test` time does not grow):
      MSRL_GPU_TESTS_ON_CPU=1 .venv/bin/python -m pytest -q tests/gpu
  Skipped where CUDA is present: Megatron then builds every model on the GPU and the CPU shims are not applied.

All GPU work happens in spawned ranks (`run_on`), never in the pytest process, so a per-test timeout can stop a
hung kernel by killing its rank.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.spawn import run_distributed

ON_CPU_SWITCH = "MSRL_GPU_TESTS_ON_CPU"
"""Environment variable: "1" runs the cpu variant of every tests/gpu test (by hand, on a machine without CUDA)."""

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
"""parallel.backend of a rank on each device."""

RANK_TIMEOUT_S = 600
"""A rank's own limit; the per-test timeout (pytest-timeout or the conftest alarm) is shorter and kills it first."""


def _cpu_skip_reason() -> str | None:
    if os.environ.get(ON_CPU_SWITCH) != "1":
        return f"the cpu variant of a GPU test runs only with {ON_CPU_SWITCH}=1"
    if torch.cuda.is_available():
        return "CUDA is present: Megatron builds on the GPU there, so the cpu variant cannot run"
    return None


DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cpu", marks=pytest.mark.skipif(_cpu_skip_reason() is not None, reason=str(_cpu_skip_reason())),
                 id="cpu"),
]
"""The `device` fixture's parameters."""


def run_on(device: str, fn, args: tuple = (), backend: str | None = None):
    """`fn(0, 1, *args)` on one spawned rank of a world on `device` (`backend`: parallel.backend, default the
    device's); its return value."""
    return run_distributed(fn, 1, args=args, timeout=RANK_TIMEOUT_S, backend=backend or BACKENDS[device])[0]


def model_device(model) -> str:
    """The device type every parameter of `model` lives on; raises if they are spread over several."""
    kinds = {p.device.type for p in model.parameters()}
    if len(kinds) != 1:
        raise AssertionError(f"parameters on several devices: {sorted(kinds)}")
    return kinds.pop()
