"""A stand-in job for launcher tests: what `msrl train` would do at start-up, and nothing expensive.

    python -m megatron_sparse_rl.launch.probe CONFIG [--set a.b=v ...] [--hold SECONDS]
    (as a launch program: --set launch.program=megatron_sparse_rl.launch.probe)

Every rank loads and validates the config for the world it finds (RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT from torchrun or the sbatch script), joins a gloo world through that rendezvous as the trainer
does (parallel/world.py) and all-gathers (rank, host). Rank 0 then writes `<logging.dir>/metrics.jsonl` (temp
file, then rename), like the trainer. With `--hold S` the ranks wait up to S seconds for $MSRL_PREEMPT_FILE (the
sbatch script's preemption request), record a `preempted` line and exit 0, as the trainer does after its
checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_sparse_rl.launch.probe")
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[])
    parser.add_argument("--hold", type=float, default=0.0)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.validation import validate
    from megatron_sparse_rl.config.schema import ParallelConfig
    from megatron_sparse_rl.parallel.world import join_world

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run = load_config(args.config, args.overrides)
    validate(run, world)
    join_world(ParallelConfig(backend="gloo"))  # as the trainer joins: its store listens on MASTER_ADDR only
    seen = [None] * world
    dist.all_gather_object(seen, {"rank": rank, "host": socket.gethostname(),
                                  "local_rank": int(os.environ.get("LOCAL_RANK", 0))})
    records = [{"step": 0, "world_size": world, "ranks": seen,
                "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0))}]
    if args.hold:
        flag, deadline = os.environ.get("MSRL_PREEMPT_FILE", ""), time.monotonic() + args.hold
        while not (flag and Path(flag).exists()) and time.monotonic() < deadline:
            time.sleep(0.2)
        records.append({"event": "preempted" if flag and Path(flag).exists() else "hold_timeout"})
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        out = Path(run.logging.dir) / "metrics.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.replace(out)
        print(f"probe: wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
