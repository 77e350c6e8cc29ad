"""The project's own way into a torch.distributed world, on one device (the cuda variants passed on
an H100 on 2026-11-27: docs/gpu.md):

- a world of one, as `msrl train` and `msrl convert` join it without a launcher: a fresh interpreter with no
  launcher environment calls `join_world(ParallelConfig(backend="auto"))`, which must pick NCCL with CUDA (gloo
  without), serve its store on 127.0.0.1, select the GPU of local rank 0, and carry an all-reduce of a tensor on
  that GPU and `on_rank0`'s object broadcast (which NCCL runs on the current device);
- a rank spawned the way tests, benchmarks and `msrl convert` spawn them (parallel/spawn.py, torchrun's
  environment with the launcher's store) with backend "auto": the same backend and device.

    .venv/bin/python -m pytest -q tests/gpu/test_cuda_world.py
    MSRL_GPU_TESTS_ON_CPU=1 .venv/bin/python -m pytest -q tests/gpu/test_cuda_world.py   # the cpu variant
"""
import json
import os
import subprocess
import sys
import time

import torch

from tests.gpu.devices import BACKENDS, RANK_TIMEOUT_S, run_on

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_USE_AGENT_STORE")


def _probe_world() -> dict:
    """What this process's (already joined) world looks like, and a collective on its device."""
    import torch.distributed as dist

    from megatron_sparse_rl.parallel.world import on_rank0

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    x = torch.arange(1.0, 5.0, device=device)
    dist.all_reduce(x)
    return {"backend": dist.get_backend(), "rank": dist.get_rank(), "world": dist.get_world_size(),
            "device": device.type, "current_device": torch.cuda.current_device() if cuda else None,
            "local_rank": os.environ.get("LOCAL_RANK"), "master_addr": os.environ.get("MASTER_ADDR"),
            "all_reduce": x.cpu().tolist(), "on_rank0": on_rank0(lambda: "from rank 0"),
            "gpu": torch.cuda.get_device_name(device) if cuda else None}


def world_of_one() -> dict:
    """Run in a fresh interpreter: join a world of one the way `msrl train` does, then probe it."""
    import torch.distributed as dist

    from megatron_sparse_rl.config.schema import ParallelConfig
    from megatron_sparse_rl.parallel.world import join_world

    t0 = time.perf_counter()
    rank, world = join_world(ParallelConfig(backend="auto"))
    out = {"joined": [rank, world], "join_s": time.perf_counter() - t0, **_probe_world()}
    dist.destroy_process_group()
    return out


def _check(got: dict, device: str) -> None:
    assert got["backend"] == BACKENDS[device], got
    assert (got["rank"], got["world"]) == (0, 1)
    assert got["device"] == device
    assert got["all_reduce"] == [1.0, 2.0, 3.0, 4.0]  # a world of one: the sum over ranks is the tensor itself
    assert got["on_rank0"] == "from rank 0"
    if device == "cuda":
        assert got["current_device"] == int(got["local_rank"]) == 0


def test_world_of_one_without_a_launcher(device, request, figure):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    code = ("import json; from tests.gpu.test_cuda_world import world_of_one; "
            "print('RESULT', json.dumps(world_of_one()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=request.config.rootpath, env=env, capture_output=True,
                          text=True, timeout=RANK_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    figure("join_world_s", got["join_s"], "s")
    assert got["joined"] == [0, 1]
    assert got["master_addr"] == "127.0.0.1"
    _check(got, device)


def spawned_rank(rank, world):
    return _probe_world()


def test_spawned_rank_with_backend_auto(device):
    _check(run_on(device, spawned_rank, backend="auto"), device)
