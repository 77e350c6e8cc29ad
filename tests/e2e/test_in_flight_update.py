"""In-flight weight updates (asynchronous RL's partial rollouts) in a real vLLM engine, against transformers.

A tiny Qwen3-MoE engine (fp32) samples while, after a few engine steps, new weights (another random model) are
loaded between two steps without draining the running requests. Checks, per sample: `token_version` says which
weights sampled each token (0 before the update, 1 after; some samples hold both); the tokens of version 0 have
the logprobs of the old model; the tokens of version 1 have the logprobs of
- the new model over the whole sequence when the running requests' KV is recomputed (`recompute=True`),
- a transformers forward that reuses the old model's KV cache of everything computed before the update and runs
  the new model from there, when the KV is kept (the default).
Run: .venv/bin/python -m pytest -q tests/e2e/test_in_flight_update.py
"""
import pytest
import torch

from megatron_sparse_rl.config.rollout import RolloutConfig, SamplingConfig
from megatron_sparse_rl.models.tiny import build_tiny_hf_model

pytestmark = pytest.mark.e2e

ATOL = 5e-5  # fp32 vLLM vs transformers on this model: ~2.4e-6 (tests/e2e/test_rollout_engine.py)
UPDATE_AFTER = 6  # engine steps before the new weights arrive
PROMPTS = [[1, 5, 6, 14, 11], [1, 43, 21], [1, 9, 7, 15, 4, 4]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    root = tmp_path_factory.mktemp("in_flight")
    old, new = build_tiny_hf_model(root / "old", seed=0), build_tiny_hf_model(root / "new", seed=1)
    vllm_cpu.apply()
    engine = RolloutEngine(old, RolloutConfig(max_model_len=256, max_num_seqs=8, kv_cache_gb=1))
    hf = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (old, new)]
    yield engine, old, new, hf
    engine.shutdown()


def _sample_with_update(engine, old, new, *, recompute: bool):
    from safetensors.torch import load_file

    steps = [0]
    weights = load_file(new / "model.safetensors")

    def between_steps():
        steps[0] += 1
        if steps[0] == UPDATE_AFTER:
            engine.update_in_flight(lambda: engine.load_weights(weights.items(), version=1), version=1,
                                    recompute=recompute)

    assert engine.weight_version == 0
    try:
        batch = engine.generate(PROMPTS, SamplingConfig(n=2, max_tokens=20, seed=3), between_steps=between_steps)
    finally:  # the engine goes back to the old model for the next test
        engine.load_weights(load_file(old / "model.safetensors").items(), version=0)
    return batch


def _logprobs(model, seq: list[int], start: int, *, past=None) -> torch.Tensor:
    """log p(seq[t] | seq[:t]) for t >= start, with `past` (a cache of seq[:k], k < start) when given."""
    with torch.no_grad():
        if past is None:
            logits = model(torch.tensor([seq])).logits[0]
            first = 0
        else:
            first = past.get_seq_length()
            logits = model(torch.tensor([seq[first:]]), past_key_values=past).logits[0]
    logp = logits.float().log_softmax(-1)
    return logp[start - 1 - first:len(seq) - 1 - first].gather(-1, torch.tensor(seq[start:])[:, None])[:, 0]


def _old_cache(model, seq: list[int], upto: int):
    with torch.no_grad():
        return model(torch.tensor([seq[:upto]]), use_cache=True).past_key_values


@pytest.mark.parametrize("recompute", [False, True], ids=["kv_kept", "kv_recomputed"])
def test_partial_rollouts_carry_two_versions_with_each_versions_logprobs(setup, recompute):
    engine, old, new, (hf_old, hf_new) = setup
    batch = _sample_with_update(engine, old, new, recompute=recompute)
    assert batch.token_version is not None and batch.token_version.shape == batch.response_ids.shape
    spans, worst = 0, 0.0
    for i, (prompt, response) in enumerate(zip(batch.prompts(), batch.responses())):
        n = len(response)
        versions = batch.token_version[i, :n]
        assert set(versions.tolist()) <= {0, 1} and (versions.diff() >= 0).all()  # one switch, old -> new
        cut = int((versions == 0).sum())  # tokens sampled before the update
        seq, lp = prompt + response, batch.rollout_logprobs[i, :n]
        p = len(prompt)
        if cut:
            worst = max(worst, (lp[:cut] - _logprobs(hf_old, seq, p)[:cut]).abs().max().item())
        if cut < n:
            if recompute or cut == 0:  # (cut 0: not prefilled before the update)
                want = _logprobs(hf_new, seq, p + cut)
            else:  # the KV of the prompt and the first cut - 1 tokens was written by the old weights
                want = _logprobs(hf_new, seq, p + cut, past=_old_cache(hf_old, seq, p + cut - 1))
            worst = max(worst, (lp[cut:] - want).abs().max().item())
        spans += 0 < cut < n
    print(f"recompute={recompute}: {spans} of {len(batch)} samples span the update; max |engine - reference| "
          f"{worst:.2e}")
    assert spans >= 2, batch.token_version
    assert worst < ATOL


def test_update_in_flight_outside_generate_is_refused(setup):
    engine = setup[0]
    with pytest.raises(RuntimeError, match="between engine steps"):
        engine.update_in_flight(lambda: None, version=1)


def test_sparse_kv_compacts_and_frees_blocks_across_an_in_flight_update(tmp_path):
    """StreamingLLM (budget 32, interval 32) on 120-token samples, new weights after 50 engine steps, KV kept: the
    tokens before the update are those of the same run without it (same seeds), the compactions follow the
    length rule before and after it, the pool stays bounded, and the later tokens come from the new weights."""
    from safetensors.torch import load_file

    from megatron_sparse_rl.config.rollout import KVConfig
    from megatron_sparse_rl.rollout.block_usage import BlockUsageProbe
    from tests.e2e.test_sparse_kv import PROMPTS as LONG_PROMPTS
    from tests.e2e.test_sparse_kv import engine as sparse_engine
    from tests.e2e.test_sparse_kv import rule_compactions, sampling

    old, new = build_tiny_hf_model(tmp_path / "old", seed=0), build_tiny_hf_model(tmp_path / "new", seed=1)
    weights = load_file(new / "model.safetensors")
    kv = KVConfig(policy="streamingllm", budget=32, interval=32, block_size=32, record_keep=True)
    steps = [0]

    def between_steps():
        steps[0] += 1
        if steps[0] == 50:
            engine.update_in_flight(lambda: engine.load_weights(weights.items(), version=1), version=1)

    with sparse_engine(old, kv) as engine:
        ref = engine.generate(LONG_PROMPTS, sampling(120))
        with BlockUsageProbe(engine) as probe:
            got = engine.generate(LONG_PROMPTS, sampling(120), between_steps=between_steps)
    per_request = -(-(kv.budget + kv.interval) // kv.block_size)
    assert probe.peak_blocks <= len(LONG_PROMPTS) * per_request
    after_update = 0
    for i, record in enumerate(got.features.kv_keep):
        p, r = int(got.prompt_lens[i]), int(got.response_lens[i])
        cut = int((got.token_version[i, :r] == 0).sum())
        assert 0 < cut < r == 120
        assert torch.equal(got.response_ids[i, :cut], ref.response_ids[i, :cut])
        assert torch.equal(got.rollout_logprobs[i, :cut], ref.rollout_logprobs[i, :cut])
        assert list(record.lengths) == rule_compactions(p, r, kv.budget, kv.interval)
        after_update += sum(length > p + cut for length in record.lengths)
        assert not torch.allclose(got.rollout_logprobs[i, cut:r], ref.rollout_logprobs[i, cut:r])
    assert after_update >= len(LONG_PROMPTS)  # every sample compacted again under the new weights
