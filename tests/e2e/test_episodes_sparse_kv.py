"""Sparse KV across the turns of multi-turn episodes on a real vLLM engine (tiny Qwen3-MoE, fp32, CPU, SnapKV with a
budget of 24 and an interval of 8, so both turns compact) against transformers and a Megatron learner.

Two-turn episodes (an environment that answers turn 1 with a fixed observation and ends after turn 2; turns run to
their token limit). Each turn's request prefills the whole episode so far densely and compacts during its decode;
the episode's record (`RolloutBatch.features.kv_keep`) merges them. Checks: every turn compacted at least once; the engine's
logprobs of turn k's tokens equal a transformers forward over the whole sequence with an attention mask built here
from turn k's compactions (its decode queries attend what it kept, every other query causally) within 1e-4, while
one forward with both turns' compactions misses turn 2 (turn 1's positions were recomputed densely by turn 2's
prefill) and the dense forward misses both; the environment's tokens are out of the loss mask;
`episode/reprefill_tokens` counts the whole history of turn 1 (no prefix cache with sparse KV). A Megatron learner
given the episode batch recomputes pi_sparse (training/sparse_kv.py `sparse_logprobs`, one forward per compacted
turn) equal to the engine's logprobs within 1e-4.
Run: .venv/bin/python -m pytest -q tests/e2e/test_episodes_sparse_kv.py
"""
import pytest
import torch

from megatron_sparse_rl.config.env import EnvConfig
from megatron_sparse_rl.config.rollout import KVConfig, SamplingConfig
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests.e2e.test_episodes import OBSERVATION, PROMPTS, TwoTurns
from tests.e2e.test_sparse_kv import engine, hf_masked_logprobs

pytestmark = pytest.mark.e2e

ATOL = 1e-4
TURN = 12  # tokens per model turn (EOS ignored, no turn stop string)
KV = KVConfig(policy="snapkv", budget=24, interval=8, window=8, block_size=32, record_keep=True)
ENV = EnvConfig(kind="tools", max_turns=2, max_total_tokens=100, turn_stop=())


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    from megatron_sparse_rl.data.datasets import load_tokenizer
    from megatron_sparse_rl.rollout.multi_turn import run_episodes

    model_dir = build_tiny_hf_model(tmp_path_factory.mktemp("episodes_kv") / "moe", arch="qwen3_moe", seed=0)
    tok = load_tokenizer(model_dir)
    with engine(model_dir, KV, max_model_len=256) as e:
        batch = run_episodes(e, tok, PROMPTS, SamplingConfig(n=2, max_tokens=TURN, seed=11), ENV, TwoTurns)
    return model_dir, tok, batch


def turn_spans(loss_mask: list[bool], prompt_len: int) -> list[tuple[int, int]]:
    """(first, end) sequence positions of each run of model tokens."""
    spans, start = [], None
    for j, m in enumerate(loss_mask + [False]):
        if m and start is None:
            start = j
        if not m and start is not None:
            spans.append((prompt_len + start, prompt_len + j))
            start = None
    return spans


def replay_mask(total: int, record, spans) -> torch.Tensor:
    """[layers, kv_heads, total, total]: a query inside the decode of a turn of `spans` (positions first .. end - 2)
    attends the kept set of that turn's last compaction at or before it plus the positions from that compaction on;
    every other query (the prompt, the environment's tokens, each turn's first query from its prefill) causally."""
    layers, heads, _ = record.kept[0].shape
    mask = torch.ones(total, total, dtype=torch.bool).tril().expand(layers, heads, total, total).clone()
    for first, end in spans:
        turn = [(n, kept) for n, kept in zip(record.lengths, record.kept) if first <= n <= end - 2]
        for t in range(first, end - 1):
            before = [(n, kept) for n, kept in turn if n <= t]
            if not before:
                continue
            n, kept = before[-1]
            mask[:, :, t] = False
            for li in range(layers):
                for h in range(heads):
                    mask[li, h, t, kept[li, h].long()] = True
            mask[:, :, t, n:t + 1] = True
    return mask


def test_two_turn_sparse_episode_logprobs_match_a_masked_transformers_forward(episodes):
    model_dir, tok, batch = episodes
    obs = tok(OBSERVATION, add_special_tokens=False)["input_ids"]
    assert len(batch) == 4 and batch.reward.tolist() == [1.0] * 4 and batch.episode_stats["turn2/episodes"] == 4
    hand = [True] * TURN + [False] * len(obs) + [True] * TURN
    worst = worst_one = worst_dense = 0.0
    for i, (prompt, response, record) in enumerate(zip(batch.prompts(), batch.responses(), batch.features.kv_keep)):
        assert batch.loss_mask[i][:len(response)].tolist() == hand  # the environment's tokens out of the loss
        assert response[TURN:TURN + len(obs)] == obs
        spans = turn_spans(hand, len(prompt))
        per_turn = [[n for n in record.lengths if first <= n <= end - 2] for first, end in spans]
        assert all(per_turn) and sum(map(len, per_turn)) == record.num_compactions, (record.lengths, spans)
        assert record.turn_ends == tuple(end for _, end in spans) and not record.preempted
        seq, p, model = prompt + response, len(prompt), torch.tensor(hand)
        engine_lp = batch.rollout_logprobs[i][:len(response)]
        reference = torch.zeros(len(response))
        for k, (first, end) in enumerate(spans):  # turn k's tokens from the forward that replays turn k alone
            mask = replay_mask(len(seq), record, [(first, end)])
            assert torch.equal(record.attention_mask(len(seq), turn=k), mask)  # the learner's builder, cross-checked
            reference[first - p:end - p] = hf_masked_logprobs(model_dir, seq, mask)[first - 1:end - 1]
        one = hf_masked_logprobs(model_dir, seq, replay_mask(len(seq), record, spans))[p - 1:]  # both turns at once
        dense = hf_masked_logprobs(model_dir, seq, torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
                                   .expand(*mask.shape))[p - 1:]
        worst = max(worst, (engine_lp - reference)[model].abs().max().item())
        worst_one = max(worst_one, (engine_lp - one)[model].abs().max().item())
        worst_dense = max(worst_dense, (engine_lp - dense)[model].abs().max().item())
        assert (engine_lp[~model] == 0).all()
        print(f"episode {i}: compactions {record.lengths}, turn ends {record.turn_ends}")
    ep = batch.episode_stats
    print(f"max |engine - HF| over model tokens: one forward per turn {worst:.2e}, one forward with both turns' "
          f"compactions {worst_one:.2e}, dense {worst_dense:.2e}; reprefill_tokens {ep['reprefill_tokens']}")
    assert worst < ATOL and worst_one > 100 * ATOL and worst_dense > 100 * ATOL
    turn1_history = sum(len(p) + TURN for p in batch.prompts())  # turn 2 prefilled all of it again
    assert ep["reprefill_tokens"] == turn1_history and ep["cached_tokens"] == 0


def pi_sparse_worker(rank, world_size, model_dir, batch):
    from megatron_sparse_rl.training.sparse_kv import sparse_logprobs
    from tests.learner_workers import make_learner

    learner = make_learner(world_size, model_dir)
    tokens, _, _ = batch.sequences()
    return sparse_logprobs(learner, batch, tokens)


def test_learner_recomputes_the_engine_logprobs_from_the_episode_record(episodes):
    from tests.spawn import run_distributed

    model_dir, _, batch = episodes
    pi_sparse = run_distributed(pi_sparse_worker, 1, (model_dir, batch), timeout=240)[0]
    worst = 0.0
    for i, n in enumerate(batch.response_lens.tolist()):
        p = int(batch.prompt_lens[i])
        model = batch.loss_mask[i, :n]
        diff = (pi_sparse[i, p - 1:p - 1 + n] - batch.rollout_logprobs[i, :n])[model]
        worst = max(worst, diff.abs().max().item())
    print(f"max |learner pi_sparse - engine| over model tokens = {worst:.2e}")
    assert worst < ATOL
