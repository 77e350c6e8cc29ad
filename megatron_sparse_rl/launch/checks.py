"""Checks of a launch against the rest of the run, before anything is rendered or submitted.

    check_launch(run, launch, slurm=True)   # ConfigError listing every problem, naming the fields

Pure arithmetic on the config (no torch): the GPUs of the learner nodes must tile the parallel layout,
the rollout nodes must tile the rollout engine's tensor parallel size, one rank per GPU, and SLURM
launches need a partition. Model-dependent checks stay in `validation.validate`.
"""
from __future__ import annotations

from megatron_sparse_rl.config.launch import LaunchConfig
from megatron_sparse_rl.config.loader import ConfigError


def layout_problems(run, launch: LaunchConfig) -> list[str]:
    """Problems of the learner/rollout split against `run.parallel` and `run.rollout`."""
    p = run.parallel
    problems = []
    learner_world = launch.learner_world_size
    where = (f"learner ranks = (launch.nodes {launch.nodes} - launch.rollout_nodes {launch.rollout_nodes}) * "
             f"launch.nproc_per_node {launch.nproc_per_node} = {learner_world}")
    if launch.rollout_ranks:
        where = (f"learner ranks = launch.nproc_per_node {launch.nproc_per_node} - launch.rollout_ranks "
                 f"{launch.rollout_ranks} = {learner_world}")
    mp = p.tp * p.pp * p.cp
    if learner_world % mp:
        names, values, knobs = ("parallel.tp * parallel.pp", f"{p.tp} * {p.pp}", "tp/pp") if p.cp == 1 else \
            ("parallel.tp * parallel.pp * parallel.cp", f"{p.tp} * {p.pp} * {p.cp}", "tp/pp/cp")
        problems.append(f"{where} is not divisible by {names} = {values} = {mp}; "
                        f"use a multiple of {mp} learner GPUs or change {knobs}")
    elif (learner_world // p.pp) % (p.ep * p.etp):
        problems.append(f"{where} gives {learner_world // p.pp} ranks per pipeline stage, not divisible by "
                        f"parallel.ep * parallel.etp = {p.ep} * {p.etp}")
    if p.tp > launch.nproc_per_node:
        problems.append(f"parallel.tp = {p.tp} exceeds launch.nproc_per_node = {launch.nproc_per_node}: tensor "
                        "parallel groups must stay inside a node (their all-reduces run every layer)")
    rtp = run.rollout.tensor_parallel_size
    if launch.rollout_world_size % rtp:
        problems.append(f"rollout ranks = {launch.rollout_world_size} (launch.rollout_nodes * "
                        f"launch.nproc_per_node, or launch.rollout_ranks) is not divisible by "
                        f"rollout.tensor_parallel_size = {rtp}")
    return problems


def slurm_problems(launch: LaunchConfig) -> list[str]:
    s = launch.slurm
    problems = []
    if not s.partition:
        problems.append("launch.slurm.partition is empty: set it to the partition to submit to "
                        "(`sinfo -s` lists them), e.g. --set launch.slurm.partition=gpu")
    gpus = launch.gpus_per_node
    if gpus and gpus != launch.nproc_per_node:
        problems.append(f"launch.slurm.gpus_per_node = {gpus} must equal launch.nproc_per_node = "
                        f"{launch.nproc_per_node} (one rank per GPU), or be 0 to request no GPUs")
    if s.container_mounts and not s.container_image:
        problems.append("launch.slurm.container_mounts is set but launch.slurm.container_image is empty")
    return problems


def check_launch(run, launch: LaunchConfig, *, slurm: bool) -> None:
    """Raise ConfigError listing every launch problem (SLURM-specific ones when `slurm`)."""
    problems = layout_problems(run, launch) + (slurm_problems(launch) if slurm else [])
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} launch problems:\n" + "\n".join(f"  - {p}" for p in problems))
