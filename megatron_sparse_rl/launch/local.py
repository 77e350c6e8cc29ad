"""Local launch: torchrun (launch/torchrun.py) on one node, its store on 127.0.0.1 only.

    cmd = local_command("configs/tiny_moe_tp2ep2.yaml", nproc=4, program="megatron_sparse_rl.tools.cli train",
                        overrides=[])
    # [python, -m, megatron_sparse_rl.launch.torchrun, --nnodes=1, --node-rank=0, --master-addr=127.0.0.1,
    #  --master-port=0, --nproc-per-node=4, --shutdown-timeout=330, -m, megatron_sparse_rl.tools.cli, train,
    #  CONFIG, --set, ...]

`--master-port=0` picks a free rendezvous port, so runs of several users on one machine do not collide; the
store listens on loopback only (stock torchrun's `--standalone` would serve it on every interface). torchrun is
run with this interpreter (no PATH lookup).
"""
from __future__ import annotations

import sys

RENDEZVOUS = ("--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1", "--master-port=0")
"""One node, static rendezvous on a free loopback port (launch/torchrun.py binds it)."""
STOP_MARGIN_S = 30
"""Seconds torchrun waits for the ranks beyond trainer.stop_timeout_s (their own deadline) before it kills them."""


def local_command(config: str, *, nproc: int, program: str, overrides: list[str],
                  stop_timeout_s: float = 300.0) -> list[str]:
    """The command line of a one-machine run with `nproc` ranks; on SIGTERM torchrun gives the ranks
    `stop_timeout_s` (+ a margin) to checkpoint and exit (run/stops.py)."""
    cmd = [sys.executable, "-m", "megatron_sparse_rl.launch.torchrun", *RENDEZVOUS, f"--nproc-per-node={nproc}",
           f"--shutdown-timeout={int(stop_timeout_s) + STOP_MARGIN_S}", "-m", *program.split(), config]
    for o in overrides:
        cmd += ["--set", o]
    return cmd
