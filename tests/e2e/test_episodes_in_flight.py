"""New weights in the middle of a multi-turn episode (asynchronous RL with env.kind), on a real vLLM engine against
transformers.

A tiny Qwen3-MoE engine (fp32, CPU, prefix caching on, 32-token blocks) runs two-turn episodes (tests/e2e/
test_episodes.py's `TwoTurns`: turn 1, a fixed observation, turn 2) while another random model's weights arrive as
version 1:
- between the turns (loaded after turn 1 returned, as a rollout rank does when idle): turn 1's tokens carry version
  0 and the old model's logprobs over the whole sequence; the observation and turn 2 carry version 1 and turn 2's
  logprobs are the NEW model's over the whole sequence (loading emptied the prefix cache, so turn 2's prefill of
  the history ran under the new weights);
- in the middle of turn 2 (`between_steps` -> `update_in_flight`, the running requests' KV recomputed): turn 1, the
  observation and turn 2's tokens before the update carry version 0 and the old model's logprobs, the later ones
  version 1 and the new model's, each over the whole sequence;
- in the middle of turn 1 with its KV kept: turn 2 has the new model's logprobs over the whole sequence, because
  the engine empties the prefix cache after a turn during which weights arrived (without that, turn 2 reused the
  old weights' blocks and was off by 5.3 nats).
Run: .venv/bin/python -m pytest -q tests/e2e/test_episodes_in_flight.py
"""
import pytest
import torch

from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig, SamplingConfig
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests.e2e.test_episodes import ENV, OBSERVATION, PROMPTS, TwoTurns
from tests.e2e.test_in_flight_update import _logprobs

pytestmark = pytest.mark.e2e

ATOL = 1e-4
UPDATE_AFTER = 3  # engine steps of turn 2 before the weights arrive in flight
SAMPLING = SamplingConfig(n=2, max_tokens=12, seed=11)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_sparse_rl.data.datasets import load_tokenizer
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    root = tmp_path_factory.mktemp("episodes_in_flight")
    old = build_tiny_hf_model(root / "old", arch="qwen3_moe", seed=0)
    new = build_tiny_hf_model(root / "new", arch="qwen3_moe", seed=1)
    vllm_cpu.apply()
    engine = RolloutEngine(old, RolloutConfig(max_model_len=256, max_num_seqs=8, kv_cache_gb=1, prefix_caching=True,
                                              kv=KVConfig(block_size=32)))
    hf = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (old, new)]
    weights = [load_file(d / "model.safetensors") for d in (old, new)]
    yield engine, load_tokenizer(old), hf, weights
    engine.shutdown()


class Turns:
    """The engine as run_episodes sees it, counting turns; `after_turn(t)` runs when turn t (1-based) returned."""

    def __init__(self, engine, after_turn=lambda t: None):
        self.engine, self.after_turn, self.turn = engine, after_turn, 0

    pad_id = property(lambda self: self.engine.pad_id)
    weight_version = property(lambda self: self.engine.weight_version)

    def sample_turns(self, prompts, sampling, **kw):
        self.turn += 1
        turns = self.engine.sample_turns(prompts, sampling, **kw)
        self.after_turn(self.turn)
        return turns


def _episodes(setup, wrapped: Turns, between_steps=None):
    from megatron_sparse_rl.rollout.multi_turn import run_episodes

    engine, tok, _, weights = setup
    assert engine.weight_version == 0
    try:
        return run_episodes(wrapped, tok, PROMPTS, SAMPLING, ENV, TwoTurns, between_steps=between_steps)
    finally:  # the engine goes back to the old model for the next test
        engine.load_weights(weights[0].items(), version=0)


def _check(batch, tok, hf, *, turn2_cut) -> tuple[float, int]:
    """Per episode: versions 0 up to `turn2_cut(observation start, turn-2 start, versions)`, 1 after; each model token's logprob is
    that version's model over the whole sequence. Returns the worst difference and how many episodes span both."""
    obs = len(tok(OBSERVATION, add_special_tokens=False)["input_ids"])
    worst, spans = 0.0, 0
    assert batch.finish_reasons == ("stop",) * len(batch)
    for i, (prompt, response) in enumerate(zip(batch.prompts(), batch.responses())):
        n, model = len(response), batch.loss_mask[i, :len(response)]
        env_at = (~model).nonzero().flatten().tolist()
        assert len(env_at) == obs and env_at == list(range(env_at[0], env_at[0] + obs))  # one observation
        versions = batch.token_version[i, :n]
        cut = turn2_cut(env_at[0], env_at[-1] + 1, versions)
        assert versions[:cut].eq(0).all() and versions[cut:].eq(1).all(), (i, cut, versions)
        seq, p, lp = prompt + response, len(prompt), batch.rollout_logprobs[i, :n]
        for version, span in ((0, slice(0, cut)), (1, slice(cut, n))):
            keep = model[span]
            if keep.any():
                want = _logprobs(hf[version], seq, p)[span][keep]
                worst = max(worst, (lp[span][keep] - want).abs().max().item())
        spans += env_at[-1] + 1 < cut < n
    return worst, spans


def _update_during(wrapped, new_weights, *, turn: int, recompute: bool):
    """(between_steps, steps): a `between_steps` that loads `new_weights` as version 1 in flight at the
    UPDATE_AFTER-th engine step of `turn`, and the one-element list counting that turn's engine steps."""
    steps = [0]

    def between_steps():
        if wrapped.turn == turn:
            steps[0] += 1
            if steps[0] == UPDATE_AFTER:
                wrapped.engine.update_in_flight(lambda: wrapped.engine.load_weights(new_weights.items(), version=1),
                                                1, recompute=recompute)
    return between_steps, steps


def test_weights_loaded_between_turns_sample_turn_two_with_the_new_model(setup):
    engine, tok, hf, weights = setup

    def load_after_turn_one(t):
        if t == 1:
            engine.load_weights(weights[1].items(), version=1)

    batch = _episodes(setup, Turns(engine, load_after_turn_one))
    # the observation is prefilled by turn 2: version 1 from the first environment token on
    worst, _ = _check(batch, tok, hf, turn2_cut=lambda observation, turn2, v: observation)
    print(f"between turns: max |engine - transformers (its version)| over model tokens {worst:.2e}")
    assert worst < ATOL


def test_weights_loaded_in_flight_during_turn_two_sample_its_later_tokens_with_the_new_model(setup):
    engine, tok, hf, weights = setup
    wrapped = Turns(engine)
    between_steps, steps = _update_during(wrapped, weights[1], turn=2, recompute=True)
    batch = _episodes(setup, wrapped, between_steps)
    worst, spans = _check(batch, tok, hf, turn2_cut=lambda observation, turn2, v: int(v.eq(0).sum()))
    print(f"in flight in turn 2: {spans} of {len(batch)} episodes' turn 2 spans the update; max |engine - "
          f"transformers (its version)| {worst:.2e}")
    assert steps[0] >= UPDATE_AFTER and spans >= 2
    assert worst < ATOL


def test_a_turn_with_an_in_flight_update_leaves_no_old_blocks_for_the_next_turn(setup):
    """Weights in flight during turn 1 with its KV kept (trainer.in_flight_kv keep): the blocks the old weights
    computed are in the prefix cache when turn 1 ends; the engine empties it then, so turn 2 (all version 1) has the
    new model's logprobs over the whole sequence, and turn 1's tokens before the update the old model's."""
    engine, tok, hf, weights = setup
    wrapped = Turns(engine)
    between_steps, steps = _update_during(wrapped, weights[1], turn=1, recompute=False)
    batch = _episodes(setup, wrapped, between_steps)
    worst = 0.0
    for i, (prompt, response) in enumerate(zip(batch.prompts(), batch.responses())):
        n, model = len(response), batch.loss_mask[i, :len(response)]
        versions, lp, seq = batch.token_version[i, :n], batch.rollout_logprobs[i, :n], prompt + response
        turn2 = int((~model).nonzero().max()) + 1
        cut = int(versions.eq(0).sum())
        assert 0 < cut < turn2 and versions[cut:].eq(1).all(), versions  # turn 1 spans the update
        old, new = _logprobs(hf[0], seq, len(prompt)), _logprobs(hf[1], seq, len(prompt))
        worst = max(worst, (lp[:cut] - old[:cut]).abs().max().item(), (lp[turn2:] - new[turn2:]).abs().max().item())
    print(f"in flight in turn 1 (KV kept): max |engine - transformers| on turn 1 before the update and on turn 2 "
          f"{worst:.2e}")
    assert worst < ATOL
