"""How a run is started: `LaunchConfig` (process layout, learner/rollout node split) and its `SlurmConfig`.

`msrl launch local` reads `nproc_per_node`; `msrl launch slurm` renders an sbatch script from all of it
(see launch/slurm.py and docs/launch.md). Each field checks itself here; checks against the parallel
layout and the rollout engine live in `launch/checks.py` (they span components).

    launch:
      nodes: 4
      nproc_per_node: 8
      rollout_nodes: 1                # learner nodes 0-2, rollout node 3
      slurm: {partition: gpu, account: proj, time: "2-00:00:00", venv: /shared/msrl/.venv}

    launch: {nproc_per_node: 2, rollout_ranks: 1}   # one machine: learner rank 0, rollout rank 1
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from megatron_sparse_rl.config.checks import MAX_RANKS
from megatron_sparse_rl.config.checks import check as _check

# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IFNAME = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,15}$")  # Linux: IFNAMSIZ - 1 bytes, no '/', ':' or space
MAX_PER_NODE = 1024
"""The most ranks, GPUs or CPUs per node (launch.nproc_per_node, launch.slurm.gpus_per_node, cpus_per_task)."""
MAX_SIGNAL_SECONDS = 65535
"""The longest warning sbatch's `--signal=B:USR1@N` takes (sbatch: N in [0, 65535])."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SlurmConfig:
    """What `msrl launch slurm` writes into the sbatch script."""

    partition: str = ""
    """SLURM partition to submit to (required for `msrl launch slurm`; `sinfo -s` lists them)."""
    account: str = ""
    """SLURM account charged for the job ('' = the user's default account)."""
    qos: str = ""
    """Quality of service ('' = the partition's default)."""
    time: str = "04:00:00"
    """Wall-clock limit in sbatch's format: MM, HH:MM:SS, D-HH:MM:SS."""
    job_name: str = "msrl"
    """Job name (also the prefix of the log files)."""
    gpus_per_node: int | None = None
    """GPUs requested per node (None = launch.nproc_per_node, one rank per GPU; 0 = request no GPUs)."""
    cpus_per_task: int = 0
    """CPUs per SLURM task (0 = leave it to the partition's default)."""
    exclusive: bool = True
    """Ask for whole nodes (`--exclusive`)."""
    mode: Literal["torchrun", "srun"] = "torchrun"
    """torchrun: one task per node runs torchrun (static rendezvous, node rank = SLURM_NODEID);
    srun: one task per rank, RANK/LOCAL_RANK/WORLD_SIZE set from SLURM_PROCID/LOCALID/NTASKS."""
    rdzv_port: int = 0
    """Rendezvous port on the first node (0 = pick a free port there when the job starts)."""
    interface: str = ""
    """Network interface (e.g. 'ib0') the job's sockets listen on and the nodes talk over: the rendezvous store
    listens on the first node's address on it only (MASTER_ADDR), and gloo and NCCL use it (GLOO_SOCKET_IFNAME,
    NCCL_SOCKET_IFNAME, unless `env` sets them). '' = the first node's hostname and the address it resolves to
    there; gloo and NCCL then pick their own."""
    venv: str = ""
    """Python virtual environment on the nodes, whose bin/python the ranks run ('' = see `launch.python`)."""
    container_image: str = ""
    """Container image run by srun through pyxis/enroot (`--container-image`; '' = no container)."""
    container_mounts: tuple[str, ...] = ()
    """pyxis `--container-mounts` entries (SRC:DST)."""
    workdir: str = ""
    """Directory the ranks start in; must hold the code ('' = where `msrl launch` runs)."""
    requeue: bool = True
    """On preemption or near the time limit: ask the ranks to checkpoint, then `scontrol requeue`."""
    signal_seconds: int = 120
    """How long before the end SLURM sends USR1 to the batch shell (`--signal=B:USR1@N`); must exceed the
    time one step plus one checkpoint takes."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables exported in the job (NCCL settings, cache paths, ...)."""
    setup: tuple[str, ...] = ()
    """Shell lines run in the batch script before the ranks start (e.g. `module load cuda/12.8`)."""
    extra_sbatch: tuple[str, ...] = ()
    """Extra sbatch options, one per entry, written as `#SBATCH <entry>` (e.g. `--constraint=h100`)."""
    extra_srun: tuple[str, ...] = ()
    """Extra srun options added to the rank launch (e.g. `--mpi=pmix`)."""

    def __post_init__(self):
        _check(bool(_TIME.match(self.time)),
               f"launch.slurm.time must look like MM, HH:MM:SS or D-HH:MM:SS (got {self.time!r})")
        _check(bool(re.match(r"^[A-Za-z0-9_.-]+$", self.job_name)),
               f"launch.slurm.job_name may hold letters, digits, '_', '.', '-' only (got {self.job_name!r})")
        _check(self.gpus_per_node is None or 0 <= self.gpus_per_node <= MAX_PER_NODE,
               f"launch.slurm.gpus_per_node must be null or in [0, {MAX_PER_NODE}] (got {self.gpus_per_node})")
        _check(0 <= self.cpus_per_task <= MAX_PER_NODE,
               f"launch.slurm.cpus_per_task must be in [0, {MAX_PER_NODE}] (got {self.cpus_per_task})")
        _check(self.rdzv_port == 0 or 1024 <= self.rdzv_port <= 65535,
               f"launch.slurm.rdzv_port must be 0 (pick a free one) or in [1024, 65535] (got {self.rdzv_port})")
        _check(self.interface == "" or bool(_IFNAME.match(self.interface)),
               f"launch.slurm.interface must be a network interface name (up to 15 letters, digits, '_', '.', '-'; "
               f"`ip link` lists them) or '' (got {self.interface!r})")
        _check(10 <= self.signal_seconds <= MAX_SIGNAL_SECONDS,
               f"launch.slurm.signal_seconds must be in [10, {MAX_SIGNAL_SECONDS}] (got {self.signal_seconds})")
        for opt in self.extra_sbatch + self.extra_srun:
            _check(opt.startswith("-") and "\n" not in opt,
                   f"launch.slurm.extra_sbatch/extra_srun entries must be single options starting with '-' (got {opt!r})")
        for line in self.setup:
            _check("\n" not in line, f"launch.slurm.setup entries must be single lines (got {line!r})")
        for name in self.env:
            _check(bool(_ENV_NAME.match(name)), f"launch.slurm.env: {name!r} is not a valid variable name")


@dataclass(kw_only=True, frozen=True, slots=True)
class LaunchConfig:
    """How the job is started (local torchrun or SLURM) and which nodes are learners or rollout engines."""

    nproc_per_node: int = 1
    """Processes per node (GPUs per node on a cluster)."""
    nodes: int = 1
    """Number of nodes."""
    rollout_nodes: int = 0
    """Nodes given to rollout engines only (disaggregated); 0 = colocated, every rank is a learner with an
    engine. Learner ranks are [0, (nodes - rollout_nodes) * nproc_per_node), rollout ranks the rest."""
    rollout_ranks: int = 0
    """Ranks given to rollout engines only on a ONE-node run (`msrl launch local`, a bare torchrun):
    learner ranks [0, nproc_per_node - rollout_ranks), rollout ranks the rest. 0 = colocated. Multi-node
    jobs give whole nodes with `rollout_nodes` instead (set one of the two)."""
    program: str = "megatron_sparse_rl.tools.cli train"
    """Python module (and leading arguments) every rank runs as `python -m <program> CONFIG --set ...`."""
    python: str = ""
    """Interpreter the ranks of a SLURM job run (an absolute path, a path relative to the job's workdir, or a
    command name looked up on the nodes' PATH). '' = the venv of `launch.slurm.venv` if set; else, with a
    `launch.slurm.container_image`, the image's `python`; else the interpreter that renders the script
    (`msrl launch slurm`'s own). `msrl launch local` always runs its own interpreter."""
    log_dir: str = ""
    """Where the sbatch script and the job's logs go ('' = <logging.dir>/slurm)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """SLURM settings used by `msrl launch slurm`."""

    def __post_init__(self):
        _check(1 <= self.nproc_per_node <= MAX_PER_NODE,
               f"launch.nproc_per_node must be in [1, {MAX_PER_NODE}] (got {self.nproc_per_node})")
        _check(1 <= self.nodes <= MAX_RANKS, f"launch.nodes must be in [1, {MAX_RANKS}] (got {self.nodes})")
        _check(0 <= self.rollout_nodes < self.nodes,
               f"launch.rollout_nodes must be in [0, launch.nodes - 1 = {self.nodes - 1}] so that at least one "
               f"node holds learners (got {self.rollout_nodes})")
        _check(bool(self.program.split()), "launch.program must name a python module (got '')")
        _check(self.python == self.python.strip() and "\n" not in self.python,
               f"launch.python must be a path or a command name, without surrounding spaces (got {self.python!r})")
        _check(not (self.python and self.slurm.venv),
               f"set one of launch.python ({self.python!r}) and launch.slurm.venv ({self.slurm.venv!r}): both name "
               "the interpreter the job runs")
        _check(self.rollout_ranks >= 0, f"launch.rollout_ranks must be >= 0 (got {self.rollout_ranks})")
        if self.rollout_ranks:
            _check(self.nodes == 1,
                   f"launch.rollout_ranks is for one-node runs (launch.nodes = {self.nodes}); on several nodes give "
                   "the rollout engines whole nodes with launch.rollout_nodes")
            _check(self.rollout_ranks < self.nproc_per_node,
                   f"launch.rollout_ranks must be in [0, launch.nproc_per_node - 1 = {self.nproc_per_node - 1}] so "
                   f"that at least one rank is a learner (got {self.rollout_ranks})")

    @property
    def learner_nodes(self) -> int:
        """Nodes holding learner ranks (all of them when colocated)."""
        return self.nodes - self.rollout_nodes

    @property
    def rollout_world_size(self) -> int:
        """Rollout-only ranks (0 = colocated): `rollout_nodes * nproc_per_node` or `rollout_ranks`, whichever is set."""
        return self.rollout_nodes * self.nproc_per_node + self.rollout_ranks

    @property
    def learner_world_size(self) -> int:
        """Learner ranks [0, learner_world_size): the world without the rollout ranks."""
        return self.world_size - self.rollout_world_size

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def gpus_per_node(self) -> int:
        """GPUs requested per node (`slurm.gpus_per_node`, defaulting to one per rank)."""
        g = self.slurm.gpus_per_node
        return self.nproc_per_node if g is None else g
