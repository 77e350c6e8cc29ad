"""Disaggregated placement: the rollout-rank count (`launch.rollout_ranks` on one node, `launch.rollout_nodes`
on several), its errors in the launch config, in `validate` (learner degrees vs the learner ranks), in
`msrl launch` and `msrl validate`; and the learner-side helpers that split prompts and join the rollout
ranks' batches.

    .venv/bin/python -m pytest -q tests/unit/test_disaggregated_config.py
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from megatron_sparse_rl.config import ConfigError, RunConfig
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.loader import from_dict, merge_overrides
from megatron_sparse_rl.launch.checks import check_launch
from megatron_sparse_rl.launch.load import load_run
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.tools import cli
from megatron_sparse_rl.placement.rollout import split_prompts


def run_of(*overrides: str) -> RunConfig:
    return from_dict(RunConfig, merge_overrides({"model": {"path": "/nonexistent/tiny", "tiny": {}}}, list(overrides)))


def test_rollout_rank_count_has_one_source_per_layout():
    one_node = run_of("launch.nproc_per_node=3", "launch.rollout_ranks=1").launch
    assert (one_node.world_size, one_node.learner_world_size, one_node.rollout_world_size) == (3, 2, 1)
    nodes = run_of("launch.nodes=3", "launch.nproc_per_node=4", "launch.rollout_nodes=1").launch
    assert (nodes.world_size, nodes.learner_world_size, nodes.rollout_world_size) == (12, 8, 4)
    colocated = run_of("launch.nproc_per_node=2").launch
    assert (colocated.learner_world_size, colocated.rollout_world_size) == (2, 0)


@pytest.mark.parametrize("overrides,message", [
    (["launch.rollout_ranks=-1"], "launch.rollout_ranks must be >= 0 (got -1)"),
    (["launch.nproc_per_node=2", "launch.rollout_ranks=2"],
     "launch.rollout_ranks must be in [0, launch.nproc_per_node - 1 = 1] so that at least one rank is a learner "
     "(got 2)"),
    (["launch.nodes=2", "launch.nproc_per_node=2", "launch.rollout_ranks=1"],
     "launch.rollout_ranks is for one-node runs (launch.nodes = 2); on several nodes give the rollout engines "
     "whole nodes with launch.rollout_nodes"),
])
def test_bad_rollout_ranks_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_of(*overrides)


def test_validate_checks_learner_degrees_against_learner_ranks():
    # 3 ranks, 1 rollout: tp 2 tiles the 2 learner ranks (it would not tile the world of 3)
    validate(run_of("launch.nproc_per_node=3", "launch.rollout_ranks=1", "parallel.tp=2",
                    "parallel.sequence_parallel=true"), 3, cuda=False)
    with pytest.raises(ConfigError, match=re.escape(
            "learner ranks = world size 3 - 2 rollout ranks = 1: world size 1 is not divisible by parallel.tp * "
            "parallel.pp = 2 * 1 = 2")):
        validate(run_of("launch.nproc_per_node=3", "launch.rollout_ranks=2", "parallel.tp=2",
                        "parallel.sequence_parallel=true"), 3, cuda=False)
    with pytest.raises(ConfigError, match=re.escape("world size 2 != launch.nodes * launch.nproc_per_node")):
        validate(run_of("launch.nproc_per_node=3", "launch.rollout_ranks=1"), 2, cuda=False)


def test_validate_wants_engines_that_split_both_rank_ranges():
    """vLLM cuts the whole world into engines of t consecutive ranks: t must divide learner and rollout ranks."""
    for nproc, rollout in ((3, 2), (3, 1), (4, 1)):
        with pytest.raises(ConfigError, match=re.escape(
                f"rollout.tensor_parallel_size = 2 must divide both the rollout ranks ({rollout}) and the learner "
                f"ranks ({nproc - rollout})")):
            validate(run_of(f"launch.nproc_per_node={nproc}", f"launch.rollout_ranks={rollout}",
                            "rollout.tensor_parallel_size=2"), nproc, cuda=False)
    validate(run_of("launch.nproc_per_node=4", "launch.rollout_ranks=2", "rollout.tensor_parallel_size=2",
                    "parallel.tp=2", "parallel.sequence_parallel=true"), 4, cuda=False)


def test_launch_checks_and_cli_see_the_learner_ranks(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"model": {"path": str(tmp_path / "m"), "tiny": {}}, "parallel": {"tp": 2}}))
    run, launch = load_run(path, ["launch.nproc_per_node=4", "launch.rollout_ranks=1"])
    with pytest.raises(ConfigError, match=re.escape(
            "learner ranks = launch.nproc_per_node 4 - launch.rollout_ranks 1 = 3 is not divisible by parallel.tp * "
            "parallel.pp = 2 * 1 = 2")):
        check_launch(run, launch, slurm=False)
    assert cli.main(["launch", "local", str(path), "--nproc", "3", "--dry-run", "--set", "launch.rollout_ranks=1",
                     "parallel.sequence_parallel=true"]) == 0
    assert "launch.rollout_ranks=1" in capsys.readouterr().out.split()
    assert cli.main(["launch", "local", str(path), "--nproc", "3", "--dry-run", "--set", "launch.rollout_ranks=3"]) == 2
    assert "launch.rollout_ranks must be in [0, launch.nproc_per_node - 1 = 2]" in capsys.readouterr().err
    assert cli.main(["validate", str(path), "--world-size", "3", "--set", "launch.nproc_per_node=3",
                     "launch.rollout_ranks=1", "parallel.sequence_parallel=true"]) == 0
    out = capsys.readouterr().out
    assert "layout: learner ranks 2 = tp 2 x pp 1 x dp 1" in out
    assert "placement: disaggregated, learner ranks 0-1, rollout ranks 2-2" in out


def test_split_prompts_covers_every_prompt_once_in_order():
    assert split_prompts(5, 2) == [range(0, 3), range(3, 5)]
    assert split_prompts(1, 3) == [range(0, 1), range(1, 1), range(1, 1)]
    for n in range(0, 9):
        for parts in range(1, 4):
            slices = split_prompts(n, parts)
            assert [i for r in slices for i in r] == list(range(n))
            assert max(map(len, slices)) - min(map(len, slices)) <= 1


def _hand_batch() -> RolloutBatch:
    """Three samples written out by hand: prompts of 2, 3, 1 tokens; responses of 1, 3, 2 tokens (pad 0)."""
    return RolloutBatch(
        prompt_ids=torch.tensor([[5, 6, 0], [7, 8, 9], [4, 0, 0]]), prompt_lens=torch.tensor([2, 3, 1]),
        response_ids=torch.tensor([[11, 0, 0], [12, 13, 14], [15, 16, 0]]),
        response_mask=torch.tensor([[True, False, False], [True, True, True], [True, True, False]]),
        rollout_logprobs=torch.tensor([[-0.1, 0, 0], [-0.2, -0.3, -0.4], [-0.5, -0.6, 0]]),
        finish_reasons=("stop", "length", "stop"), group_ids=torch.tensor([0, 1, 1]))


def test_concat_batches_rebuilds_the_rows_and_padding():
    whole = _hand_batch()
    joined = RolloutBatch.concat([whole.select([0]), whole.select([1, 2])], pad_id=0)
    for name in ("prompt_ids", "prompt_lens", "response_ids", "response_mask", "rollout_logprobs", "group_ids"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    assert joined.finish_reasons == whole.finish_reasons
    assert joined.features.routed_experts is None and joined.features.kv_keep is None


def test_concat_batches_joins_routes_and_kv_records():
    from megatron_sparse_rl.moe.storage import RouteStore

    whole = _hand_batch()
    routes = [torch.tensor([[[0, 1]]] * n) for n in (3, 6, 3)]  # [tokens, 1 layer, top-2], tokens = prompt + response
    store = RouteStore.from_sequences(routes, [list(range(n)) for n in (3, 6, 3)], num_experts=4, layers=[0])
    whole = whole.with_features(routed_experts=store, kv_keep=("a", "b", "c"))
    joined = RolloutBatch.concat([whole.select([0, 1]), whole.select([2])], pad_id=0)
    assert torch.equal(joined.features.routed_experts.offsets, store.offsets)
    assert torch.equal(joined.features.routed_experts.indices, store.indices)
    assert torch.equal(joined.features.routed_experts.token_hash, store.token_hash)
    assert joined.features.kv_keep == ("a", "b", "c")


def test_concat_batches_joins_sampling_supports():
    from megatron_sparse_rl.rollout.sampling_mask import SamplingSupport

    whole = _hand_batch()
    support = SamplingSupport(prompt_lens=whole.prompt_lens,
                              counts=tuple(torch.tensor(c, dtype=torch.int32) for c in ([2], [0, 1, 0], [1, 1])),
                              ids=tuple(torch.tensor(i, dtype=torch.int32) for i in ([3, 11], [13], [15, 16])))
    whole = whole.with_features(sampling_mask=support)
    joined = RolloutBatch.concat([whole.select([0]), whole.select([1, 2])], pad_id=0)
    for r in range(3):
        assert torch.equal(joined.features.sampling_mask.local_mask([r], 5, 0, 20), support.local_mask([r], 5, 0, 20))
