"""SamplingSupport (the keep-sampling-mask record a rollout carries): the learner-layout mask against a
per-position loop, row selection/concatenation, and the loud failures of the capture's bookkeeping."""
import pytest
import torch

from megatron_sparse_rl.rollout.sampling_mask import SamplingMaskCapture, SamplingMaskError, SamplingSupport

VOCAB = 11


def _support():
    # row 0: prompt 3, response 3 tokens: {2, 5}, full, {0, 7, 10}; row 1: prompt 2, response 2: full, {4}
    return SamplingSupport(
        prompt_lens=torch.tensor([3, 2]),
        counts=(torch.tensor([2, 0, 3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)),
        ids=(torch.tensor([2, 5, 0, 7, 10], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)),
    )


def _reference(sets: dict[tuple[int, int], set[int]], rows: int, length: int, lo: int, hi: int) -> torch.Tensor:
    """Loop reference: column c of row r allows id v iff (r, c) has no set or v is in it."""
    out = torch.ones(rows, length, hi - lo, dtype=torch.bool)
    for (r, c), kept in sets.items():
        for v in range(lo, hi):
            out[r, c, v - lo] = v in kept
    return out


SETS = {(0, 2): {2, 5}, (0, 4): {0, 7, 10}, (1, 2): {4}}  # learner column = prompt_len - 1 + j


@pytest.mark.parametrize("lo,hi", [(0, VOCAB), (0, 6), (6, 12)])
def test_local_mask_matches_a_loop_for_each_vocab_slice(lo, hi):
    got = _support().local_mask([0, 1], 6, lo, hi)
    assert torch.equal(got, _reference(SETS, 2, 6, lo, hi))


def test_select_and_concat_keep_rows_aligned():
    s = _support()
    swapped = s.select([1, 0])
    want = {(1 - r, c): v for (r, c), v in SETS.items()}
    assert torch.equal(swapped.local_mask([0, 1], 6, 0, VOCAB), _reference(want, 2, 6, 0, VOCAB))
    both = SamplingSupport.concat([s, s.select([1])])
    assert len(both) == 3
    assert torch.equal(both.local_mask([2], 6, 0, VOCAB), s.local_mask([1], 6, 0, VOCAB))
    assert both.nbytes == s.nbytes + s.select([1]).nbytes


def test_bad_records_are_refused():
    with pytest.raises(ValueError, match="counts sum to 2 but 3 ids"):
        SamplingSupport(prompt_lens=torch.tensor([1]), counts=(torch.tensor([2], dtype=torch.int32),),
                        ids=(torch.tensor([1, 2, 3], dtype=torch.int32),))
    with pytest.raises(ValueError, match="do not fit 3 learner columns"):
        _support().local_mask([0], 3, 0, VOCAB)


def test_capture_bookkeeping_fails_loudly():
    seen = {5: (3, torch.tensor([1, 3], dtype=torch.int32)), 6: (4, None)}
    counts, ids = SamplingMaskCapture._sequence_support(0, 5, [3, 4], seen)
    assert counts.tolist() == [2, 0] and ids.tolist() == [1, 3]
    with pytest.raises(SamplingMaskError, match="sequence 2: no sampling support recorded at position 7"):
        SamplingMaskCapture._sequence_support(2, 5, [3, 4, 9], seen)
    with pytest.raises(SamplingMaskError, match="position 5 was sampled as token 3, the response has 8"):
        SamplingMaskCapture._sequence_support(0, 5, [8], seen)
    outside = {5: (3, torch.tensor([1, 2], dtype=torch.int32))}
    with pytest.raises(SamplingMaskError, match="token 3 sampled at position 5 is outside its recorded support"):
        SamplingMaskCapture._sequence_support(0, 5, [3], outside)


def test_config_needs_processed_logprobs_and_the_trainer_needs_the_record():
    from megatron_sparse_rl.config.algorithm import AlgorithmConfig
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.rollout.batch import RolloutBatch
    from megatron_sparse_rl.training.update import sampling_keep

    with pytest.raises(ValueError, match="record_sampling_mask = true needs rollout.logprobs_mode = processed"):
        RolloutConfig(record_sampling_mask=True, logprobs_mode="raw")
    batch = RolloutBatch(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_lens=torch.tensor([2]),
                         response_ids=torch.ones(1, 1, dtype=torch.long), response_mask=torch.ones(1, 1, dtype=torch.bool),
                         rollout_logprobs=torch.zeros(1, 1), finish_reasons=("stop",), group_ids=torch.tensor([0]))
    assert sampling_keep(batch, AlgorithmConfig()) is None
    with pytest.raises(ValueError, match="carries no sampling mask"):
        sampling_keep(batch, AlgorithmConfig(keep_sampling_mask=True))


@pytest.mark.parametrize("sets,warned", [(["rollout.sampling.top_p=0.9"], True), (["rollout.sampling.top_k=20"], True),
                                         (["rollout.sampling.top_p=0.9", "rollout.record_sampling_mask=true",
                                           "algorithm.keep_sampling_mask=true"], False),
                                         (["rollout.sampling.top_p=0.9", "rollout.logprobs_mode=raw"], False),
                                         ([], False)])
def test_truncated_sampling_without_the_mask_is_warned_about(caplog, sets, warned):
    from megatron_sparse_rl.training.context import _warn_truncated_support
    from tests.unit.test_config_validate import run_of

    with caplog.at_level("WARNING"):
        _warn_truncated_support(run_of(*sets))
    assert ("algorithm.keep_sampling_mask is off" in caplog.text) == warned
