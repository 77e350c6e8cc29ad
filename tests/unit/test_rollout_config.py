"""Rollout config validation (errors name the dotted field) and RolloutBatch bookkeeping; no vLLM."""
import pytest
import torch

from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig, SamplingConfig
from megatron_sparse_rl.rollout.batch import RolloutBatch, pad_rows


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=1.5), "rollout.sampling.top_p must be in (0, 1] (got 1.5)"),
    (dict(top_p=0.0), "rollout.sampling.top_p must be in (0, 1] (got 0.0)"),
    (dict(n=0), "rollout.sampling.n must be >= 1 (got 0)"),
    (dict(temperature=-0.1), "rollout.sampling.temperature must be >= 0 (got -0.1)"),
    (dict(top_k=0), "rollout.sampling.top_k must be -1 (off) or in [1, 16777216] (got 0)"),
    (dict(max_tokens=0), "rollout.sampling.max_tokens must be >= 1 (got 0)"),
    (dict(stop=("",)), "rollout.sampling.stop must be a tuple of non-empty strings (got ('',))"),
    (dict(seed=-1), "rollout.sampling.seed must be None or in [0, 9223372036854775807] (got -1)"),
])
def test_sampling_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingConfig(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="lru"), "rollout.kv.policy must be one of ['none', 'rkv', 'snapkv', 'h2o', 'streamingllm'] (got 'lru')"),
    (dict(budget=4, window=8), "rollout.kv.budget must be >= window (got 4 < 8)"),
    (dict(interval=0), "rollout.kv.interval must be >= 1 (got 0)"),
])
def test_kv_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        KVConfig(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float16"), "rollout.dtype must be one of ['float32', 'bfloat16'] (got 'float16')"),
    (dict(kv_cache_gb=0), "rollout.kv_cache_gb must be None or in [1, 65536] (got 0)"),
    (dict(gpu_memory_utilization=1.5), "rollout.gpu_memory_utilization must be in (0, 1] (got 1.5)"),
    (dict(max_num_seqs=0), "rollout.max_num_seqs must be >= 1 (got 0)"),
    (dict(logprobs_mode="logits"), "rollout.logprobs_mode must be one of ['processed', 'raw'] (got 'logits')"),
    (dict(max_model_len=64, sampling=SamplingConfig(max_tokens=64)),
     "rollout.sampling.max_tokens must be < rollout.max_model_len (got 64 >= 64)"),
    (dict(max_model_len=1), "rollout.max_model_len must be None (from the model) or in [2, 16777216] (got 1)"),
])
def test_rollout_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        RolloutConfig(**kwargs)
    assert str(err.value) == message


def test_max_model_len_defaults_to_the_model_and_is_checked_once_resolved():
    """None until validation/validate.py resolves it from the model (tests/unit/test_config_validate.py), so max_tokens
    has nothing to be compared with here yet."""
    assert RolloutConfig().max_model_len is None
    assert RolloutConfig(sampling=SamplingConfig(max_tokens=100_000)).max_model_len is None


def test_config_is_frozen_and_keyword_only():
    cfg = RolloutConfig()
    with pytest.raises(AttributeError):
        cfg.dtype = "bfloat16"
    with pytest.raises(TypeError):
        SamplingConfig(4)


def _batch() -> RolloutBatch:
    responses = [[5, 6, 2], [7], [8, 9]]
    logprobs = [[-0.1, -0.2, -0.3], [-1.0], [-0.5, -0.6]]
    lens = torch.tensor([3, 1, 2])
    ids = pad_rows(responses, 0, torch.long)
    return RolloutBatch(
        prompt_ids=pad_rows([[1, 3], [1, 3], [1, 4, 4]], 0, torch.long), prompt_lens=torch.tensor([2, 2, 3]),
        response_ids=ids, response_mask=torch.arange(3)[None] < lens[:, None],
        rollout_logprobs=pad_rows(logprobs, 0.0, torch.float32),
        finish_reasons=("stop", "length", "length"), group_ids=torch.tensor([0, 0, 1]))


def test_batch_sequences_and_select():
    b = _batch()
    assert len(b) == 3 and b.response_lens.tolist() == [3, 1, 2]
    tokens, attn, resp = b.sequences()
    assert tokens.tolist() == [[1, 3, 5, 6, 2], [1, 3, 7, 0, 0], [1, 4, 4, 8, 9]]
    assert attn.sum(1).tolist() == [5, 3, 5]
    assert resp[0].tolist() == [False, False, True, True, True] and resp[2].tolist() == [False] * 3 + [True] * 2
    # response positions line up with rollout_logprobs on the mask
    assert torch.equal(tokens[resp], b.response_ids[b.response_mask])
    sub = b.select([2, 0])
    assert sub.responses() == [[8, 9], [5, 6, 2]] and sub.finish_reasons == ("length", "stop")
    assert sub.group_ids.tolist() == [1, 0]


def test_batch_select_subsets_the_engine_routes():
    from megatron_sparse_rl.moe.storage import RouteStore

    b = _batch()
    per_seq = [torch.full((n, 2, 2), i, dtype=torch.long) for i, n in enumerate([4, 2, 4])]  # prompt + response - 1
    routes = RouteStore.from_sequences(per_seq, [list(range(n)) for n in (4, 2, 4)], num_experts=8, layers=(0, 1),
                                       source="engine")
    sub = b.with_features(routed_experts=routes).select([2, 0])
    assert len(sub.features.routed_experts) == 2
    assert torch.equal(sub.features.routed_experts.sequence(0).long(), per_seq[2])
    assert torch.equal(sub.features.routed_experts.sequence(1).long(), per_seq[0])


def test_batch_rejects_inconsistent_shapes():
    b = _batch()
    with pytest.raises(ValueError, match="RolloutBatch.rollout_logprobs must have shape"):
        RolloutBatch(prompt_ids=b.prompt_ids, prompt_lens=b.prompt_lens, response_ids=b.response_ids,
                     response_mask=b.response_mask, rollout_logprobs=b.rollout_logprobs[:, :2],
                     finish_reasons=b.finish_reasons, group_ids=b.group_ids)
