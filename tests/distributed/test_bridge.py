"""The disaggregated world split (parallel/bridge.py): on 5 gloo ranks split 2 + 3, each role's default world holds
exactly its own ranks (sizes, ranks, an all-reduce whose sum is the hand-computed one of its members' global
ranks), groups made with `new_group` in one role need nothing from the other, and `Bridge`s between learner rank 0
and rollout ranks carry tensors and objects both ways, also a bridge a learner rank is not a member of.

    .venv/bin/python -m pytest -q tests/distributed/test_bridge.py
"""
import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_distributed

pytestmark = [pytest.mark.distributed]

LEARNERS = 2


def split_worker(rank, world_size):
    from megatron_sparse_rl.parallel.bridge import SplitWorld

    split = SplitWorld.split(LEARNERS, "gloo")
    out = {"learner": split.is_learner, "rank": dist.get_rank(), "size": dist.get_world_size()}
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)  # the role's default world only
    out["sum"] = total.item()
    if not split.is_learner:  # a group made in the rollout world alone (as vLLM makes its own)
        group = dist.new_group([0, 1])
        if group != dist.GroupMember.NON_GROUP_MEMBER:
            pair = torch.tensor([float(rank)])
            dist.all_reduce(pair, group=group)
            out["pair"] = pair.item()
    rollout = list(range(LEARNERS, world_size))
    sync = split.bridge([0, *rollout])
    tail = split.bridge([1, world_size - 1])  # learner rank 1 and the last rollout rank
    if sync is not None:
        out["obj"] = sync.broadcast_object({"step": 7, "t": torch.arange(4)} if rank == 0 else None, src=0)
        buf = torch.arange(5, dtype=torch.uint8) * (rank == 0)
        sync.broadcast(buf, src=0)
        out["buf"] = buf.tolist()
        out["gathered"] = sync.gather_object(("answer", rank), dst=0)
        out["from_rollout"] = sync.broadcast_object(f"from {rank}" if rank == LEARNERS else None, src=LEARNERS)
        sync.barrier()
    out["tail"] = None if tail is None else tail.gather_object(rank * 10, dst=1)
    return out


def test_split_gives_each_role_its_own_world_and_bridges_join_them():
    outs = run_distributed(split_worker, 5, timeout=120)
    learner_sum, rollout_sum = float(sum(range(LEARNERS))), float(sum(range(LEARNERS, 5)))
    for rank, out in enumerate(outs):
        learner = rank < LEARNERS
        assert out["learner"] == learner
        assert (out["rank"], out["size"]) == ((rank, LEARNERS) if learner else (rank - LEARNERS, 5 - LEARNERS))
        assert out["sum"] == (learner_sum if learner else rollout_sum)
        member = rank == 0 or not learner
        assert ("obj" in out) == member
        if member:
            assert out["obj"]["step"] == 7 and torch.equal(out["obj"]["t"], torch.arange(4))
            assert out["buf"] == [0, 1, 2, 3, 4]
            assert out["from_rollout"] == f"from {LEARNERS}"
    assert outs[LEARNERS]["pair"] == outs[LEARNERS + 1]["pair"] == float(LEARNERS + LEARNERS + 1)
    assert outs[0]["gathered"] == [("answer", r) for r in (0, 2, 3, 4)]
    assert all(out.get("gathered") is None for out in outs[1:])
    assert outs[1]["tail"] == [10, 40] and all(outs[r]["tail"] is None for r in (0, 2, 3, 4))
