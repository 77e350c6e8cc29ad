"""Context parallelism's configuration (parallel.cp): world size accounting, the padding rule, the refusals at
`validate` (each naming the field and why), the summary and start lines, and our split of a sequence against
Megatron-Core's own `get_batch_on_this_cp_rank`. The learner running it: tests/distributed/test_context_parallel.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_sparse_rl.config import ConfigError
from megatron_sparse_rl.config.degrees import ParallelDegrees
from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.parallel.context import cp_positions
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.validation.summary import run_summary
from tests.unit.test_config_validate import run_of


def test_world_size_counts_cp():
    degrees = ParallelDegrees.from_config(ParallelConfig(tp=2, cp=2), 8, cuda=False)
    assert (degrees.tp, degrees.cp, degrees.dp) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"parallel.tp \* parallel.pp \* parallel.cp = 2 \* 1 \* 2 = 4"):
        ParallelDegrees.from_config(ParallelConfig(tp=2, cp=2), 6, cuda=False)
    with pytest.raises(ValueError, match=r"parallel.cp must be >= 1 \(got 0\)"):
        ParallelConfig(cp=0)


def test_padding_multiple():
    def degrees(**kw):
        return ParallelDegrees.from_config(ParallelConfig(**kw), 8, cuda=False)

    assert degrees().sequence_multiple == 1 and degrees().padded_positions(13) == 13
    assert degrees(tp=2, sequence_parallel=True).sequence_multiple == 2  # as before context parallelism
    assert degrees(cp=2).sequence_multiple == 4 and degrees(cp=2).padded_positions(13) == 16
    assert degrees(tp=2, cp=2, sequence_parallel=True).sequence_multiple == 8


def test_split_is_megatron_get_batch_on_this_cp_rank(monkeypatch):
    from megatron.core import utils

    tokens = torch.arange(24).reshape(2, 12)
    monkeypatch.setattr(utils.torch.distributed, "is_initialized", lambda: True)  # get_pg_size asks the group then
    for cp in (2, 3):
        for rank in range(cp):
            group = SimpleNamespace(size=lambda cp=cp: cp, rank=lambda rank=rank: rank)
            theirs = utils.get_batch_on_this_cp_rank({"tokens": tokens.clone()}, cp_group=group)["tokens"]
            assert theirs.shape[1] == 12 // cp
            assert torch.equal(tokens[:, cp_positions(12, cp, rank)], theirs)
    held = torch.cat([cp_positions(16, 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(16))
    with pytest.raises(ValueError, match="does not split into 2 x cp = 4 equal chunks"):
        cp_positions(14, 2, 0)


def test_validate_accepts_cp_and_names_it():
    validate(run_of("parallel.cp=2", "parallel.pp=2", "launch.nproc_per_node=4"), 4, cuda=False)  # pp x cp runs
    run = run_of("parallel.cp=2", "launch.nproc_per_node=4")
    spec = validate(run, 4, cuda=False)
    assert any("tp 1 x pp 1 x cp 2 x dp 2" in line for line in run_summary(run, spec, 4))
    plain = run_summary(run_of("launch.nproc_per_node=4"), spec, 4)
    assert any("tp 1 x pp 1 x dp 4;" in line for line in plain)


@pytest.mark.parametrize("overrides,match", [
    (("parallel.cp=2", "learner.kernels=local"), r"learner.kernels = 'local' runs Megatron-Core's local "
                                                 r"DotProductAttention, which refuses context parallelism .* "
                                                 r"\(parallel.cp = 2\)"),
    (("parallel.cp=2", "rollout.max_model_len=4", "rollout.sampling.max_tokens=2"),
     r"rollout.max_model_len = 4 gives the learner 3 input positions, fewer than the 2 x parallel.cp = 4 chunks"),
    (("parallel.cp=2", "launch.nproc_per_node=3"), r"parallel.tp \* parallel.pp \* parallel.cp"),
])
def test_validate_refuses(overrides, match):
    run = run_of(*overrides)
    world = run.launch.nproc_per_node if run.launch.nproc_per_node > 1 else 2
    with pytest.raises(ConfigError, match=match):
        validate(run, world, cuda=False)


def test_validate_takes_mla_and_dsa_at_cp2_and_refuses_the_rest(tmp_path):
    """Multi-latent attention and DeepSeek Sparse Attention run at cp > 1 (tests/distributed/test_context_parallel.py,
    tests/distributed/test_dsa_context_parallel.py, DSA also at pp 2 x cp 2 and tp 2 x cp 2); DSA through the local
    kernels is refused naming the field. (A DSA model on CPU is also refused for its rollout engine: only the cp problems are
    looked at here.)"""
    from megatron_sparse_rl.models.tiny_families import build_tiny_dsa

    validate(run_of("parallel.cp=2", "model.tiny.arch=deepseek_v3"), 2, cuda=False)
    model = build_tiny_dsa(tmp_path / "dsa", seed=1)

    def problems(*overrides, world=2):
        with pytest.raises(ConfigError) as e:
            validate(run_of(f"model.path={model}", *overrides, tiny=False), world, cuda=False)
        return str(e.value)

    assert "parallel.cp" not in problems("parallel.cp=2")
    assert "parallel.cp" not in problems("parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", world=4)
    assert "parallel.cp" not in problems("parallel.cp=2", "parallel.pp=2", world=4)
    assert ("learner.kernels = 'local' runs Megatron-Core's DSAttention, whose indexer and sparse attention see only "
            "this rank's positions") in problems("parallel.cp=2", "learner.kernels=local")


def test_validate_refuses_padding_beyond_the_positions(tmp_path):
    """A sequence length limit whose padding to 2 x cp chunks passes the model's positions."""
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model = build_tiny_hf_model(tmp_path / "m", max_position=2046, seed=1)
    ok = run_of(f"model.path={model}", "parallel.cp=2", "rollout.max_model_len=2045", tiny=False)
    validate(ok, 2, cuda=False)  # 2044 positions: a multiple of 4
    bad = run_of(f"model.path={model}", "parallel.cp=2", "rollout.max_model_len=2046", tiny=False)
    with pytest.raises(ConfigError, match=r"rollout.max_model_len = 2046: the learner pads a sequence's 2045 input "
                                          r"positions to a multiple of 4 \(2 x parallel.cp\) = 2048, beyond the "
                                          r"model's max_position_embeddings \(2046\); lower rollout.max_model_len to "
                                          r"at most 2045"):
        validate(bad, 2, cuda=False)


def test_start_line_names_cp(caplog, tmp_path):
    import logging

    from megatron_sparse_rl import trainer

    run = run_of("parallel.cp=2", "launch.nproc_per_node=2")
    spec = validate(run, 2, cuda=False)
    ctx = SimpleNamespace(is_main=True, layout=ParallelDegrees.from_config(run.parallel, 2, cuda=False), run=run,
                          spec=spec, owner=SimpleNamespace(run_id="0123456789"), run_dir=tmp_path,
                          learner=SimpleNamespace(lora_params={}))
    with caplog.at_level(logging.INFO, logger=trainer.__name__):
        trainer._announce(ctx, trainer.state.LoopState())
    assert "learner TP1 PP1 CP2 EP1 DP1;" in caplog.text


def test_launch_checks_count_cp():
    from megatron_sparse_rl.launch.checks import layout_problems

    run = run_of("parallel.cp=2", "launch.nproc_per_node=3")
    assert any("not divisible by parallel.tp * parallel.pp * parallel.cp = 1 * 1 * 2 = 2" in p
               for p in layout_problems(run, run.launch))
    assert layout_problems(run_of("parallel.cp=2", "launch.nproc_per_node=4"), run.launch.__class__(nproc_per_node=4)) == []


def test_kernel_choice_at_cp():
    """The learner's build refuses what validate refuses (one check, models/kernels.py)."""
    from megatron_sparse_rl.models.kernels import check_context_parallel

    check_context_parallel("fast", use_te=False)
    check_context_parallel("local", use_te=True)  # Transformer Engine's attention runs CP itself
    with pytest.raises(ValueError, match=r"learner.kernels = 'local' runs Megatron-Core's local DotProductAttention"):
        check_context_parallel("local", use_te=False)
    check_context_parallel("fast", use_te=True, sparse_attention=True)
    with pytest.raises(ValueError, match=r"learner.kernels = 'local' runs Megatron-Core's DSAttention"):
        check_context_parallel("local", use_te=True, sparse_attention=True)  # the DSA spec is local, also with TE
