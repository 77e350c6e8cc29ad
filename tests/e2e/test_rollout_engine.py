"""RolloutEngine against transformers on tiny random models (Qwen3-MoE and dense Qwen3), real vLLM on CPU.

One engine per architecture (module-scoped, parametrised), fp32. Checks: prompt logprobs equal HF's
log_softmax; generation shapes/group ids/finish reasons; greedy equals HF greedy; load_weights of a model
with other weights gives that model's logprobs (and, for MoE, is wrong without the CPU repack patch).
Run: .venv/bin/python -m pytest -q tests/e2e/test_rollout_engine.py
"""
import pytest
import torch

from megatron_sparse_rl.config.rollout import RolloutConfig, SamplingConfig
from megatron_sparse_rl.models.tiny import build_tiny_hf_model

pytestmark = pytest.mark.e2e

# fp32 max |vLLM - HF| measured on these models: ~2.4e-6 (MoE), ~1e-6 (dense); margin for other CPUs/ISAs.
ATOL = 2e-5
SEQS = [
    [1, 5, 6, 14, 11, 18, 22, 20, 27, 21, 19, 5, 13],  # "<bos>12+7=?\na: 19"-like
    [1, 43, 21, 19, 9, 7, 15, 4, 4, 18, 22, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
]


def hf_logprobs(model_dir, seqs, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            logp = model(torch.tensor([s])).logits[0].float().log_softmax(-1)
            out.append(logp[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3"])
def setup(request, tmp_path_factory):
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    root = tmp_path_factory.mktemp(request.param)
    base = build_tiny_hf_model(root / "seed0", arch=request.param, seed=0)
    other = build_tiny_hf_model(root / "seed1", arch=request.param, seed=1)
    vllm_cpu.apply()
    engine = RolloutEngine(base, RolloutConfig(max_model_len=256, max_num_seqs=8, kv_cache_gb=1))
    yield request.param, engine, base, other
    engine.shutdown()


def test_prompt_logprobs_match_transformers(setup):
    arch, engine, base, _ = setup
    diff = max_diff(engine.prompt_logprobs(SEQS), hf_logprobs(base, SEQS))
    print(f"{arch}: max |prompt logprob vLLM - HF| = {diff:.2e}")
    assert diff < ATOL


def test_generate_groups_shapes_and_logprobs(setup):
    _, engine, _, _ = setup
    prompts = [SEQS[0][:5], SEQS[1][:3], SEQS[0][:2]]
    batch = engine.generate(prompts, SamplingConfig(n=2, max_tokens=6, seed=7), group_ids=[40, 41, 42])
    assert len(batch) == 6
    assert batch.group_ids.tolist() == [40, 40, 41, 41, 42, 42]
    assert batch.prompts() == [p for p in prompts for _ in range(2)]
    assert batch.response_ids.shape == batch.rollout_logprobs.shape == batch.response_mask.shape
    assert batch.response_ids.shape[1] <= 6 and (batch.response_lens >= 1).all()
    assert set(batch.finish_reasons) <= {"stop", "length"}
    for row, length, reason in zip(batch.responses(), batch.response_lens.tolist(), batch.finish_reasons):
        assert (reason == "length") == (length == 6 and row[-1] != 2)
    lp = batch.rollout_logprobs[batch.response_mask]
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    assert (batch.rollout_logprobs[~batch.response_mask] == 0).all()
    # the KV pool while sampling: at least the longest sample's blocks, at most every sample's blocks at once
    bs = engine._llm.llm_engine.vllm_config.cache_config.block_size
    need = [-(-(len(p) + len(r)) // bs) for p, r in zip(batch.prompts(), batch.responses())]
    usage = batch.kv_usage
    assert max(need) <= usage["peak_blocks"] <= sum(need) < usage["pool_blocks"], (usage, need)
    assert 1 <= usage["mean_running"] <= len(batch) and usage["preemptions"] == 0
    # same seed -> same samples; the two samples of a prompt use different seeds
    again = engine.generate(prompts, SamplingConfig(n=2, max_tokens=6, seed=7), group_ids=[40, 41, 42])
    assert torch.equal(again.response_ids, batch.response_ids)
    assert batch.responses()[0] != batch.responses()[1] or batch.responses()[2] != batch.responses()[3]


def test_rescore_once_equals_the_samplers_logprobs_and_transformers(setup):
    """algorithm.old_logprobs = engine_mean's input: n engine scorings of each sampled sequence. At temperature 1
    on a dense engine one scoring equals the sampler's own logprobs (engine_mean with n = 1 is engine) and the
    transformers forward; the re-scorings are deterministic on CPU."""
    _, engine, base, _ = setup
    prompts = [SEQS[0][:5], SEQS[1][:3]]
    batch = engine.generate(prompts, SamplingConfig(n=2, max_tokens=6, seed=3))
    r = engine.rescore(batch, 2)
    assert r.shape == (len(batch), 2, batch.response_ids.shape[1])
    assert (r[~batch.response_mask.unsqueeze(1).expand_as(r)] == 0).all()
    mask = batch.response_mask
    assert max_diff(r[:, 0][mask], batch.rollout_logprobs[mask]) < ATOL
    assert torch.equal(r[:, 0], r[:, 1])
    seqs = [p + q for p, q in zip(batch.prompts(), batch.responses())]
    hf = hf_logprobs(base, seqs)
    for i, seq in enumerate(seqs):
        n = int(mask[i].sum())
        assert max_diff(r[i, 0, :n], hf[i][-n:]) < ATOL
    assert batch.rescored_logprobs is None  # sampling alone adds none (placement/rollout.py RolloutRequest does)


def hf_processed_logprobs(model_dir, seqs, temperature, top_k):
    """HF reference of vLLM's processed logprobs: log_softmax(logits / T) renormalised over the top-k."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(torch.tensor([s])).logits[0].float() / temperature
            if top_k > 0:
                kth = logits.topk(top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            logp = logits.log_softmax(-1)
            out.append(logp[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


@pytest.mark.parametrize("temperature, top_k", [(1.0, -1), (0.7, 5)])
def test_sampled_logprobs_are_the_sampling_distribution(setup, temperature, top_k):
    """rollout_logprobs are the sampled tokens' logprobs under the distribution sampled from."""
    _, engine, base, _ = setup
    batch = engine.generate([SEQS[0][:4]], SamplingConfig(n=2, max_tokens=6, seed=1, temperature=temperature,
                                                          top_k=top_k))
    tokens, attn, _ = batch.sequences()
    seqs = [t[a].tolist() for t, a in zip(tokens, attn)]
    ref = hf_processed_logprobs(base, seqs, temperature, top_k)
    for i, r in enumerate(ref):
        got = batch.rollout_logprobs[i][batch.response_mask[i]]
        assert torch.allclose(got, r[-len(got):], atol=ATOL), (got, r)


def test_greedy_is_deterministic_and_matches_transformers(setup):
    from transformers import AutoModelForCausalLM

    _, engine, base, _ = setup
    prompt = SEQS[0][:6]
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=8)
    first = engine.generate([prompt], greedy).responses()[0]
    assert engine.generate([prompt], greedy).responses()[0] == first
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=2,
                             pad_token_id=0)
    assert first == out[0, len(prompt):].tolist()


def test_load_weights_gives_the_new_model(setup):
    from safetensors.torch import load_file

    from megatron_sparse_rl.patches import vllm_cpu_moe_reload

    arch, engine, base, other = setup
    ref_base, ref_other = hf_logprobs(base, SEQS), hf_logprobs(other, SEQS)
    assert max_diff(ref_base, ref_other) > 0.5  # the two models really differ
    new = load_file(other / "model.safetensors")
    if arch == "qwen3_moe":
        vllm_cpu_moe_reload.revert()
        try:
            engine.load_weights(new.items())
            unpatched = max_diff(engine.prompt_logprobs(SEQS), ref_other)
        finally:
            vllm_cpu_moe_reload.apply()
        print(f"{arch}: without the repack patch, max |dlogprob| after reload = {unpatched:.2e}")
        assert unpatched > 0.1  # experts left in the unpacked layout: silently wrong
    engine.load_weights(new.items())
    diff = max_diff(engine.prompt_logprobs(SEQS), ref_other)
    print(f"{arch}: after load_weights, max |dlogprob| vs the new HF model = {diff:.2e}")
    assert diff < ATOL
    engine.load_weights(load_file(base / "model.safetensors").items())  # and back
    assert max_diff(engine.prompt_logprobs(SEQS), ref_base) < ATOL


def test_apply_model_reaches_the_in_process_model(setup):
    arch, engine, _, _ = setup
    name = engine.apply_model(lambda model: type(model).__name__)
    assert name == {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]


def test_too_long_prompt_is_rejected_before_vllm(setup):
    _, engine, _, _ = setup
    with pytest.raises(ValueError, match=r"prompt 1: needs 1 <= length and length \+ max_tokens <= rollout.max_model_len"):
        engine.generate([[1, 5], [1] * 250], SamplingConfig(n=1, max_tokens=10))
