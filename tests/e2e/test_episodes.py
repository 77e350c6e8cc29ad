"""Multi-turn episodes on a real vLLM engine (tiny Qwen3-MoE, fp32, CPU, prefix caching on) against transformers.

A two-turn environment answers the first model turn with a fixed observation and ends the episode after the second
turn. Checks: the engine's logprobs of the model's tokens equal an HF transformers forward over the whole
concatenated sequence (prompt, turn 1, observation, turn 2) within 1e-4; the loss mask equals one built by hand
from where the observation sits; the second turn reuses the first turn's KV blocks from vLLM's prefix cache, so
what it prefills again is less than one block per episode; the engine's re-scoring of each episode as one sequence
(algorithm.old_logprobs = engine_mean) gives the same logprobs of the model's tokens within 1e-4. With R3 route capture on the same engine: the routes the
episode recorded (each position from the turn that first computed it; turn 1's prefix served from the prefix cache
in turn 2 is not computed again) equal those of one prefill of each whole concatenated sequence by the same engine
with its prefix cache emptied, for every position and MoE layer; a Megatron learner (R3) replays them in the old
forward and in a training step on the episode batch (replay applied to every router call) and, replaying them,
reproduces the engine's logprobs of the model's tokens. With the sampling-support record (top-k 5): the support
recorded at each model token is the top 5 of a transformers forward over the whole sequence, environment tokens have
none (count 0), and a learner with algorithm.keep_sampling_mask reproduces the engine's top-k logprobs as pi_old.
Run: .venv/bin/python -m pytest -q tests/e2e/test_episodes.py
"""
import dataclasses

import pytest
import torch

from megatron_sparse_rl.config.env import EnvConfig
from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig, SamplingConfig
from megatron_sparse_rl.envs.base import Environment, StepResult
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests.e2e.test_rollout_engine import SEQS, hf_logprobs, max_diff
from tests.spawn import run_distributed

pytestmark = pytest.mark.e2e
PROMPTS = [SEQS[0] * 3, SEQS[1] * 2]  # 39 and 44 tokens: at least one full block cached after turn 1
ENV = EnvConfig(kind="tools", max_turns=3, max_total_tokens=100)

ATOL = 1e-4
BLOCK = 32
OBSERVATION = "r: 36\na: "
TOP_K = 5


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
    from megatron_sparse_rl.rollout.multi_turn import run_episodes

    engine, base, tok = setup
    batch = run_episodes(engine, tok, PROMPTS, SamplingConfig(n=2, max_tokens=12, seed=11), ENV, TwoTurns)
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
    # algorithm.old_logprobs = engine_mean: the engine re-scores each episode as one sequence (its prefill)
    rescored = engine.rescore(batch, 2)
    for i, response in enumerate(batch.responses()):
        model = batch.loss_mask[i][:len(response)]
        for j in range(2):
            assert max_diff([rescored[i, j, :len(response)][model]], [reference[i][-len(response):][model]]) < ATOL
    ep = batch.episode_stats
    print(f"max |engine - HF| over model tokens = {worst:.2e}; episode sums {ep}")
    assert ep["turns"] == 8 and ep["tool_calls"] == 4 and ep["turn2/episodes"] == 4
    assert ep["env_tokens"] == 4 * len(obs) and ep["model_tokens"] == float(batch.loss_mask.sum())
    # turn 2 found turn 1's full blocks in the prefix cache: less than one block per episode prefilled again
    assert ep["cached_tokens"] >= 4 * BLOCK and ep["reprefill_tokens"] < 4 * BLOCK, ep


def learner_worker(rank, world_size, model_dir, batch, mode, keep_mask):
    """A Megatron learner (routing `mode`, algorithm.keep_sampling_mask = `keep_mask`) on the episode batch: the old
    forward, then one training step."""
    from megatron_sparse_rl.config.algorithm import AlgorithmConfig
    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.training import update as U
    from tests.distributed.test_routing import _learner

    learner = _learner(world_size, model_dir, routing=RoutingConfig(mode=mode))
    algorithm = AlgorithmConfig(keep_sampling_mask=keep_mask)
    prep = U.prepare(learner, batch, algorithm, pad_id=0, dp_group=None)
    step = U.update(learner, prep, algorithm, updates=1, dp_group=None)
    diff = ((prep.old_logprobs - prep.rollout_logprobs).abs() * prep.mask).max()
    return prep.metrics, step, float(diff), int(prep.mask.sum())


def test_r3_routes_across_turns_equal_one_prefill_and_the_learner_replays_them(setup):
    from megatron_sparse_rl.rollout.multi_turn import run_episodes
    from megatron_sparse_rl.rollout.routes import EngineRouteCapture

    engine, base, tok = setup
    capture = EngineRouteCapture()
    engine.add_extension(capture)
    try:
        engine.reset_prefix_cache()  # turn 1 computes every prompt position (the other test cached these prompts)
        batch = run_episodes(engine, tok, PROMPTS, SamplingConfig(n=2, max_tokens=12, seed=5), ENV, TwoTurns)
        seqs = [p + r for p, r in zip(batch.prompts(), batch.responses())]
        engine.reset_prefix_cache()  # the reference computes every position of the whole sequence in one prefill
        ref = engine.generate(seqs, SamplingConfig(n=1, max_tokens=1, temperature=0.0)).features.routed_experts
    finally:
        engine.remove_extension(capture)
    assert batch.episode_stats["cached_tokens"] >= 4 * BLOCK, batch.episode_stats  # turn 2 took turn 1's blocks from the cache
    routes = batch.features.routed_experts
    assert len(routes) == 4 and routes.layers == ref.layers and routes.layers
    for i, seq in enumerate(seqs):
        got, want = routes.sequence(i), ref.sequence(i)[:len(seq) - 1]
        assert got.shape[0] == len(seq) - 1
        diff = (got.sort(dim=-1).values != want.sort(dim=-1).values).any(dim=-1)  # [positions, layers]
        assert not diff.any(), (i, diff.nonzero().tolist())
    batch = dataclasses.replace(batch, reward=torch.tensor([1.0, 0.0, 0.0, 1.0]))  # advantages of both signs: a step that moves the weights
    old, step, diff, tokens = run_distributed(learner_worker, 1, args=(str(base), batch, "R3", False),
                                              timeout=300)[0]
    print(f"R3 over episodes: {tokens} model tokens, max |learner(replayed) - engine| logprob {diff:.2e}; old forward "
          f"{ {k: v for k, v in old.items() if k.startswith('routing/')} }; step "
          f"{ {k: v for k, v in step.items() if k.startswith(('routing/', 'train/grad_norm'))} }")
    assert old["routing/replay_applied_fraction"] == 1.0 == step["routing/replay_applied_fraction"]
    assert old["routing/flipped_token_fraction"] == 0.0  # the fp32 learner's own routers choose the same experts
    assert diff < ATOL and tokens == int(batch.loss_mask.sum())


def test_sampling_support_across_turns_is_the_top_k_and_the_learner_renormalises_over_it(setup):
    from transformers import AutoModelForCausalLM

    from megatron_sparse_rl.rollout.multi_turn import run_episodes
    from megatron_sparse_rl.rollout.sampling_mask import SamplingMaskCapture

    engine, base, tok = setup
    capture = SamplingMaskCapture()
    engine.add_extension(capture)
    try:
        batch = run_episodes(engine, tok, PROMPTS, SamplingConfig(n=2, max_tokens=12, seed=7, top_k=TOP_K), ENV,
                             TwoTurns)
    finally:
        engine.remove_extension(capture)
    support = batch.features.sampling_mask
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    for i, (prompt, response) in enumerate(zip(batch.prompts(), batch.responses())):
        assert int(support.prompt_lens[i]) == len(prompt) and len(support.counts[i]) == len(response)
        with torch.no_grad():  # the reference: the top-k ids of an fp32 transformers forward over the whole sequence
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
        want = [sorted(logits[j].topk(TOP_K).indices.tolist()) if m else [] for j, m in
                enumerate(batch.loss_mask[i][:len(response)].tolist())]
        counts = support.counts[i].tolist()
        ids = support.ids[i].split(counts)
        assert [sorted(x.tolist()) for x in ids] == want, i  # environment tokens: count 0 (no sampler ran)
    batch = dataclasses.replace(batch, reward=torch.tensor([1.0, 0.0, 0.0, 1.0]))
    old, step, diff, tokens = run_distributed(learner_worker, 1, args=(str(base), batch, "off", True),
                                              timeout=300)[0]
    print(f"sampling support over episodes: {tokens} model tokens, max |learner pi_old over the support - engine "
          f"top-{TOP_K} logprob| {diff:.2e}; step grad norm {step['train/grad_norm']:.3f}")
    assert diff < ATOL and tokens == int(batch.loss_mask.sum()) and step["train/grad_norm"] > 0
