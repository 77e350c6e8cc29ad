"""Sparse KV inside real vLLM (CPU, tiny Qwen3-MoE, fp32) against dense vLLM and a transformers reference.

Checks: a budget the generation never reaches gives the dense engine's tokens and logprobs; at a small
budget vLLM's block pool usage stays bounded while dense grows; StreamingLLM keeps exactly the sinks and
the recent window (positions recomputed here from the rule); the engine's sparse logprobs equal a
transformers forward whose attention drops the same KV entries at the same steps (StreamingLLM: mask
built here from the rule; SnapKV/H2O: mask built here from the engine's kv_keep record); a long batch on
a small pool completes without preemption under admission control, and with preemption (admission
control off) completes with the preempted compressed requests flagged.
Run: .venv/bin/python -m pytest -q tests/e2e/test_sparse_kv.py
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig, SamplingConfig
from megatron_sparse_rl.kv.engine_extension import sparse_kv_extensions, sparse_kv_stats, sparse_kv_timing
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from megatron_sparse_rl.rollout.block_usage import BlockUsageProbe

pytestmark = pytest.mark.e2e

ATOL = 1e-5  # fp32 max |dlogprob| engine vs transformers with the same KV dropped (notes: <= 1e-6 measured)
PROMPTS = [[1] + [5 + (7 * i + 3 * j) % 30 for j in range(21 + 4 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("sparse_kv") / "moe", seed=0)


@contextlib.contextmanager
def engine(model_dir, kv: KVConfig, max_num_seqs=8, max_model_len=640):
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    vllm_cpu.apply()
    e = RolloutEngine(model_dir, RolloutConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_gb=1,
                                               kv=kv), extensions=sparse_kv_extensions(kv))
    # fixed-length generations (the tiny random model samples EOS often): vLLM's ignore_eos
    e._sampling_params = lambda s, i, **extra: RolloutEngine._sampling_params(e, s, i, ignore_eos=True, **extra)
    try:
        yield e
    finally:
        e.shutdown()


def sampling(max_tokens, n=1, seed=11):
    return SamplingConfig(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed)


# ---- an independent transformers reference ---------------------------------------------------------
def hf_masked_logprobs(model_dir, tokens: list[int], mask: torch.Tensor, qk: dict | None = None,
                       latents: dict | None = None) -> torch.Tensor:
    """log p(tokens[t+1] | visible) for every t, with per-layer, per-KV-head visibility mask
    [layers, kv_heads, T, T] (True = query t may attend key s) applied inside each attention layer
    (a multi-head latent attention model: kv_heads 1, one keep set per layer for every head).
    `qk`, if given, receives {layer: (queries [Hq, T, D], keys [Hkv, T, D])} after RoPE; `latents`, for an MLA
    model, {layer: c_kv [T, kv_lora_rank]} (the normalised latent, kv_a_layernorm's output)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    def masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        if qk is not None:
            qk[module.layer_idx] = (query[0].clone(), key[0].clone())
        m = mask[module.layer_idx].repeat_interleave(groups, dim=0)[None]  # [1, Hq, T, T]
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        w = (query @ k.transpose(2, 3)) * scaling
        w = w.masked_fill(~m, float("-inf")).softmax(dim=-1)
        return (w @ v).transpose(1, 2).contiguous(), w

    AttentionInterface.register("msrl_test_masked", masked_attention)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="msrl_test_masked").eval()
    if latents is not None:
        for li, layer in enumerate(model.model.layers):
            layer.self_attn.kv_a_layernorm.register_forward_hook(
                lambda mod, args, out, li=li: latents.__setitem__(li, out[0].detach().clone()))
    with torch.no_grad():
        logp = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    return logp[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def rule_compactions(prompt_len: int, response_len: int, budget: int, interval: int):
    """(true length at each compaction) from the trigger rule: stored >= budget + interval -> budget,
    checked before each decode step (the input token at position t = prompt_len .. total - 2)."""
    stored, out = prompt_len, []
    for t in range(prompt_len, prompt_len + response_len - 1):
        if stored >= budget + interval:
            out.append(t)
            stored = budget
        stored += 1
    return out


def mask_from_keeps(total: int, layers: int, heads: int, events) -> torch.Tensor:
    """Visibility [L, H, T, T] from compaction events [(t_c, kept[L][H] -> list of true positions)]:
    query t attends the kept set of the last compaction at or before t plus positions t_c..t."""
    mask = torch.zeros(layers, heads, total, total, dtype=torch.bool)
    for t in range(total):
        last = [e for e in events if e[0] <= t]
        for li in range(layers):
            for h in range(heads):
                if not last:
                    mask[li, h, t, : t + 1] = True
                else:
                    tc, kept = last[-1]
                    mask[li, h, t, list(kept[li][h])] = True
                    mask[li, h, t, tc: t + 1] = True
    return mask


def row_tokens(batch, i):
    return batch.prompts()[i] + batch.responses()[i]


# ---- tests --------------------------------------------------------------------------------------------
def test_budget_never_reached_equals_dense(model_dir):
    s = sampling(48, n=2)
    with engine(model_dir, KVConfig()) as dense:
        ref = dense.generate(PROMPTS[:2], s)
    with engine(model_dir, KVConfig(policy="snapkv", budget=256, interval=32, block_size=32)) as sparse:
        got = sparse.generate(PROMPTS[:2], s)
        assert sparse_kv_stats(sparse)["compactions"] == 0
    assert torch.equal(got.response_ids, ref.response_ids)
    assert torch.equal(got.rollout_logprobs, ref.rollout_logprobs)
    assert all(r.num_compactions == 0 for r in got.features.kv_keep)


def test_block_usage_bounded_while_dense_grows(model_dir):
    prompts, s = PROMPTS, sampling(160)
    with engine(model_dir, KVConfig(block_size=32)) as dense, BlockUsageProbe(dense) as dense_probe:
        dense.generate(prompts, s)
    kv = KVConfig(policy="streamingllm", budget=32, interval=32, block_size=32)
    with engine(model_dir, kv) as sparse, BlockUsageProbe(sparse) as probe:
        batch = sparse.generate(prompts, s)
    per_req = -(-(kv.budget + kv.interval) // 32)  # worst case: budget + interval stored tokens
    print(f"peak blocks: sparse {probe.peak_blocks} dense {dense_probe.peak_blocks}")
    assert (batch.response_lens == 160).all()
    assert probe.peak_blocks <= len(prompts) * per_req
    assert dense_probe.peak_blocks >= len(prompts) * (-(-(21 + 160) // 32))
    # bounded: the usage of the last quarter of the run is no higher than that of its second quarter
    q = len(probe.blocks) // 4
    assert max(probe.blocks[3 * q:]) <= max(probe.blocks[q: 2 * q])


@pytest.fixture(scope="module")
def streaming_run(model_dir):
    kv = KVConfig(policy="streamingllm", budget=48, interval=24, sinks=4, block_size=32, record_keep=True)
    with engine(model_dir, kv) as e:
        batch = e.generate(PROMPTS[:2], sampling(150, n=2, seed=5))
    return kv, batch


def test_streamingllm_keeps_sinks_and_recent_window(streaming_run):
    kv, batch = streaming_run
    for i, rec in enumerate(batch.features.kv_keep):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        assert list(rec.lengths) == rule_compactions(p, r, kv.budget, kv.interval)
        assert rec.num_compactions >= 3 and not rec.preempted
        for tc, kept in zip(rec.lengths, rec.kept):
            want = list(range(kv.sinks)) + list(range(tc - (kv.budget - kv.sinks), tc))
            assert kept.shape[2] == kv.budget
            for row in kept.reshape(-1, kv.budget).tolist():
                assert row == want


def test_streamingllm_matches_transformers_reference(model_dir, streaming_run):
    kv, batch = streaming_run
    worst = 0.0
    for i in (0, 3):
        tokens, p = row_tokens(batch, i), int(batch.prompt_lens[i])
        events = []
        for tc in rule_compactions(p, len(tokens) - p, kv.budget, kv.interval):
            keep = list(range(kv.sinks)) + list(range(tc - (kv.budget - kv.sinks), tc))
            events.append((tc, [[keep] * 2] * 2))
        ref = hf_masked_logprobs(model_dir, tokens, mask_from_keeps(len(tokens), 2, 2, events))[p - 1:]
        got = batch.rollout_logprobs[i, : len(tokens) - p]
        worst = max(worst, (ref - got).abs().max().item())
    print(f"streamingllm: max |engine - HF masked| = {worst:.2e}")
    assert worst <= ATOL


@pytest.mark.parametrize("policy", ["rkv", "snapkv", "h2o"])
def test_score_policy_matches_transformers_with_its_record(model_dir, policy):
    kv = KVConfig(policy=policy, budget=40, interval=24, window=8, block_size=32, record_keep=True)
    with engine(model_dir, kv) as e:  # two samples per prompt: each pair compacts at the same steps, as one batch
        batch = e.generate(PROMPTS[1:3], sampling(120, n=2, seed=3))
        assert sparse_kv_timing(e)["compactions"] == sum(r.num_compactions for r in batch.features.kv_keep)
    worst = 0.0
    for i, rec in enumerate(batch.features.kv_keep):
        tokens, p = row_tokens(batch, i), int(batch.prompt_lens[i])
        assert list(rec.lengths) == rule_compactions(p, len(tokens) - p, kv.budget, kv.interval)
        events = [(tc, kept.tolist()) for tc, kept in zip(rec.lengths, rec.kept)]
        for tc, kept in events:  # every head keeps `budget` distinct earlier positions, its recent window included
            for li in range(2):
                for h in range(2):
                    k = kept[li][h]
                    assert len(set(k)) == kv.budget and max(k) < tc and set(range(tc - kv.window, tc)) <= set(k)
        heads_differ = any(e[1][0][0] != e[1][0][1] for e in events)
        assert heads_differ, "per-KV-head selection expected to differ between heads"
        qk, mask = {}, mask_from_keeps(len(tokens), 2, 2, events)
        ref = hf_masked_logprobs(model_dir, tokens, mask, qk)[p - 1:]
        worst = max(worst, (ref - batch.rollout_logprobs[i, : len(tokens) - p]).abs().max().item())
        if policy == "h2o":
            assert_h2o_keeps_heavy_hitters(kv, events, qk, mask)
        else:
            assert_keep_sets_follow_policy(policy, kv, events, qk)
    print(f"{policy}: max |engine - HF masked with its kv_keep| = {worst:.2e}")
    assert worst <= ATOL


def assert_keep_sets_follow_policy(policy, kv, events, qk):
    """At each compaction, the policy applied to the transformers reference's keys (of the entries the
    engine held, per KV head) and last `window` queries picks the positions the engine recorded."""
    from megatron_sparse_rl.kv.policies import select_keep

    prev = None
    for tc, kept in events:
        for li, (q, k) in qk.items():
            held = [sorted(set(range(tc)) if prev is None else set(prev[li][h]) | set(range(prev_tc, tc)))
                    for h in range(k.shape[0])]
            keys = torch.stack([k[h, held[h]] for h in range(k.shape[0])])
            keep = select_keep(policy, keys, q[:, tc - kv.window: tc], kv)
            for h in range(k.shape[0]):
                assert [held[h][j] for j in keep[h].tolist()] == kept[li][h], (policy, tc, li, h)
        prev, prev_tc = kept, tc


def assert_h2o_keeps_heavy_hitters(kv, events, qk, mask):
    """H2O written out here: at compaction t_c each KV head keeps the last `window` positions plus the
    held positions with the largest attention summed over every earlier query (each over what it saw,
    from the transformers reference) and over the head's query group."""
    prev = None
    for tc, kept in events:
        for li, (q, k) in qk.items():
            groups = q.shape[0] // k.shape[0]
            for h in range(k.shape[0]):
                held = sorted(set(range(tc)) if prev is None else set(prev[li][h]) | set(range(prev_tc, tc)))
                logits = q[h * groups:(h + 1) * groups, :tc].double() @ k[h, :tc].double().T / k.shape[-1] ** 0.5
                probs = logits.masked_fill(~mask[li, h, :tc, :tc], float("-inf")).softmax(-1)
                acc = probs.sum(dim=(0, 1))
                cand = held[: len(held) - kv.window]
                top = sorted(cand, key=lambda s: -acc[s].item())[: kv.budget - kv.window]
                assert sorted(top + held[-kv.window:]) == kept[li][h], (tc, li, h)
        prev, prev_tc = kept, tc


def test_small_pool_admission_control_and_preemption(model_dir):
    """12 long requests on a pool that holds only a few of them at their worst case."""
    prompts, s = [PROMPTS[i % 4] for i in range(6)], sampling(100, n=2, seed=9)
    base = dict(policy="streamingllm", budget=32, interval=32, block_size=32, pool_blocks=12)
    with engine(model_dir, KVConfig(**base), max_num_seqs=16, max_model_len=256) as e, BlockUsageProbe(e) as probe:
        batch = e.generate(prompts, s)
        stats = sparse_kv_stats(e)
    assert (batch.response_lens == 100).all() and stats["preemptions"] == 0 and stats["compactions"] >= 12
    assert not any(r.preempted for r in batch.features.kv_keep)
    assert probe.peak_blocks <= 11 and 2 <= probe.peak_running <= 5  # worst case 2 blocks per request
    with engine(model_dir, KVConfig(**base, admission_control=False), max_num_seqs=16, max_model_len=256) as e:
        loose = e.generate(prompts, s)
        loose_stats = sparse_kv_stats(e)
    print(f"admission control: {stats}; without: {loose_stats}")
    assert (loose.response_lens == 100).all() and loose_stats["preemptions"] > 0
    flagged = [r.preempted for r in loose.features.kv_keep]
    assert sum(flagged) <= loose_stats["preempted_compressed"]
    # a request preempted before any compaction is recomputed exactly: every unflagged row equals the
    # admission-controlled run token for token
    same = [i for i, f in enumerate(flagged) if not f]
    assert torch.equal(loose.response_ids[same], batch.response_ids[same])


def test_forced_preemption_of_compressed_requests_is_flagged(model_dir):
    """vLLM's forced preemption (reset_prefix_cache(reset_running_requests=True)) in the middle of a run:
    compressed requests are recomputed densely by vLLM, finish with full length, and are flagged."""
    prompts, s = PROMPTS[:3], sampling(120, seed=21)
    kv = KVConfig(policy="streamingllm", budget=32, interval=32, block_size=32, record_keep=True)
    with engine(model_dir, kv) as e:
        ref = e.generate(prompts, s)
        sched = e.scheduler()
        schedule, fired, before = sched.schedule, [], sched.msrl_stats["compactions"]

        def preempt_once(*args, **kwargs):
            if not fired and sched.msrl_stats["compactions"] >= before + 3 and sched.running:
                fired.append([r.request_id for r in sched.running if sched.msrl_dropped.get(r.request_id)])
                sched.reset_prefix_cache(reset_running_requests=True)
            return schedule(*args, **kwargs)

        sched.schedule = preempt_once
        try:
            got = e.generate(prompts, s)
        finally:
            del sched.schedule
    assert fired and fired[0], "no compressed request was running when the preemption fired"
    assert (got.response_lens == 120).all()
    flagged = [r.preempted for r in got.features.kv_keep]
    assert sum(flagged) == len(fired[0])
    for i, f in enumerate(flagged):
        if not f:
            assert torch.equal(got.response_ids[i], ref.response_ids[i])
        else:  # identical up to the first compaction after the preemption, then a dense-recomputed cache
            first = got.features.kv_keep[i].lengths[0] - int(got.prompt_lens[i])
            assert torch.equal(got.response_ids[i, :first], ref.response_ids[i, :first])
