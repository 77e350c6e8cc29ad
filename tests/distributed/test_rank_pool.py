"""parallel/spawn.py `RankPool`, which the suite's `run_distributed` uses: the same rank processes serve calls one
after another, each call in a fresh world with the caller's directory and environment; a failed call, a hang, or
a rank that imported vLLM ends the ranks, and the next call starts new ones."""
import os
import sys

import pytest

from megatron_sparse_rl.parallel.spawn import RankFailed, RankPool

pytestmark = [pytest.mark.distributed]


def _report(rank, world_size, tag):
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"pid": os.getpid(), "sum": total.item(), "cwd": os.getcwd(), "tag": os.environ.get("POOL_TAG"),
            "world": dist.get_world_size(), "arg": tag}


def _megatron_groups(rank, world_size, tp):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    return ps.get_tensor_model_parallel_world_size()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return rank


def _import_vllm_marker(rank, world_size):
    sys.modules.setdefault("vllm", type(sys)("vllm"))  # what a rank that ran an engine holds
    return os.getpid()


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2)
    yield p
    p.close()


def test_calls_reuse_the_ranks_each_in_a_fresh_world(pool, tmp_path, monkeypatch):
    first = pool.run(_report, ("a",))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POOL_TAG", "second")
    second = pool.run(_report, ("b",))
    assert [o["pid"] for o in first] == [o["pid"] for o in second]
    assert all(o["sum"] == 3.0 and o["world"] == 2 for o in first + second)
    assert [o["arg"] for o in second] == ["b", "b"] and all(o["tag"] is None for o in first)
    assert all(o["cwd"] == str(tmp_path) and o["tag"] == "second" for o in second)
    monkeypatch.delenv("POOL_TAG")
    assert all(o["tag"] is None for o in pool.run(_report, ("c",)))


def test_megatron_state_does_not_leak_into_the_next_call(pool):
    assert pool.run(_megatron_groups, (2,)) == [2, 2]
    assert pool.run(_megatron_groups, (1,)) == [1, 1]  # initialize_model_parallel would refuse a second set-up


def test_a_failure_raises_and_the_next_call_gets_new_ranks(pool):
    before = [o["pid"] for o in pool.run(_report, ("a",))]
    with pytest.raises(RankFailed) as e:
        pool.run(_fail_on_one, timeout=60)
    assert e.value.rank == 1 and e.value.summary == "ValueError: rank 1 refuses"
    after = pool.run(_report, ("b",))
    assert set(o["pid"] for o in after).isdisjoint(before) and [o["sum"] for o in after] == [3.0, 3.0]


def test_ranks_that_imported_vllm_are_not_reused(pool):
    pids = pool.run(_import_vllm_marker)
    assert set(o["pid"] for o in pool.run(_report, ("a",))).isdisjoint(pids)
