"""Length-grouped, trimmed micro-batches (`lengths=` on forward_logprobs / train_step, learner.group_by_length):
each micro-batch runs only up to its longest row, yet the logprobs of every real position, the loss and the
gradients equal the untrimmed full-width run (the reference: the same learner without `lengths`, where
right padding cannot change earlier positions under causal attention), at TP1, TP2 with sequence parallel
(odd widths padded to a multiple of 2) and EP2; R2 routes recorded with trimming replay to the same logprobs.
"""
import pytest
import torch

from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

# 6 rows, lengths 3..17 in mixed order, so grouping by length reorders and trims every micro-batch (mbs 2)
LENGTHS = torch.tensor([9, 17, 3, 12, 5, 16])
WIDTH = 17


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 60, (len(LENGTHS), WIDTH), generator=g)
    pos = torch.arange(WIDTH)[None]
    tokens = torch.where(pos < LENGTHS[:, None], tokens, 0)
    mask = (pos[:, :-1] < (LENGTHS - 1)[:, None]).float()  # learner column t scores token t + 1
    return tokens, mask


def lengths_worker(rank, world_size, model_dir, tp, ep, routing):
    from megatron_sparse_rl.learner.extras import ForwardExtras
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from tests.distributed.test_routing import _learner

    learner = _learner(world_size, model_dir, tp=tp, ep=ep, lr=1e-12)  # micro-batches of 2, routing.mode R2
    tokens, mask = _batch()
    out = {"full": learner.forward_logprobs(tokens)["logprobs"],
           "trimmed": learner.forward_logprobs(tokens, lengths=LENGTHS)["logprobs"]}
    loss_fn = make_sft_loss(mask, mask.sum().item())
    grads = {}
    for name, lengths in (("full", None), ("trimmed", LENGTHS)):
        m = learner.train_step(tokens, loss_fn, lengths=lengths)
        out[f"loss_{name}"], out[f"grad_norm_{name}"] = m["loss"], m["grad_norm"]
        grads[name] = torch.cat([p.main_grad.detach().float().reshape(-1) for p in learner.model.parameters()])
    out["grad_diff"] = (grads["full"] - grads["trimmed"]).abs().max().item()
    out["grad_scale"] = grads["full"].abs().max().item()
    if routing:
        r = learner.routing
        old = learner.forward_logprobs(tokens, lengths=LENGTHS, extras=ForwardExtras(routes=r.old_forward(None)))
        out["recorded"] = old["logprobs"]
        out["widths"] = list(r._mb_widths)  # what each micro-batch ran
        routes = r.after_old_forward(old["routing"], None).routes
        replay = ForwardExtras(routes=r.update(routes))
        out["replayed_loss"] = learner.train_step(tokens, loss_fn, lengths=LENGTHS, extras=replay)["loss"]
        out["route_lengths"] = routes.lengths
    return out


@pytest.mark.parametrize("tp,ep,routing", [(1, 1, True), (2, 1, True), (1, 2, False)], ids=["tp1", "tp2_sp", "ep2"])
def test_trimmed_micro_batches_equal_the_full_width(tmp_path, tp, ep, routing):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / "moe", experts=4, topk=2, seed=0))
    out = run_distributed(lengths_worker, max(tp, ep), args=(model_dir, tp, ep, routing), timeout=300)[0]
    _, mask = _batch()
    real = mask.bool()
    assert (out["trimmed"] - out["full"])[real].abs().max() < 1e-5
    assert (out["trimmed"][~real] == 0).all()  # after each row's length
    assert out["loss_trimmed"] == pytest.approx(out["loss_full"], rel=1e-5)
    assert out["grad_diff"] <= 1e-5 * out["grad_scale"], (out["grad_diff"], out["grad_scale"])
    if routing:
        assert (out["recorded"] - out["full"])[real].abs().max() < 1e-5
        assert out["replayed_loss"] == pytest.approx(out["loss_full"], rel=1e-5)
        assert out["route_lengths"].tolist() == (LENGTHS - 1).tolist()
        # longest first, micro-batches of 2: rows (17, 16) run 16 positions, (12, 9) 11, (5, 3) 4 (even with SP)
        assert out["widths"] == ([16, 11, 4] if tp == 1 else [16, 12, 4])


def bad_lengths_worker(rank, world_size, model_dir):
    from tests.learner_workers import make_learner

    learner = make_learner(world_size, model_dir, mbs=2)
    tokens, _ = _batch()
    messages = []
    for bad in (LENGTHS[:3], LENGTHS.clone().fill_(WIDTH + 1), LENGTHS.clone().fill_(0)):
        try:
            learner.forward_logprobs(tokens, lengths=bad)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_bad_lengths_are_refused(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / "moe", experts=4, topk=2, seed=0))
    messages = run_distributed(bad_lengths_worker, 1, args=(model_dir,), timeout=300)[0]
    assert len(messages) == 3
    assert all(m.startswith(f"lengths must hold one value in [1, {WIDTH}] per row") for m in messages), messages
