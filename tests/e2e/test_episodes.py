"""Multi-turn episodes on a real vLLM engine (tiny Qwen3-MoE, fp32, CPU, prefix caching on) against transformers.

A two-turn environment answers the first model turn with a fixed observation and ends the episode after the second
turn. Checks: the engine's logprobs of the model's tokens equal an HF transformers forward over the whole
concatenated sequence (prompt, turn 1, observation, turn 2) within 1e-4; the loss mask equals one built by hand
from where the observation sits; the second turn reuses the first turn's KV blocks from vLLM's prefix cache, so
what it prefills again is less than one block per episode.
Run: .venv/bin/python -m pytest -q tests/e2e/test_episodes.py
"""
import pytest
import torch

from megatron_sparse_rl.config.env import EnvConfig
from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig, SamplingConfig
from megatron_sparse_rl.envs.base import Environment, StepResult
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests.e2e.test_rollout_engine import SEQS, hf_logprobs, max_diff

pytestmark = pytest.mark.e2e

ATOL = 1e-4
BLOCK = 32
OBSERVATION = "r: 36\na: "


class TwoTurns(Environment):
    """Turn 1 -> OBSERVATION; turn 2 -> done with reward 1."""

    def reset(self, sample):
        self.turns = 0
        return tuple(sample)

    def step(self, turn):
        self.turns += 1
        return StepResult(observation=OBSERVATION, reward=float(self.turns == 2), done=self.turns == 2,
                          tool_calls=int(self.turns == 1))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_sparse_rl.data.datasets import load_tokenizer
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    base = build_tiny_hf_model(tmp_path_factory.mktemp("episodes") / "moe", arch="qwen3_moe", seed=0)
    vllm_cpu.apply()
    engine = RolloutEngine(base, RolloutConfig(max_model_len=256, max_num_seqs=8, kv_cache_gb=1, prefix_caching=True,
                                               kv=KVConfig(block_size=BLOCK)))
    yield engine, base, load_tokenizer(base)
    engine.shutdown()


def test_two_turn_episode_logprobs_and_loss_mask_match_transformers(setup):
    from megatron_sparse_rl.rollout.episodes import run_episodes

    engine, base, tok = setup
    prompts = [SEQS[0] * 3, SEQS[1] * 2]  # 39 and 44 tokens: at least one full block cached after turn 1
    env = EnvConfig(kind="tools", max_turns=3, max_total_tokens=100)
    batch = run_episodes(engine, tok, prompts, SamplingConfig(n=2, max_tokens=12, seed=11), env, TwoTurns)
    assert len(batch) == 4 and batch.finish_reasons == ("stop",) * 4 and batch.reward.tolist() == [1.0] * 4
    obs = tok(OBSERVATION, add_special_tokens=False)["input_ids"]
    seqs = [p + r for p, r in zip(batch.prompts(), batch.responses())]
    reference = hf_logprobs(base, seqs)
    worst = 0.0
    for i, response in enumerate(batch.responses()):
        # the hand-built mask: the observation's tokens sit after turn 1 (the first place they occur as a whole)
        start = next(j for j in range(len(response)) if response[j:j + len(obs)] == obs)
        hand = [True] * start + [False] * len(obs) + [True] * (len(response) - start - len(obs))
        assert batch.loss_mask[i][:len(response)].tolist() == hand and not batch.loss_mask[i][len(response):].any()
        model = torch.tensor(hand)
        engine_lp = batch.rollout_logprobs[i][:len(response)][model]
        hf_lp = reference[i][-len(response):][model]  # reference[i][t] scores token t + 1 of the sequence
        worst = max(worst, max_diff([engine_lp], [hf_lp]))
        assert worst < ATOL, (i, engine_lp, hf_lp)
        assert (batch.rollout_logprobs[i][:len(response)][~model] == 0).all()
    ep = batch.episodes
    print(f"max |engine - HF| over model tokens = {worst:.2e}; episode sums {ep}")
    assert ep["turns"] == 8 and ep["tool_calls"] == 4 and ep["turn2/episodes"] == 4
    assert ep["env_tokens"] == 4 * len(obs) and ep["model_tokens"] == float(batch.loss_mask.sum())
    # turn 2 found turn 1's full blocks in the prefix cache: less than one block per episode prefilled again
    assert ep["cached_tokens"] >= 4 * BLOCK and ep["reprefill_tokens"] < 4 * BLOCK, ep
