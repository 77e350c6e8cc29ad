"""The trainer's alignment of engine samples with the learner's shifted token layout."""
import torch

from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.training.update import align_rollout


def test_rollout_logprobs_land_on_the_learner_positions_that_score_them():
    # sample 0: prompt [1, 5, 6], response [7, 2]; sample 1: prompt [1, 9], response [4, 4, 2]
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[1, 5, 6], [1, 9, 0]]), prompt_lens=torch.tensor([3, 2]),
        response_ids=torch.tensor([[7, 2, 0], [4, 4, 2]]),
        response_mask=torch.tensor([[True, True, False], [True, True, True]]),
        rollout_logprobs=torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]),
        finish_reasons=("stop", "stop"), group_ids=torch.tensor([0, 0]),
    )
    tokens, mask, lp = align_rollout(batch, pad_id=0)
    assert tokens.tolist() == [[1, 5, 6, 7, 2], [1, 9, 4, 4, 2]]
    # learner column t scores token t + 1: sample 0's response tokens sit at 3, 4 -> columns 2, 3
    assert mask.tolist() == [[False, False, True, True], [False, True, True, True]]
    assert torch.equal(lp, torch.tensor([[0.0, 0.0, -0.1, -0.2], [0.0, -0.3, -0.4, -0.5]]))
