"""Local launch: `torchrun --standalone --nproc-per-node N -m <launch.program> CONFIG --set ...`.

    cmd = local_command("configs/tiny_moe_tp2ep2.yaml", nproc=4, program="tools.cli train", overrides=[])
    rc = subprocess.call(cmd)

`--standalone` lets torchrun pick a free rendezvous port, so runs of several users on one machine do not
collide. torchrun is run as `python -m torch.distributed.run` with this interpreter (no PATH lookup).
"""
from __future__ import annotations

import sys


def local_command(config: str, *, nproc: int, program: str, overrides: list[str]) -> list[str]:
    """The command line of a one-machine run with `nproc` ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", *program.split(), config]
    for o in overrides:
        cmd += ["--set", o]
    return cmd
