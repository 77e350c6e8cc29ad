"""Render an sbatch script from a run config, and submit it.

    script = render_sbatch(run, launch, "configs/big.yaml", ["learner.seed=3"])
    job_id, rc = submit(write_script(script, launch_log_dir), wait=True)

The script: one `#SBATCH` header from `launch.slurm`; rendezvous on the first node of the allocation (its
hostname from `scontrol show hostnames`, or its address on `launch.slurm.interface`; a free port picked there
unless `rdzv_port` is set), whose store listens on that address only; `srun` of torchrun (launch/torchrun.py:
one task per node, static rendezvous with node rank = SLURM_NODEID, so ranks follow node order and the
learner/rollout split by rank range is deterministic) or of the ranks directly (one task per rank, RANK =
SLURM_PROCID with block distribution). With `requeue`, SLURM sends USR1 to the batch shell
`signal_seconds` before the end (or on `scancel --signal=USR1 --batch`); the trap touches
$MSRL_PREEMPT_FILE, which the trainer polls at step boundaries: it saves a checkpoint and exits, then
the script runs `scontrol requeue` and the next run resumes from that checkpoint.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_sparse_rl.config.launch import LaunchConfig

FREE_PORT = ("\"$PYTHON\" -c 'import socket; s = socket.socket(); s.bind((\"\", 0)); "
             "print(s.getsockname()[1])'")
# the IPv4 address of the interface named by $1 on this node (SIOCGIFADDR; stdlib only), nothing if it has none
IFACE_ADDR = ("\"$PYTHON\" -c 'import fcntl, socket, struct, sys; "
              "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
              "print(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, "
              "struct.pack(\"256s\", sys.argv[1].encode()))[20:24]))'")


def resolve_paths(run, launch: LaunchConfig, workdir: str | None = None) -> dict[str, str]:
    """Absolute workdir, log dir and python of the job (relative paths are taken from the workdir)."""
    s = launch.slurm
    wd = Path(s.workdir or workdir or os.getcwd()).resolve()
    log_dir = Path(launch.log_dir) if launch.log_dir else Path(run.logging.dir) / "slurm"
    log_dir = log_dir if log_dir.is_absolute() else wd / log_dir
    return {"workdir": str(wd), "log_dir": str(log_dir), "python": job_python(launch, wd)[0]}


def job_python(launch: LaunchConfig, workdir: Path) -> tuple[str, str]:
    """(interpreter the ranks run, where that choice comes from); never a bare `python` from the nodes' PATH
    unless the config asks for it (docs: LaunchConfig.python)."""
    s = launch.slurm
    if launch.python:
        named = Path(launch.python)
        path = named if named.is_absolute() or "/" not in launch.python else workdir / named
        return str(path), "launch.python"
    if s.venv:
        return str(workdir / s.venv / "bin" / "python"), "launch.slurm.venv"
    if s.container_image:
        return "python", "the container image's own python (launch.slurm.container_image)"
    return sys.executable, "the interpreter that rendered this script"


def _header(launch: LaunchConfig, log_dir: str) -> list[str]:
    s = launch.slurm
    tasks = launch.nproc_per_node if s.mode == "srun" else 1
    opts = [f"--job-name={s.job_name}", f"--partition={s.partition}"]
    opts += [f"--account={s.account}"] if s.account else []
    opts += [f"--qos={s.qos}"] if s.qos else []
    opts += [f"--time={s.time}", f"--nodes={launch.nodes}", f"--ntasks-per-node={tasks}"]
    opts += [f"--gpus-per-node={launch.gpus_per_node}"] if launch.gpus_per_node else []
    opts += [f"--cpus-per-task={s.cpus_per_task}"] if s.cpus_per_task else []
    opts += ["--exclusive"] if s.exclusive else []
    opts += [f"--output={log_dir}/%x-%j.out", "--open-mode=append"]
    opts += ["--requeue", f"--signal=B:USR1@{s.signal_seconds}"] if s.requeue else ["--no-requeue"]
    opts += list(s.extra_sbatch)
    return [f"#SBATCH {o}" for o in opts]


def _srun(launch: LaunchConfig, workdir: str) -> str:
    """The srun line; `"$PYTHON" "${PROGRAM[@]}"` become $0 and "$@" of the per-task bash."""
    s, n, p = launch.slurm, launch.nodes, launch.nproc_per_node
    args = ["srun", "--kill-on-bad-exit=1", "--label", f"--nodes={n}", "--distribution=block"]
    if s.container_image:
        args += [f"--container-image={s.container_image}", f"--container-workdir={workdir}"]
        args += [f"--container-mounts={','.join(s.container_mounts)}"] if s.container_mounts else []
    args += list(s.extra_srun)
    if s.mode == "torchrun":
        args.append("--ntasks-per-node=1")
        task = ('exec "$0" -m megatron_sparse_rl.launch.torchrun --nnodes="$SLURM_NNODES" '
                f'--nproc-per-node={p} --node-rank="$SLURM_NODEID" '
                '--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" -m "$@"')
    else:
        args.append(f"--ntasks-per-node={p}")
        task = ('export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID" WORLD_SIZE="$SLURM_NTASKS" '
                f'LOCAL_WORLD_SIZE={p}; exec "$0" -m "$@"')
    return " ".join(shlex.quote(a) for a in args) + f" \\\n  bash -c {shlex.quote(task)} " \
        '"$PYTHON" "${PROGRAM[@]}" &'


def _master_addr(interface: str) -> list[str]:
    """Lines setting MASTER_ADDR, where node 0's rendezvous store listens (launch/torchrun.py, srun mode's rank 0)
    and the other nodes connect: the first node's hostname, or its address on `launch.slurm.interface` (the batch
    script runs on the first node), which gloo and NCCL then use too unless `launch.slurm.env` names theirs."""
    if not interface:
        return ['MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)']
    q = shlex.quote(interface)
    return [f"MASTER_ADDR=$({IFACE_ADDR} {q} 2>/dev/null)  # launch.slurm.interface",
            f'[ -n "$MASTER_ADDR" ] || {{ echo "msrl: launch.slurm.interface = {interface}: no IPv4 address on '
            f'$(hostname)" >&2; exit 2; }}',
            f'export GLOO_SOCKET_IFNAME="${{GLOO_SOCKET_IFNAME:-{interface}}}" '
            f'NCCL_SOCKET_IFNAME="${{NCCL_SOCKET_IFNAME:-{interface}}}"']


def _layout_comment(launch: LaunchConfig) -> str:
    n, p, r = launch.nodes, launch.nproc_per_node, launch.rollout_nodes
    learn = launch.learner_nodes
    if launch.rollout_ranks:  # one node: the last ranks serve engines
        learners = launch.learner_world_size
        return (f"# layout: 1 node x {p} ranks; learner ranks 0-{learners - 1}, rollout ranks {learners}-{p - 1} (disaggregated)")
    if not r:
        return f"# layout: {n} node(s) x {p} rank(s) = {n * p} ranks, colocated (every rank a learner with an engine)"
    return (f"# layout: {n} nodes x {p} ranks = {n * p} ranks; learner nodes 0-{learn - 1} (ranks 0-{learn * p - 1}), "
            f"rollout nodes {learn}-{n - 1} (ranks {learn * p}-{n * p - 1})")


def render_sbatch(run, launch: LaunchConfig, config_path: str | Path, overrides: list[str],
                  *, workdir: str | None = None) -> str:
    """The sbatch script (text) that runs `python -m <launch.program> CONFIG --set ...` on every rank."""
    s = launch.slurm
    paths = resolve_paths(run, launch, workdir)
    config = str(Path(config_path).resolve())
    program = launch.program.split() + [config] + [a for o in overrides for a in ("--set", o)]
    lines = ["#!/bin/bash",
             f"# Rendered by `msrl launch slurm {shlex.quote(str(config_path))}`"
             + (f" with --set {' '.join(shlex.quote(o) for o in overrides)}" if overrides else "")
             + "; re-render instead of editing.",
             _layout_comment(launch), *_header(launch, paths["log_dir"]),
             "set -uo pipefail", "", f"cd {shlex.quote(paths['workdir'])}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in s.env.items()]
    lines += list(s.setup)
    port = str(s.rdzv_port) if s.rdzv_port else f"$({FREE_PORT})"
    lines += [
        f"PYTHON={shlex.quote(paths['python'])}  # {job_python(launch, Path(paths['workdir']))[1]}",
        *_master_addr(s.interface),
        f"MASTER_PORT={port}",
        f"MSRL_PREEMPT_FILE={shlex.quote(paths['log_dir'])}/preempt-$SLURM_JOB_ID",
        "export MASTER_ADDR MASTER_PORT MSRL_PREEMPT_FILE",
        'rm -f "$MSRL_PREEMPT_FILE"',
        'echo "msrl: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, '
        'rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "PROGRAM=(" + " ".join(shlex.quote(a) for a in program) + ")",
        "", "PREEMPTED=0",
    ]
    if s.requeue:
        lines += [
            "msrl_preempt() {  # USR1: preemption notice or the time limit is near",
            "  PREEMPTED=1",
            '  echo "msrl: USR1 received: asking the ranks to checkpoint and stop ($MSRL_PREEMPT_FILE)"',
            '  touch "$MSRL_PREEMPT_FILE"',
            "}",
            "trap msrl_preempt USR1",
        ]
    lines += [
        _srun(launch, paths["workdir"]),
        "SRUN_PID=$!",
        "while true; do  # a trapped signal interrupts `wait`: keep waiting until srun itself ends",
        '  wait "$SRUN_PID"; RC=$?',
        '  kill -0 "$SRUN_PID" 2>/dev/null || break',
        "done",
        'if [ "$PREEMPTED" = 1 ]; then',
        '  echo "msrl: ranks stopped (exit $RC); requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'echo "msrl: ranks finished with exit code $RC"',
        'exit "$RC"',
    ]
    return "\n".join(lines) + "\n"


def write_script(text: str, log_dir: str | Path, job_name: str) -> Path:
    """Write the script to <log_dir>/<job_name>.sbatch (temp file, then rename); creates log_dir, which
    SLURM needs to exist before it opens the job's output file."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{job_name}.sbatch"
    tmp = path.with_suffix(".sbatch.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o755)
    tmp.replace(path)
    return path


def submit(script: Path, *, wait: bool = False, env: dict | None = None) -> tuple[str, int]:
    """`sbatch --parsable [--wait] script`: (job id, exit code). Without `wait` the code is sbatch's own;
    with it, the job's (sbatch --wait returns the job's exit code)."""
    cmd = ["sbatch", "--parsable"] + (["--wait"] if wait else []) + [str(script)]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    except FileNotFoundError:
        raise RuntimeError("sbatch is not on PATH: run `msrl launch slurm` on a SLURM login node "
                           "(or use --dry-run to print the script)") from None
    first = proc.stdout.readline().strip()
    job_id = first.split(";")[0]
    if job_id:
        print(f"submitted job {job_id}" + (" (waiting for it to finish)" if wait else ""), flush=True)
    _, err = proc.communicate()
    if proc.returncode and not job_id:
        raise RuntimeError(f"sbatch failed ({proc.returncode}): {err.strip()}")
    if err.strip():
        print(err.strip(), flush=True)
    return job_id, proc.returncode
