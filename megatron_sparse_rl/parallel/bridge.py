"""Disaggregated worlds: learner ranks and rollout ranks each get their OWN default torch.distributed world, and
`Bridge` groups join a learner rank to rollout ranks outside both.

    split = SplitWorld.split(learner_ranks=L, backend="gloo")   # every rank of the launcher's world, once
    split.is_learner          # default world now: learner ranks [0, L) (same ranks as before), or rollout ranks
    sync = split.bridge([0, L, L + 1, ...])   # every rank, same order; None on ranks not listed
    sync.broadcast_object(obj, src=0); sync.gather_object(obj, dst=0); sync.broadcast(tensor, src=0)

Why (docs/launch.md "Process worlds of a disaggregated run"): Megatron-Core's optimizer (param-group alignment)
and `dist_checkpointing` run collectives on the DEFAULT world, and vLLM builds its groups over the default world
with `new_group`, which every rank of that world must enter. One default world per role lets each library use
it as it expects: Megatron's collectives stay among the learner ranks, vLLM's among the rollout ranks, and no
rank mirrors the other library's group creation.

`split` replaces the launcher's world (it must hold no other group yet): global rank 0 serves a new TCPStore on
$MASTER_ADDR only (where the ranks reach the launcher's store: 127.0.0.1 on one machine), publishes its address
over the old world, the old world is destroyed, and each role initialises its world from its own prefix of that
store (learner ranks keep their global ranks; rollout rank L + i becomes rank i of the rollout world). A `Bridge`
is a gloo group over a list of global ranks, built from the same store; only its members construct it (gloo
connects them through the store), so it needs no default world. Its collectives are the few the weight sync and
the command loop use. Global rank 0 serves the store: it must outlive the other ranks' use of it (the
disaggregated trainer's "stop" waits for the rollout ranks' last answer).
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_sparse_rl.parallel.ports import LOOPBACK, store_client, store_server

_TAG = 0


class Bridge:
    """A gloo group over `members` (global ranks of the launcher's world, in group-rank order). Ranks are always
    given as global ranks. Every member calls each collective in the same order, as with torch's groups."""

    def __init__(self, store, name: str, members: list[int], rank: int, timeout: timedelta):
        self.members = list(members)
        self.rank = self.members.index(rank)
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore(f"bridge/{name}/", store), self.rank, len(members),
                                         timeout)

    def size(self) -> int:
        return len(self.members)

    def barrier(self) -> None:
        self._pg.allreduce([torch.zeros(1)]).wait()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """`tensor` (CPU) from global rank `src` to every member, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.members.index(src), 0
        self._pg.broadcast([tensor], opts).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int):
        """`broadcast` started and not waited for: the returned work's `is_completed()` says whether `tensor` holds
        the root's data yet, `wait()` waits for it. No other collective of this group may run before it completes."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.members.index(src), 0
        return self._pg.broadcast([tensor], opts)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """`obj` (picklable) from global rank `src`; every member returns it."""
        mine = self.members[self.rank] == src
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if mine else None
        size = torch.tensor([data.numel() if mine else 0], dtype=torch.int64)
        self.broadcast(size, src)
        if not mine:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast(data, src)
        return obj if mine else pickle.loads(data.numpy().tobytes())

    def gather_object(self, obj: Any, dst: int) -> list | None:
        """Every member's `obj` to global rank `dst`, in member order (None on the other members)."""
        root = self.members.index(dst)
        if self.rank != root:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            self._pg.send([torch.tensor([data.numel()], dtype=torch.int64)], root, _TAG).wait()
            self._pg.send([data], root, _TAG).wait()
            return None
        out: list = [None] * len(self.members)
        for peer in range(len(self.members)):
            if peer == root:
                out[peer] = obj
                continue
            size = torch.empty(1, dtype=torch.int64)
            self._pg.recv([size], peer, _TAG).wait()
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            self._pg.recv([data], peer, _TAG).wait()
            out[peer] = pickle.loads(data.numpy().tobytes())
        return out


@dataclass
class SplitWorld:
    """This process's side of a launcher world split into a learner world and a rollout world (module docstring)."""

    global_rank: int
    learner_ranks: int
    rollout_ranks: int
    store: Any = field(repr=False)
    timeout: timedelta = dist.default_pg_timeout
    _bridges: int = 0

    @property
    def is_learner(self) -> bool:
        return self.global_rank < self.learner_ranks

    @classmethod
    def split(cls, learner_ranks: int, backend: str, timeout: timedelta = dist.default_pg_timeout) -> "SplitWorld":
        """Collective over the launcher's world (which it destroys): learner ranks [0, learner_ranks) and the
        rollout ranks after them each get a default world of their own on `backend`."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if not 0 < learner_ranks < world:
            raise ValueError(f"split: {learner_ranks} learner ranks must leave at least one rank of the world of "
                             f"{world} for the rollout ranks")
        host = os.environ.get("MASTER_ADDR", LOOPBACK)  # the launcher's store address: the one the ranks reach
        store = store_server(host, world_size=world, timeout=timeout) if rank == 0 else None
        box = [(host, store.port) if store is not None else None]
        dist.broadcast_object_list(box, src=0)
        if store is None:
            store = store_client(box[0][0], box[0][1], world_size=world, timeout=timeout)
        dist.barrier()
        dist.destroy_process_group()
        learner = rank < learner_ranks
        role, role_rank, role_size = (("learner", rank, learner_ranks) if learner else
                                      ("rollout", rank - learner_ranks, world - learner_ranks))
        dist.init_process_group(backend, store=dist.PrefixStore(f"world/{role}/", store), rank=role_rank,
                                world_size=role_size, timeout=timeout)
        return cls(rank, learner_ranks, world - learner_ranks, store, timeout)

    def bridge(self, members: list[int]) -> Bridge | None:
        """A `Bridge` over `members` (global ranks) on members, None elsewhere. Every rank calls it, in the same
        order relative to its other `bridge` calls (the order names the group in the store)."""
        self._bridges += 1
        name = f"{self._bridges}:{','.join(map(str, members))}"
        if self.global_rank not in members:
            return None
        return Bridge(self.store, name, members, self.global_rank, self.timeout)
