"""Asynchronous RL's configuration and bookkeeping: `trainer.max_staleness` / `trainer.in_flight_kv` refused where
they cannot run (each error names the field and what is allowed), and `VersionLog`, which says which weight version
sampled each token of a partial rollout, `too_stale` and trainer.stale_policy's guard (checked against hand-built
expectations); the words of the rollout protocol while sampling ahead.

    .venv/bin/python -m pytest -q tests/unit/test_async_config.py
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from megatron_sparse_rl.config import ConfigError, RunConfig
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.loader import from_dict, merge_overrides
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.rollout.versions import VersionLog, too_stale
from megatron_sparse_rl.training.steps import _stale_guard
from megatron_sparse_rl.placement.rollout import RolloutRequest
from megatron_sparse_rl.placement.protocol import Collect, Probe, Stop, SyncWeights, Word, from_word, to_word


def run_of(*overrides: str) -> RunConfig:
    return from_dict(RunConfig, merge_overrides({"model": {"path": "/nonexistent/tiny", "tiny": {}}}, list(overrides)))


ASYNC = ("launch.nproc_per_node=2", "launch.rollout_ranks=1", "trainer.max_staleness=1")


def test_async_on_a_disaggregated_run_validates():
    validate(run_of(*ASYNC), 2, cuda=False)
    validate(run_of(*ASYNC, "trainer.in_flight_kv=recompute"), 2, cuda=False)
    validate(run_of("trainer.max_staleness=0"), 1, cuda=False)  # 0: the synchronous loop anywhere
    for k in (2, 8):  # any k up to the bound, either stale policy
        validate(run_of(*ASYNC[:2], f"trainer.max_staleness={k}", "trainer.stale_policy=recompute"), 2, cuda=False)


@pytest.mark.parametrize("overrides,message", [
    (["trainer.max_staleness=-1"], "trainer.max_staleness must be an integer in [0, 8]"),
    (["trainer.max_staleness=9"], "trainer.max_staleness must be an integer in [0, 8]: 0 synchronous"),
    (["trainer.stale_policy=keep"], "trainer.stale_policy: 'keep' is not allowed; choose one of 'drop', 'recompute'"),
    (["trainer.in_flight_kv=drop"], "trainer.in_flight_kv: 'drop' is not allowed; choose one of 'keep', 'recompute'"),
])
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_of(*overrides)


@pytest.mark.parametrize("overrides,world,message", [
    (["trainer.max_staleness=1"], 1, "trainer.max_staleness = 1 samples on the rollout ranks while the learner ranks "
                                     "train: it needs the disaggregated placement"),
    (["trainer.max_staleness=4"], 1, "trainer.max_staleness = 4 samples on the rollout ranks"),
    ([*ASYNC[:1], "launch.nproc_per_node=3", "launch.rollout_ranks=2", "trainer.max_staleness=1",
      "rollout.tensor_parallel_size=2", "parallel.tp=1"], 3, "needs rollout.tensor_parallel_size = 1 (got 2)"),
    ([*ASYNC, "trainer.in_flight_kv=recompute", "rollout.kv.policy=rkv", "rollout.kv.budget=16",
      "rollout.kv.window=4"], 2, "trainer.in_flight_kv = 'recompute' re-prefills the running requests densely"),
])
def test_async_is_refused_where_it_cannot_run(overrides, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(run_of(*overrides), world, cuda=False)


def test_version_log_marks_the_tokens_after_each_update():
    log = VersionLog(start=3)
    log.update(4, {("a", 0): 2, ("a", 1): 0})  # ("b", 0) had finished: all its tokens are version 3
    log.update(5, {("a", 0): 4})               # ("a", 1) finished between the two updates
    got = log.token_versions([("a", 0), ("a", 1), ("b", 0)], width=6)
    want = torch.tensor([[3, 3, 4, 4, 5, 5], [4, 4, 4, 4, 4, 4], [3, 3, 3, 3, 3, 3]])
    assert torch.equal(got, want) and log.versions == 3
    assert torch.equal(VersionLog(start=0).token_versions([("x", 0)], width=2), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="versions must increase"):
        log.update(5, {})


def test_too_stale_marks_samples_with_a_token_older_than_the_bound():
    versions = torch.tensor([[5, 5, 6], [4, 6, 7], [3, 3, 3], [7, 7, 7]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    # at version 7 with bound 2 a token of version 4 is 3 behind; row 2's old tokens are padding
    assert too_stale(versions, mask, version=7, bound=2).tolist() == [False, True, False, False]
    assert too_stale(versions, mask, version=7, bound=1).tolist() == [True, True, False, False]
    assert not too_stale(versions, mask, version=7, bound=8).any()


@pytest.mark.parametrize("command,word", [(SyncWeights(3), [1, 3]), (Stop(), [2, 0]), (Collect(), [3, 0]),
                                          (Probe([[1, 2]]), [4, 0])])
def test_sampling_ahead_words(command, word):
    """While the rollout ranks sample ahead (any max_staleness), SyncWeights, Stop and Collect are words and a Probe
    an OBJECT word (the pickled Probe follows); what is not a command has no word."""
    assert to_word(command).tolist() == word
    assert from_word(torch.tensor(word)) == (Word.OBJECT if word[0] == Word.OBJECT else command)
    with pytest.raises(TypeError, match="str is not a command"):
        to_word("generate")


def _versioned_batch(versions: list[list[int]]) -> RolloutBatch:
    """One row per entry of `versions` (3 response tokens each, ids 10 r .. 10 r + 2, all real)."""
    b = len(versions)
    return RolloutBatch(
        prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_lens=torch.full((b,), 2),
        response_ids=torch.tensor([[10 * r, 10 * r + 1, 10 * r + 2] for r in range(b)]),
        response_mask=torch.ones(b, 3, dtype=torch.bool), rollout_logprobs=torch.zeros(b, 3),
        finish_reasons=("stop",) * b, group_ids=torch.zeros(b, dtype=torch.long), reward=torch.zeros(b),
        token_version=torch.tensor(versions))


class _Engine:
    """Stands for the engines: records the call and answers a fresh batch of the training version (5)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling, group_ids, *, between_steps=None):
        self.calls.append((prompts, sampling, group_ids))
        return _versioned_batch([[5, 5, 5]] * len(prompts))


def _guard(policy: str, versions: list[list[int]]):
    engine = _Engine()
    placement = SimpleNamespace(sample=lambda requests, finish: finish(requests[0].run(engine), 0))
    ctx = SimpleNamespace(run=SimpleNamespace(trainer=SimpleNamespace(max_staleness=2, stale_policy=policy)),
                          layout=SimpleNamespace(dp=1), dp_group=None, placement=placement)
    ahead = SimpleNamespace(requests=[RolloutRequest([[1, 1]] * len(versions), "sampling", None, 0)],
                            finish=lambda batch, d: (batch, torch.ones(len(batch))))
    batch = _versioned_batch(versions)
    got, correct, metrics = _stale_guard(ctx, 5, ahead, batch, torch.arange(len(versions), dtype=torch.float32))
    return got, correct, metrics, engine.calls


def test_stale_guard_drops_or_resamples_samples_older_than_max_staleness():
    """Training version 5, max_staleness 2: a token of version 2 is too old, versions 3-5 are not."""
    fine = [[3, 4, 5], [3, 3, 3]]
    got, correct, metrics, calls = _guard("drop", fine)
    assert got.response_ids.tolist() == [[0, 1, 2], [10, 11, 12]] and not calls
    assert metrics == {"async/dropped_samples": 0.0, "async/resampled": 0.0}
    got, correct, metrics, calls = _guard("drop", [[3, 4, 5], [2, 3, 4], [4, 4, 4]])
    assert got.response_ids.tolist() == [[0, 1, 2], [20, 21, 22]] and correct.tolist() == [0.0, 2.0]
    assert metrics == {"async/dropped_samples": 1.0, "async/resampled": 0.0} and not calls
    for policy, versions in (("recompute", [[3, 4, 5], [2, 3, 4]]), ("drop", [[1, 1, 1], [2, 5, 5]])):
        got, correct, metrics, calls = _guard(policy, versions)  # recompute, or drop with nothing left
        assert calls == [([[1, 1], [1, 1]], "sampling", None)], policy  # the step's own request again
        assert got.token_version.tolist() == [[5, 5, 5]] * 2 and correct.tolist() == [1.0, 1.0]
        assert metrics == {"async/dropped_samples": 0.0, "async/resampled": 1.0}
