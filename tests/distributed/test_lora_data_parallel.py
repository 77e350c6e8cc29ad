"""LoRA at data parallel 2: two SFT steps of the adapters on a global batch split over two ranks give the adapters of
the same steps on one rank (the adapters' gradients averaged over the data-parallel group by Megatron's DDP), on the
tiny Qwen3-MoE with attention adapters at ep 1 and ep 2, and every rank holds the same adapters.

    .venv/bin/python -m pytest -q tests/distributed/test_lora_data_parallel.py
"""
import pytest
import torch

from megatron_sparse_rl.config.lora import LoraConfig
from tests.lora_workers import lora_dp_worker
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed
TOKENS = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(0))
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    return str(build_tiny_hf_model(tmp_path_factory.mktemp("moe"), seed=3))


@pytest.fixture(scope="module")
def one_rank(model_dir):
    return run_distributed(lora_dp_worker, 1, args=(model_dir, TOKENS, LORA))[0]


@pytest.mark.parametrize("ep", [1, 2])
def test_two_data_parallel_ranks_train_the_one_rank_adapters(model_dir, one_rank, ep):
    ranks = [after for _, after in run_distributed(lora_dp_worker, 2, args=(model_dir, TOKENS, LORA, ep))]
    init, want = one_rank
    assert set(ranks[0]) == set(want) and len(want) == 2 * 4 * 2  # A and B of q/k/v/o, two layers
    for key, value in want.items():
        assert (value - init[key]).abs().max() > 1e-3, key  # the steps moved every adapter
        assert torch.equal(ranks[0][key], ranks[1][key]), key
        assert (ranks[0][key] - value).abs().max() < 1e-6, key
