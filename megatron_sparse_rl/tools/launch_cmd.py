"""`msrl launch local|slurm CONFIG`: start a run on this machine (torchrun) or on SLURM (sbatch).

    msrl launch local configs/tiny_moe_tp2ep2.yaml [--nproc 4] [--set a.b=v ...] [--dry-run]
    msrl launch slurm configs/big.yaml --set launch.slurm.partition=gpu --dry-run     # print the script
    msrl launch slurm configs/big.yaml [--wait]       # write <log_dir>/<job>.sbatch and sbatch it

The config is checked first (layout against the learner/rollout GPUs, partition, one rank per GPU, and
`msrl validate`'s checks, which see the learner ranks of a disaggregated run); every problem exits 2
naming the field. `--set launch.rollout_ranks=R` makes a local run disaggregated (the last R ranks run
engines). docs/launch.md describes the rendered script.

A local launch stops like `msrl train`: SIGTERM or Ctrl-C reaches every rank once (launch/supervise.py), the run
checkpoints at the next step boundary and the launch exits 75 (stopped, resumable); a second signal ends it at once.
"""
from __future__ import annotations

import argparse
import shlex
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    for name, text in (("local", "run on this machine with torchrun"), ("slurm", "render and submit an sbatch script")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("config", help="run config YAML")
        p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="A.B=V",
                       help="override a field, value parsed as YAML (repeatable); forwarded to the job")
        p.add_argument("--dry-run", action="store_true",
                       help="print the script (slurm) or the command (local) and start nothing")
        if name == "local":
            p.add_argument("--nproc", type=int, default=None, metavar="N",
                           help="processes on this machine (default: launch.nproc_per_node)")
        else:
            p.add_argument("--wait", action="store_true",
                           help="wait for the job to end (sbatch --wait) and exit with its exit code")


def _local(args) -> int:
    from megatron_sparse_rl.launch.checks import check_launch
    from megatron_sparse_rl.launch.load import job_overrides, load_run
    from megatron_sparse_rl.launch.local import local_command
    from megatron_sparse_rl.config import ConfigError
    from megatron_sparse_rl.validation import validate

    overrides = list(args.overrides)
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1 (got {args.nproc})")
        overrides += [f"launch.nproc_per_node={args.nproc}", "launch.nodes=1"]
    run, launch = load_run(args.config, overrides)
    if launch.nodes != 1:
        raise ConfigError(f"msrl launch local runs one node, but launch.nodes = {launch.nodes}; "
                          "use msrl launch slurm, or pass --nproc N")
    check_launch(run, launch, slurm=False)
    validate(run, launch.world_size)
    cmd = local_command(args.config, nproc=launch.nproc_per_node, program=launch.program,
                        overrides=job_overrides(overrides), stop_timeout_s=run.trainer.stop_timeout_s)
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    if args.dry_run:
        return 0
    from pathlib import Path

    from megatron_sparse_rl.launch.supervise import supervise

    return supervise(cmd, run_dir=Path(run.logging.dir))


def _slurm(args) -> int:
    from megatron_sparse_rl.launch.checks import check_launch
    from megatron_sparse_rl.launch.load import job_overrides, load_run
    from megatron_sparse_rl.launch.slurm import render_sbatch, resolve_paths, submit, write_script
    from megatron_sparse_rl.validation import validate

    run, launch = load_run(args.config, args.overrides)
    check_launch(run, launch, slurm=True)
    validate(run, launch.world_size, cuda=launch.gpus_per_node > 0)  # learner degrees vs the learner ranks
    script = render_sbatch(run, launch, args.config, job_overrides(args.overrides))
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    path = write_script(script, resolve_paths(run, launch)["log_dir"], launch.slurm.job_name)
    print(f"wrote {path}", flush=True)
    try:
        job_id, rc = submit(path, wait=args.wait)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return rc


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.config import ConfigError

    try:
        return _local(args) if args.target == "local" else _slurm(args)
    except ValueError as e:  # a bad value outside the loader (e.g. --nproc)
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None

