"""The torch.distributed world on the collective backend the config names (`parallel.backend`): the one place a
process joins its world (`msrl train`, `msrl convert`, spawned ranks), and `on_rank0`, the collective helper that
runs a step on rank 0 and raises its error on every rank.

    rank, world = join_world(run.parallel)   # torchrun/srun's world from the environment, or a world of one
    result = on_rank0(lambda: write_files())  # every rank gets the result, or the same error

'auto' is nccl with CUDA and gloo without; 'nccl' and 'gloo' are kept as named. A backend this machine
cannot run (nccl without CUDA) is a ConfigError naming the field before any process group starts; so is a
world someone already started on another backend than the one the config names.

Where the world's sockets listen (docs/launch.md "What listens where"): a world of one serves its store on
127.0.0.1; under torchrun (`msrl launch local`, the SLURM script's torchrun mode) and `run_ranks` the launcher
serves it and every rank is a client; otherwise (srun mode) rank 0 serves it on $MASTER_ADDR only. When every
rank runs on this machine, gloo and NCCL listen on the loopback interface unless GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME name one.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist

from megatron_sparse_rl.config.degrees import resolve_backend
from megatron_sparse_rl.config.loader import ConfigError
from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.parallel.ports import LOOPBACK, loopback_socket_env, store_client, store_server


def backend_problem(backend: str) -> str | None:
    """Why this machine cannot run the resolved `backend`, or None when it can."""
    if backend == "nccl" and not torch.cuda.is_available():
        return "parallel.backend = 'nccl' needs CUDA, which this machine does not have; use 'auto' or 'gloo'"
    if backend == "nccl" and not dist.is_nccl_available():
        return "parallel.backend = 'nccl': this torch build has no NCCL; use 'auto' or 'gloo'"
    if backend == "gloo" and not dist.is_gloo_available():
        return "parallel.backend = 'gloo': this torch build has no gloo; use 'auto' or 'nccl'"
    return None


def join_world(cfg: ParallelConfig) -> tuple[int, int]:
    """(rank, world size) of the torchrun/srun world from the environment, or of a new world of one on this
    machine, initialised on `cfg.backend`. Raises ConfigError before starting anything it cannot honour."""
    backend = resolve_backend(cfg.backend)
    if dist.is_initialized():
        if cfg.backend != "auto" and dist.get_backend() != backend:
            raise ConfigError(f"parallel.backend = {cfg.backend!r}, but torch.distributed was already initialised "
                              f"with {dist.get_backend()!r} in this process; make them agree")
        return dist.get_rank(), dist.get_world_size()
    problem = backend_problem(backend)
    if problem:
        raise ConfigError(problem)
    if "RANK" not in os.environ:
        store = store_server(LOOPBACK, world_size=1)
        os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    else:
        store = _rank0_store()
    if os.environ.get("LOCAL_WORLD_SIZE", "1") == os.environ.get("WORLD_SIZE"):  # every rank is on this machine
        os.environ.update(loopback_socket_env(os.environ))
    if backend == "nccl":  # one GPU per local rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if store is None:  # the launcher serves the store (torchrun's agent, run_ranks): env:// connects to it
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    return dist.get_rank(), dist.get_world_size()


def _rank0_store():
    """The store of a world a launcher started from the environment: None when the launcher serves it (torchrun
    says so with TORCHELASTIC_USE_AGENT_STORE; env:// then makes every rank a client) or names no address (env://
    then says what is missing); else rank 0 serves it on $MASTER_ADDR:$MASTER_PORT only (torch's env:// would
    listen on every interface) and the other ranks connect to it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    addr, port, world = (os.environ.get(v, "") for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"))
    if not (addr and port.isdigit() and world.isdigit()):
        return None
    if os.environ["RANK"] == "0":
        remote = os.environ.get("LOCAL_WORLD_SIZE", world) != world  # ranks on other machines connect to it
        return store_server(addr, int(port), world_size=int(world), remote=remote)
    return store_client(addr, int(port), world_size=int(world))


def on_rank0(fn: Callable[[], object]):
    """Run `fn` on rank 0 only and return its result on every rank, or raise its error on every rank (so no
    rank waits in a collective forever)."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            box[0] = ("err", e)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "err":
        raise value
    return value
