"""`msrl plan --sync-bandwidth`: the weight-sync estimate (planner/sync.py) against hand-computed bytes and seconds,
and the CLI's estimate lines and argument checks."""
from __future__ import annotations

import math

import pytest

from megatron_sparse_rl.planner import SyncCosts, SyncVolume, as_built, load_shape, shard_to_shard, sync_volume
from megatron_sparse_rl.planner.shapes import shape_from_config
from megatron_sparse_rl.planner.sync import MEASURED_GBPS, broadcast_rounds, engine_rank_bytes
from megatron_sparse_rl.tools import cli

TINY = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128, "tie_word_embeddings": False}


def test_tiny_engine_rank_bytes_by_hand():
    # 2 layers: q (64 x 64, rows), k and v (32 x 64, rows by KV head: 2 heads over 2 ranks), o (64 x 64, columns),
    # 4 experts of gate/up (32 x 64, rows) and down (64 x 32, columns); norms (2 x 64, q/k norms 2 x 16) and the
    # router (4 x 64) whole; embedding and head (128 x 64) by vocab rows (128 = 2 x 64); the final norm (64) whole
    s = shape_from_config(TINY, "tiny")
    replicated = 2 * 64 + 2 * 16 + 4 * 64
    layer = (64 * 64 + 2 * 32 * 64 + 64 * 64) // 2 + 4 * (2 * 32 * 64 + 64 * 32) // 2 + replicated
    per_rank = 2 * (128 * 64 // 2) + 2 * layer + 64
    assert per_rank == 45_952
    assert engine_rank_bytes(s, 2, 2) == [2 * per_rank] * 2  # bf16
    assert engine_rank_bytes(s, 2, 1) == [per_rank] * 2  # fp8: one byte per parameter
    assert engine_rank_bytes(s, 1, 2) == [2 * s.total_params()] == [2 * 91_008]  # TP 1: the whole model


def test_kimi_k2_engine_rank_bytes_by_hand():
    # every split dimension divides 64 (q_b 12288, kv_b 16384, o 8192 columns, experts 2048, dense 18432, vocab
    # 163840), so each of 64 ranks gets 1/64 of the split tensors plus the replicated ones: per layer the q and kv
    # down projections (1536 x 7168, 576 x 7168) and their norms (1536, 512), the layer's two norms; per MoE layer
    # (60) the router (384 x 7168) and its correction bias (384); the final norm
    h = 7168
    replicated = 61 * (1536 * h + 1536 + 576 * h + 512 + 2 * h) + 60 * (384 * h + 384) + h
    total = 1_026_408_232_448
    assert (total - replicated) % 64 == 0
    per_rank = 2 * ((total - replicated) // 64 + replicated)
    assert engine_rank_bytes(load_shape("kimi-k2"), 64, 2) == [per_rank] * 64
    assert per_rank == pytest.approx(34.2e9, rel=1e-3)


def test_gather_is_what_rank_0s_node_lacks_by_hand():
    # tp1 pp1 ep2 on 2 GPUs: each holds the dense part and 2 of the 4 experts per layer. One GPU per node: rank 0
    # lacks the other GPU's experts, 2 layers x 2 experts x 3 x 64 x 32, bf16; two GPUs per node: nothing
    s = shape_from_config(TINY, "tiny")
    kw = dict(layout=(1, 1, 2), learner_gpus=2, engine_gpus=2, engines=1, weight_bytes=2)
    v = sync_volume(s, gpus_per_node=1, **kw)
    assert v.gather_bytes == 2 * 2 * 2 * 3 * 64 * 32 == 49_152
    assert sync_volume(s, gpus_per_node=2, **kw).gather_bytes == 0
    assert (v.model_bytes, v.engine_bytes, v.rank_bytes) == (2 * 91_008, 4 * 45_952, 2 * 45_952)


def test_broadcast_rounds_follow_gloos_binomial_tree():
    assert [broadcast_rounds(n) for n in (1, 2, 3, 4, 5, 8, 9, 65)] == [0, 1, 2, 2, 3, 3, 4, 7]


def test_estimates_by_hand():
    v = SyncVolume(model_bytes=7_000_000_000, engine_bytes=8_000_000_000, rank_bytes=4_000_000_000,
                   gather_bytes=6_000_000_000, engines=3, engine_gpus=2, learner_gpus=4, gpus_per_node=2)
    c = SyncCosts(pack_gbps=2, digest_gbps=4, verify_gbps=8, load_gbps=1)
    built = as_built(v, c, 10)
    # rank 0 gathers 6 GB over its node's 2 links, then broadcasts 8 GB to 3 engines + itself: 2 rounds
    assert built.wire_bytes == 6e9 / 2 + 2 * 8e9
    assert (built.transport_s, built.pack_s, built.digest_s, built.load_s) == pytest.approx(
        (19e9 / 10e9, 8 / 2, 8 / 4 + 4 / 8, 4 / 1))
    assert built.total_s == pytest.approx(1.9 + 4 + 2.5 + 4) and built.largest_s == 4
    assert built.bandwidth_for(2.0) is None  # pack + digest + load alone take 10.5 s
    assert built.bandwidth_for(20.0) == pytest.approx(19e9 / (20 - 10.5) / 1e9)
    s2s = shard_to_shard(v, c, 10)
    # busiest link: a learner GPU's 3 x 8 / 4 = 6 GB (an engine GPU gets 4 GB); each learner GPU packs 8 / 4 GB
    assert s2s.wire_bytes == 6e9
    assert (s2s.transport_s, s2s.pack_s, s2s.digest_s, s2s.load_s) == pytest.approx((0.6, 1.0, 0.5 + 0.5, 4.0))
    assert s2s.total_s == pytest.approx(6.6)
    fast = shard_to_shard(v, SyncCosts(pack_gbps=100, digest_gbps=100, verify_gbps=100, load_gbps=100), 10)
    assert fast.bandwidth_for(2.0) == pytest.approx(6e9 / (2 - (2 + 2 + 4 + 4) / 100) / 1e9)


def test_measured_rates_are_the_benchs_phases():
    # docs/weight_sync.md "Phases", After: 397,149,184 bytes; sender pack 0.145 s, digest 0.026 s; receiver verify
    # 0.074 s, load 0.552 s
    assert MEASURED_GBPS == pytest.approx({"pack": 2.739, "digest": 15.27, "verify": 5.367, "load": 0.7195}, rel=1e-3)
    assert SyncCosts().load_gbps == MEASURED_GBPS["load"]


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf])
def test_sync_costs_refuse_non_positive_rates(rate):
    with pytest.raises(ValueError, match="sync cost load_gbps must be a finite number of GB/s > 0"):
        SyncCosts(load_gbps=rate)


def test_cli_prints_the_estimate_for_kimi_k2_on_a_published_layout(capsys):
    # Kimi-K2 RL, 32 nodes at TP8 PP8 EP32 (docs/scale.md "Against published layouts"); 64-GPU engines (the
    # smallest power of two holding 2.05 TB of bf16 weights in half of 80 GiB), 256 / 64 = 4 of them
    argv = ["plan", "kimi-k2", "--gpus", "256", "--gpu-mem", "80", "--layout", "8,8,32", "--optimizer-offload",
            "--sync-bandwidth", "50"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "weight sync, learner tp8 pp8 ep32 (--layout) on 256 GPUs -> 4 engine(s) of 64 GPU(s), bf16 weights" in out
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("weight sync estimate, ")]
    assert len(lines) == 2
    assert lines[0].startswith("weight sync estimate, as built (learner rank 0 gathers, slices, broadcasts): "
                               "2190.1 GB per engine over 4 engine(s), link 50 GB/s: transport ")
    # shard-to-shard: each engine GPU receives 34.2 GB (above); 4 x 2190.1 GB / 256 learner GPUs is the same
    rank = engine_rank_bytes(load_shape("kimi-k2"), 64, 2)[0]
    assert lines[1].startswith("weight sync estimate, shard-to-shard (not built; every learner GPU sends what it "
                               f"holds): 2190.1 GB per engine over 4 engine(s), link 50 GB/s: transport "
                               f"{rank / 50e9:.2f} s + pack ")
    assert "(lower bound: full link rate, phases in series;" in lines[1]
    assert "<= 2 s: no link is fast enough: pack + digest + load alone take" in out
    # with per-byte phases 100x the measured rates, bandwidth decides, and the report says how much
    fast = [f"--sync-{p}-gbps=1000" for p in ("pack", "digest", "verify", "load")]
    assert cli.main(argv + fast) == 0
    assert "<= 2 s needs link >= " in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [("--sync-bandwidth", "0"), ("--sync-bandwidth", "-5"),
                                         ("--sync-bandwidth", "fast"), ("--sync-bandwidth", "nan"),
                                         ("--sync-load-gbps", "0")])
def test_cli_refuses_a_bad_rate_naming_the_flag(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: must be a number of GB/s > 0 (got '{value}')" in capsys.readouterr().err


def test_cli_refuses_zero_engines(capsys):
    assert cli.main(["plan", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", "--engines", "0"]) == 2
    assert "error: --engines must be >= 1 (got 0)" in capsys.readouterr().err


def test_cli_estimates_the_closest_layout_when_none_fits(capsys):
    # Qwen3-30B-A3B at 32K tokens on 4 x 80 GiB: no layout fits (its states alone exceed a GPU); the estimate names
    # the closest miss
    assert cli.main(["plan", "qwen3-30b-a3b", "--gpus", "4", "--gpu-mem", "80"]) == 1
    out, err = capsys.readouterr()
    assert "the closest, tp4 pp1 ep4" in err
    assert "weight sync, learner tp4 pp1 ep4 (the closest layout; none fits) on 4 GPUs" in out
