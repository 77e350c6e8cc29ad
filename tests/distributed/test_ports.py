"""Where the sockets of multi-process worlds listen, read from the kernel (psutil, tests/sockets.py): every one on
loopback.

- `run_ranks` (the spawned test worlds, `msrl convert` without a launcher through checkpoint/launch.py
  `run_local`): the parent's store and each rank's, after a disaggregated split (parallel/bridge.py's store) and
  a `Bridge` over all ranks; the bridge still carries an object.
- `msrl launch local --nproc 2` of launch/probe.py (torchrun's agent and two ranks joining a gloo world as the
  trainer does), sampled every 0.2 s while it runs. The trainer itself under the same launcher: tests/e2e/test_ports.py.
- the SLURM script's srun mode on one machine (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the launcher, no
  agent): rank 0 serves the store on MASTER_ADDR only. Under a real SLURM: tests/e2e/test_slurm.py.

    .venv/bin/python -m pytest -q tests/distributed/test_ports.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sparse_rl.parallel.ports import free_port
from tests.msrl import MSRL
from tests.sockets import listeners, off_loopback, sample_listeners
from tests.spawn import run_distributed

pytestmark = [pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]


def split_and_list_worker(rank, world_size):
    """Split 1 learner + 2 rollout ranks, bridge them, and list this rank's listeners and its parent's."""
    from megatron_sparse_rl.parallel.bridge import SplitWorld

    split = SplitWorld.split(1, "gloo")
    bridge = split.bridge(list(range(world_size)))
    got = bridge.broadcast_object({"from": rank}, src=0)
    bridge.barrier()
    mine = listeners(os.getpid(), tree=False)
    parent = listeners(os.getppid(), tree=False) if rank == 0 else set()
    return {"got": got, "mine": sorted(mine), "parent": sorted(parent)}


def test_spawned_worlds_and_the_split_listen_on_loopback_only():
    outs = run_distributed(split_and_list_worker, world_size=3, timeout=120)
    assert [o["got"] for o in outs] == [{"from": 0}] * 3
    seen = {tuple(s) for o in outs for s in o["mine"] + o["parent"]}
    assert outs[0]["parent"], "run_ranks' own store should be listening while the ranks run"
    assert all(o["mine"] for o in outs)  # each rank's gloo pair listeners (rank 0: the split's store too)
    assert not off_loopback(seen), off_loopback(seen)


def list_to_file_worker(out_dir):
    """Under `run_local`: record this rank's listeners and its parent's (the `msrl convert` process)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    dist.barrier()
    seen = listeners(os.getpid(), tree=False) | listeners(os.getppid(), tree=False)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(sorted(seen)))
    dist.barrier()


def test_convert_without_a_launcher_listens_on_loopback_only(tmp_path):
    from megatron_sparse_rl.checkpoint.launch import run_local

    assert run_local(list_to_file_worker, world_size=2, args=(str(tmp_path),), timeout=120) == []
    seen = {tuple(s) for r in (0, 1) for s in json.loads((tmp_path / f"rank{r}.json").read_text())}
    assert seen and not off_loopback(seen), off_loopback(seen)


def test_launch_local_listens_on_loopback_only(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"model": {"path": str(tmp_path / "m")}, "logging": {"dir": str(tmp_path / "run")}}))
    cmd = [*MSRL, "launch", "local", str(cfg), "--nproc", "2",
           "--set", "launch.program=megatron_sparse_rl.launch.probe --hold 2"]
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = sample_listeners(proc, timeout=120)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["world_size"] == 2  # the two ranks met through the store
    assert len({pid for pid, _, _ in seen}) >= 3, seen  # the agent and both ranks were sampled while listening
    assert not off_loopback(seen), off_loopback(seen)


def test_srun_mode_rank0_serves_the_store_on_master_addr_only(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"model": {"path": str(tmp_path / "m")}, "logging": {"dir": str(tmp_path / "run")}}))
    base = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    probe = [sys.executable, "-m", "megatron_sparse_rl.launch.probe", str(cfg), "--hold", "2"]
    procs = [subprocess.Popen(probe, cwd=REPO, env={**base, **world, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    seen = sample_listeners(procs[0], timeout=120)
    procs[1].wait(timeout=60)
    assert [p.returncode for p in procs] == [0, 0], [p.stdout.read()[-2000:] for p in procs]
    assert ("127.0.0.1", int(world["MASTER_PORT"])) in {(ip, port) for _, ip, port in seen}  # rank 0's store
    assert not off_loopback(seen), off_loopback(seen)
