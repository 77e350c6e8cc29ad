"""The Megatron-Core learner on CPU: logprobs against HF transformers, every layout against TP1, training
steps across layouts, checkpoints across layouts and resume."""
import pytest
import torch

from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests import learner_workers as W
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("moe"), seed=3))


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 40, (4, 14), generator=g)


def hf_reference(model_dir, tokens, *, device="cpu", dtype=torch.float32, **load):
    """log p(token t+1 | <= t) and entropy from HF transformers (a `dtype` forward on `device`, float64 softmax),
    on the host. `load`: more from_pretrained arguments (e.g. experts_implementation="eager")."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **load).to(device)
    with torch.no_grad():
        logits = model(tokens.to(device)).logits[:, :-1].double().cpu()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, tokens[:, 1:, None])[..., 0], -(logp.exp() * logp).sum(-1)


@pytest.fixture(scope="module")
def tp1(moe_dir, tokens):
    return run_distributed(W.logprobs_worker, 1, args=(moe_dir, tokens, 1, 1))[0]


def test_tp1_matches_hf_transformers_moe(moe_dir, tokens, tp1):
    ref_lp, ref_ent = hf_reference(moe_dir, tokens)
    lp, ent = tp1
    assert (lp.double() - ref_lp).abs().max() < 1e-4
    assert (ent.double() - ref_ent).abs().max() < 1e-4


def test_tp1_matches_hf_transformers_dense(tmp_path, tokens):
    model_dir = str(build_tiny_hf_model(tmp_path / "dense", arch="qwen3", seed=4))
    lp, ent = run_distributed(W.logprobs_worker, 1, args=(model_dir, tokens, 1, 1))[0]
    ref_lp, ref_ent = hf_reference(model_dir, tokens)
    assert (lp.double() - ref_lp).abs().max() < 1e-4
    assert (ent.double() - ref_ent).abs().max() < 1e-4


@pytest.mark.parametrize("tp,ep,pp,world", [(2, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 4), (1, 1, 2, 2)],
                         ids=["tp2", "ep2", "tp2xep2", "pp2"])
def test_layout_logprobs_equal_tp1(moe_dir, tokens, tp1, tp, ep, pp, world):
    for lp, ent in run_distributed(W.logprobs_worker, world, args=(moe_dir, tokens, tp, ep, pp)):
        assert (lp - tp1[0]).abs().max() < 1e-5
        assert (ent - tp1[1]).abs().max() < 1e-5


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=["tp2_sp", "ep2_dp2"])
def test_train_step_equal_across_layouts(moe_dir, tokens, tp, ep):
    ref, ref_params = run_distributed(W.step_then_logprobs_worker, 1, args=(moe_dir, tokens, 1, 1))[0]
    before = run_distributed(W.logprobs_worker, 1, args=(moe_dir, tokens, 1, 1))[0][0]
    assert (ref - before).abs().max() > 1e-2, "the step must change the model for this test to mean anything"
    for lp, params in run_distributed(W.step_then_logprobs_worker, 2, args=(moe_dir, tokens, tp, ep)):
        assert (lp - ref).abs().max() < 1e-4
        for name, value in params.items():
            assert torch.allclose(value, ref_params[name], atol=1e-5), name


def test_checkpoint_saved_at_tp2_reloads_at_tp1(moe_dir, tokens, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(W.save_load_worker, 2, args=(moe_dir, tokens, 2, 1, ckpt, "save"))[0]
    loaded = run_distributed(W.save_load_worker, 1, args=(moe_dir, tokens, 1, 1, ckpt, "load"))[0]
    assert (saved - loaded).abs().max() < 1e-5
    assert not list(tmp_path.glob(".*tmp")), "no temporary directory may be left behind"


def test_resume_gives_the_same_next_loss(moe_dir, tokens, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = run_distributed(W.resume_worker, 2, args=(moe_dir, tokens, 1, 2, ckpt, "straight"))[0]
    resumed = run_distributed(W.resume_worker, 2, args=(moe_dir, tokens, 1, 2, ckpt, "resume"))[0]
    assert len(straight) == 3 and len(resumed) == 1
    assert straight[0] > straight[2], "the loss must fall over the steps"
    assert resumed[0] == pytest.approx(straight[2], rel=1e-6, abs=1e-7)
