"""bf16 on CPU: a bf16 Hugging Face checkpoint converts HF -> torch_dist -> HF at EP2 with --verify in both
directions (a bf16 learner: Megatron's mixed-precision optimizer keeps fp32 main copies; patches/megatron_cpu.py
lets it take host tensors), the round trip is bit-exact in bf16, and a bf16 learner's logprobs stay within the
bf16 tolerance of transformers' fp32 forward of the same weights while a train step moves the weights.
Run: .venv/bin/python -m pytest -q tests/distributed/test_bf16.py
"""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import learner_workers as W
from tests.distributed.test_learner import hf_reference
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

TOKENS = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    # the usual 0.02 init: the tests' peaked 0.2 init makes attention scores large enough that rounding them to bf16
    # (Megatron's local attention computes Q K^T in the input dtype; TE's kernels on GPU accumulate in fp32) costs
    # 0.56 in logprob there, against 0.065 for transformers' own bf16 forward
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("bf16") / "hf", dtype="bfloat16", experts=4, seed=1,
                                   init_std=0.02))


def convert_worker(rank, world, hf, root):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf, f"{root}/mc", tp=1, ep=2, verify=True)
    mcore_to_hf(f"{root}/mc", f"{root}/hf", ep=2, verify=True)


def test_bf16_converts_with_verify_at_ep2_bit_exact(bf16_dir, tmp_path):
    run_distributed(convert_worker, 2, args=(bf16_dir, str(tmp_path)), timeout=300)
    original = load_file(f"{bf16_dir}/model.safetensors")
    back = {}
    for f in Path(tmp_path, "hf").glob("*.safetensors"):
        back.update(load_file(str(f)))
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert t.dtype == torch.bfloat16 and back[name].dtype == torch.bfloat16 and torch.equal(back[name], t), name


def step_worker(rank, world, hf, tokens, dtype):
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world, hf, lr=1e-2, dtype=dtype)
    before = learner.forward_logprobs(tokens)["logprobs"]
    dtypes = {p.dtype for p in learner.model.parameters()}
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
    after = learner.forward_logprobs(tokens)["logprobs"]
    return before, after, dtypes


def _hf_bf16_logprobs(model_dir, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(tokens).logits[:, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def test_bf16_learner_matches_transformers_and_trains(bf16_dir):
    from megatron_sparse_rl.checkpoint.verify import TOLERANCE

    before, after, dtypes = run_distributed(step_worker, 1, args=(bf16_dir, TOKENS, "bfloat16"), timeout=300)[0]
    assert dtypes == {torch.bfloat16}
    ref, _ = hf_reference(bf16_dir, TOKENS)
    ours = float((before.double() - ref).abs().max())
    theirs = float((_hf_bf16_logprobs(bf16_dir, TOKENS) - ref).abs().max())  # transformers' own bf16 error
    print(f"max |dlogprob| vs transformers fp32 of the bf16 weights: bf16 learner {ours:.3g}, "
          f"transformers bf16 {theirs:.3g}")
    assert ours < TOLERANCE[torch.bfloat16] and ours < 3 * theirs
    assert float((after - before).abs().max()) > 1e-3, "a train step must move the bf16 weights"
