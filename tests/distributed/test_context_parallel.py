"""Context parallelism (parallel.cp) on CPU: the tiny Qwen3-MoE at cp 2 (2 gloo ranks) and tp 2 x cp 2 (4 ranks, slow).
Each sequence runs as Megatron's load-balanced 2 x cp chunks, attention all-gathers K/V over the context-parallel group
(models/sdpa_attention.py). Rows of 14, 11 and 9 tokens: 13, 10 and 8 input positions, not all multiples of 2 x cp = 4
(nor of 8 at tp 2 x cp 2), so the learner pads them. Checked: logprobs, entropies and every parameter's gradient of an
SFT loss against HF transformers (1e-4); the RL loss under each aggregation (with OPSM's and TIS's per-sequence and
per-token terms of the current policy, and GSPO's sequence ratio) equal to cp 1's (1e-6); per-layer keep-set masks
giving cp 1's logprobs; R2 routes recorded equal to cp 1's, and cp 1's routes replayed under re-drawn routers (R2/R3's
replay) giving cp 1's logprobs with applied fraction 1.0; multi-latent attention (a tiny DeepSeek-V3, slow) against
HF and cp 1, its one-head keep sets and losses against cp 1; pp 2 x cp 2 with uneven stages and pp 2 x vpp 2 x cp 2
(the interleaved schedule; both slow) against HF and pp 1 cp 1, and resuming at pp 2 x cp 2 from a checkpoint saved at
pp 1 cp 1. DeepSeek Sparse Attention at cp 2: tests/distributed/test_dsa_context_parallel.py. The refusals are unit-tested (tests/unit/test_context_parallel.py)."""
import pytest
import torch

from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from megatron_sparse_rl.training.update import OBJECTIVE
from tests import learner_workers as W
from tests.distributed.test_learner import hf_reference
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

AGGREGATIONS = [("grpo", "token_mean"), ("grpo", "seq_mean_token_mean"), ("grpo", "seq_mean_token_sum"),
                ("gspo", "seq_mean_token_mean")]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("moe"), seed=3))


@pytest.fixture(scope="module")
def batch():
    tokens = torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([14, 11, 9, 14])
    return tokens, lengths


def _real(lengths, width):
    """bool [B, width]: the positions that score a real next token."""
    return torch.arange(width)[None, :] < (lengths - 1)[:, None]


def _held_queries(learner) -> list:
    """Forward pre-hooks recording the query length each core attention module runs."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    seen = []
    for module in learner.model.modules():
        if isinstance(module, DotProductAttention):
            module.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].shape[0]), with_kwargs=True)
    return seen


def hf_worker(rank, world, model_dir, tokens, lengths, tp, cp):
    """Logprobs, entropies, the query lengths attention ran, and every full gradient of one SFT step."""
    from megatron_sparse_rl.learner.params import gather_full, local_params
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world, model_dir, tp=tp, cp=cp, clip=0.0)
    seen = _held_queries(learner)
    out = learner.forward_logprobs(tokens, lengths=lengths)
    mask = _real(lengths, tokens.shape[1] - 1).float()
    learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()), lengths=lengths)
    grads = {}
    for name, lp in local_params(learner.model, learner.groups).items():
        grad = getattr(lp.param, "main_grad", None)
        if grad is not None:
            grads[name] = gather_full(type(lp)(lp.full_name, grad, lp.tp_dim, lp.glu, lp.expert), learner.groups)
    return out["logprobs"], out["entropy"], sorted(set(seen)), grads


def hf_gradients(model_dir, tokens, lengths, out_dir):
    """Every gradient of the same SFT loss (mean NLL over the real positions) from HF transformers, by Megatron name
    (the gradients written as a checkpoint and read back through the model adapter's tensor maps)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from megatron_sparse_rl.formats.hf_io import iter_mcore_tensors
    from megatron_sparse_rl.models import load_spec

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logp = torch.log_softmax(model(tokens).logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    mask = _real(lengths, tokens.shape[1] - 1).float()
    (-(logp * mask).sum() / mask.sum()).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    model.save_pretrained(out_dir)
    for name in ("config.json",):
        shutil.copy(f"{model_dir}/{name}", f"{out_dir}/{name}")
    adapter, spec = load_spec(out_dir)
    return dict(iter_mcore_tensors(out_dir, adapter, spec))


def _check_against_hf(results, moe_dir, batch, tmp_path, width):
    tokens, lengths = batch
    ref_lp, ref_ent = hf_reference(moe_dir, tokens)
    ref_grads = hf_gradients(moe_dir, tokens, lengths, tmp_path / "grads")
    real = _real(lengths, tokens.shape[1] - 1)
    held = {}
    for lp, ent, seen, grads in results:
        assert seen == width, f"each rank's attention runs its own chunks of the padded sequence ({width} queries)"
        assert (lp.double() - ref_lp)[real].abs().max() < 1e-4
        assert (ent.double() - ref_ent)[real].abs().max() < 1e-4
        assert (lp[~real] == 0).all() and (ent[~real] == 0).all()
        held.update(grads)
    assert sorted(held) == sorted(ref_grads)
    assert max(g.abs().max() for g in ref_grads.values()) > 1e-3
    for name, g in ref_grads.items():
        assert (held[name] - g).abs().max() < 1e-4, name


def test_cp2_matches_hf_transformers(moe_dir, batch, tmp_path):
    tokens, lengths = batch
    results = run_distributed(hf_worker, 2, args=(moe_dir, tokens, lengths, 1, 2))
    # micro-batches of rows (14, 14) and (11, 9): 13 and 10 input positions, padded to 16 and 12, 8 and 6 per rank
    _check_against_hf(results, moe_dir, batch, tmp_path, [6, 8])


@pytest.mark.slow
def test_tp2_cp2_matches_hf_transformers(moe_dir, batch, tmp_path):
    tokens, lengths = batch
    results = run_distributed(hf_worker, 4, args=(moe_dir, tokens, lengths, 2, 2))
    # padded to multiples of 2 x cp x tp = 8: 16 positions, 8 per context-parallel rank (sequence parallelism
    # splits the rest of the layer, attention sees the rank's whole chunks)
    _check_against_hf(results, moe_dir, batch, tmp_path, [8])


def loss_worker(rank, world, model_dir, tokens, lengths, tp, cp, allowed):
    """The RL loss (training/update.py make_loss) of one step per aggregation, at learning rate 0 (the model stays),
    with OPSM and TIS (pi_theta) of the current policy; and logprobs under per-layer keep-set masks."""
    from megatron_sparse_rl.algorithms.aggregation import loss_normalizer
    from megatron_sparse_rl.config.algorithm import (AlgorithmConfig, CorrectionsConfig, LossConfig, OPSMConfig,
                                                     TISConfig)
    from megatron_sparse_rl.learner.extras import ForwardExtras
    from megatron_sparse_rl.training.update import PreparedBatch, make_loss

    learner = W.make_learner(world, model_dir, tp=tp, cp=cp, clip=0.0)
    masked = learner.forward_logprobs(tokens, extras=ForwardExtras(attention_mask=allowed))["logprobs"]
    plain = learner.forward_logprobs(tokens)["logprobs"]
    base = learner.forward_logprobs(tokens, lengths=lengths)["logprobs"]
    mask = _real(lengths, tokens.shape[1] - 1)
    mask[:, :3] = False  # a 4-token prompt
    g = torch.Generator().manual_seed(5)
    old = base + 0.05 * torch.randn(base.shape, generator=g)
    rollout = base + 0.05 * torch.randn(base.shape, generator=g)
    rollout[1] += 1.0  # row 1 drifted: OPSM drops it (negative advantage)
    prep = PreparedBatch(tokens=tokens, mask=mask, old_logprobs=old, rollout_logprobs=rollout,
                         advantages=torch.tensor([0.7, -1.2, 0.4, -0.3]), weights=torch.ones(base.shape),
                         metrics={}, lengths=lengths)
    out = {"masked": masked, "plain": plain}
    for name, aggregation in AGGREGATIONS:
        tis = TISConfig(enabled=name == "grpo", ratio="pi_theta", cap=1.02)
        cfg = AlgorithmConfig(loss=LossConfig(name=name, aggregation=aggregation),
                              corrections=CorrectionsConfig(opsm=OPSMConfig(enabled=True), tis=tis))
        loss_fn = make_loss(prep, torch.arange(tokens.shape[0]), cfg, loss_normalizer(mask, aggregation))
        out[(name, aggregation)] = learner.train_step(tokens, loss_fn, lengths=lengths, lr=0.0)
    return out


def _keep_sets(tokens, layers=2, kv_heads=2):
    b, s = tokens.shape[0], tokens.shape[1] - 1
    g = torch.Generator().manual_seed(4)
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool)) & (torch.rand(b, layers, kv_heads, s, s, generator=g) < 0.6)
    return allowed | torch.eye(s, dtype=torch.bool)


def test_cp2_losses_and_keep_sets_equal_cp1(moe_dir, batch):
    tokens, lengths = batch
    allowed = _keep_sets(tokens)
    ref = run_distributed(loss_worker, 1, args=(moe_dir, tokens, lengths, 1, 1, allowed))[0]
    assert (ref["masked"] - ref["plain"]).abs().max() > 1e-3, "the keep sets must change the logprobs"
    for out in run_distributed(loss_worker, 2, args=(moe_dir, tokens, lengths, 1, 2, allowed)):
        assert (out["masked"] - ref["masked"]).abs().max() < 1e-5
        for case in AGGREGATIONS:
            got, want = out[case], ref[case]
            got_counts, want_counts = got[OBJECTIVE].counts, want[OBJECTIVE].counts
            assert want_counts["opsm/masked_seqs"] == 1.0, "OPSM must drop the drifted sequence for this to mean anything"
            assert abs(got["loss"] - want["loss"]) < 1e-6, case
            for key in ("opsm/masked_seqs", "opsm/seqs", "n"):
                assert got_counts[key] == want_counts[key], (case, key)
            assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-5 * max(1.0, want["grad_norm"]), case


def routing_worker(rank, world, model_dir, tokens, lengths, tp, cp, routes):
    """R2's record (the learner's own routes); given `routes` (cp 1's; "own": the ones just recorded), the logprobs
    replaying them under re-drawn routers and the applied fractions of that forward and of a training step replaying
    them."""
    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.learner.extras import ForwardExtras, RouteRequest
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.moe.replay import find_routers

    learner = W.make_learner(world, model_dir, tp=tp, cp=cp, routing=RoutingConfig(mode="R2"))
    out = learner.forward_logprobs(tokens, lengths=lengths, extras=ForwardExtras(routes=RouteRequest(record=True)))
    result = {"lp": out["logprobs"], "routes": out["routing"].routes}
    if routes == "own":
        routes = result["routes"]
    if routes is not None:
        for router in find_routers(learner.model):
            g = torch.Generator().manual_seed(7 + int(router.layer_number))
            router.weight.data.copy_(torch.randn(router.weight.shape, generator=g) * router.weight.data.std())
        up = learner.forward_logprobs(tokens, lengths=lengths, extras=ForwardExtras(routes=RouteRequest(replay=routes)))
        own = learner.forward_logprobs(tokens, lengths=lengths)["logprobs"]
        mask = _real(lengths, tokens.shape[1] - 1).float()
        step = learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()), lengths=lengths, lr=0.0,
                                  extras=ForwardExtras(routes=RouteRequest(replay=routes)))
        result.update(replayed=up["logprobs"], own=own, applied=up["routing"].metrics,
                      step_applied=step["routing/replay_applied_fraction"])
    return result


def _check_routing(results, ref_routes, replayed_ref, lengths):
    real = _real(lengths, replayed_ref.shape[1])
    for r in results:
        assert r["routes"].layers == ref_routes.layers
        assert torch.equal(r["routes"].indices.sort(-1).values, ref_routes.indices.sort(-1).values)
        assert r["applied"]["routing/replay_applied_fraction"] == 1.0 and r["step_applied"] == 1.0
        assert (r["own"] - r["replayed"])[real].abs().max() > 1e-3, "re-drawn routers must route otherwise"
        assert (r["replayed"] - replayed_ref).abs().max() < 1e-5


@pytest.fixture(scope="module")
def cp1_routing(moe_dir, batch):
    tokens, lengths = batch
    ref = run_distributed(routing_worker, 1, args=(moe_dir, tokens, lengths, 1, 1, "own"))[0]
    return ref["routes"], ref["replayed"]


def test_cp2_routing_replay_equals_cp1(moe_dir, batch, cp1_routing):
    tokens, lengths = batch
    routes, replayed = cp1_routing
    _check_routing(run_distributed(routing_worker, 2, args=(moe_dir, tokens, lengths, 1, 2, routes)), routes, replayed,
                   lengths)


@pytest.mark.slow
def test_tp2_cp2_routing_replay_equals_cp1(moe_dir, batch, cp1_routing):
    tokens, lengths = batch
    routes, replayed = cp1_routing
    _check_routing(run_distributed(routing_worker, 4, args=(moe_dir, tokens, lengths, 2, 2, routes)), routes, replayed,
                   lengths)


@pytest.mark.slow
def test_tp2_cp2_losses_and_keep_sets_equal_cp1(moe_dir, batch):
    tokens, lengths = batch
    allowed = _keep_sets(tokens)
    ref = run_distributed(loss_worker, 1, args=(moe_dir, tokens, lengths, 1, 1, allowed))[0]
    for out in run_distributed(loss_worker, 4, args=(moe_dir, tokens, lengths, 2, 2, allowed)):
        assert (out["masked"] - ref["masked"]).abs().max() < 1e-5
        for case in AGGREGATIONS:
            assert abs(out[case]["loss"] - ref[case]["loss"]) < 1e-6, case


@pytest.mark.slow
def test_mla_cp2_matches_hf_and_cp1(tmp_path, batch):
    """Multi-latent attention (a tiny DeepSeek-V3, YaRN RoPE as released) at cp 2: logprobs and entropies against HF
    transformers, every gradient of an SFT step against cp 1's."""
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    tokens, lengths = batch
    model_dir = str(build_tiny_deepseek(tmp_path / "ds", seed=3, layers=2))
    ref_lp, ref_ent = hf_reference(model_dir, tokens)
    real = _real(lengths, tokens.shape[1] - 1)
    base = run_distributed(hf_worker, 1, args=(model_dir, tokens, lengths, 1, 1))[0][3]
    for lp, ent, seen, grads in run_distributed(hf_worker, 2, args=(model_dir, tokens, lengths, 1, 2)):
        assert seen == [6, 8]
        assert (lp.double() - ref_lp)[real].abs().max() < 1e-4
        assert (ent.double() - ref_ent)[real].abs().max() < 1e-4
        assert sorted(grads) == sorted(base)
        for name, g in base.items():
            assert (grads[name] - g).abs().max() < 1e-5, name


def pipeline_worker(rank, world, model_dir, tokens, lengths, pp, cp, vpp=1):
    """Logprobs, entropies and R2's recorded routes, then one SFT step: its loss and every full gradient this rank's
    stage (its model chunks at vpp > 1) holds."""
    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.learner.chunks import chunks_of
    from megatron_sparse_rl.learner.extras import ForwardExtras, RouteRequest
    from megatron_sparse_rl.learner.params import gather_full, local_params
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world, model_dir, pp=pp, cp=cp, vpp=vpp, clip=0.0, routing=RoutingConfig(mode="R2"))
    assert len(chunks_of(learner.model)) == vpp
    out = learner.forward_logprobs(tokens, lengths=lengths, extras=ForwardExtras(routes=RouteRequest(record=True)))
    mask = _real(lengths, tokens.shape[1] - 1).float()
    loss = learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()), lengths=lengths).get("loss")
    grads = {}
    for name, lp in local_params(learner.model, learner.groups).items():
        grad = getattr(lp.param, "main_grad", None)
        if grad is not None:
            grads[name] = gather_full(type(lp)(lp.full_name, grad, lp.tp_dim, lp.glu, lp.expert), learner.groups)
    return out["logprobs"], out["entropy"], out["routing"].routes, loss, grads


@pytest.mark.slow
@pytest.mark.parametrize("layers,vpp", [(3, 1), (5, 2)])
def test_pp2_cp2_matches_hf_and_pp1(tmp_path, batch, layers, vpp):
    """pp 2 x cp 2 (4 ranks) on a 3-layer tiny Qwen3-MoE, stages 2,1, and pp 2 x vpp 2 x cp 2 (the interleaved
    schedule) on a 5-layer one, virtual stages 2,1,1,1: logprobs and entropies against HF transformers, recorded
    routes, the loss and every gradient against pp 1 cp 1."""
    tokens, lengths = batch
    model_dir = str(build_tiny_hf_model(tmp_path / "m", layers=layers, seed=3))
    ref_lp, ref_ent = hf_reference(model_dir, tokens)
    real = _real(lengths, tokens.shape[1] - 1)
    _, _, routes, loss1, base = run_distributed(pipeline_worker, 1, args=(model_dir, tokens, lengths, 1, 1))[0]
    held, losses = {}, []
    for lp, ent, got_routes, loss, grads in run_distributed(pipeline_worker, 4,
                                                             args=(model_dir, tokens, lengths, 2, 2, vpp)):
        assert (lp.double() - ref_lp)[real].abs().max() < 1e-4
        assert (ent.double() - ref_ent)[real].abs().max() < 1e-4
        assert torch.equal(got_routes.indices.sort(-1).values, routes.indices.sort(-1).values)
        losses.append(loss)
        held.update(grads)
    assert abs(losses[-1] - loss1) < 1e-5  # the last stage computes the loss
    assert sorted(held) == sorted(base)
    for name, g in base.items():
        assert (held[name] - g).abs().max() < 1e-5, name


def resume_worker(rank, world, model_dir, tokens, lengths, pp, cp, ckpt, mode):
    """mode 'straight': two SFT steps, a checkpoint (weights and optimizer) saved after the first; mode 'resume': that
    checkpoint loaded at this layout, then the second step. Returns the losses of the steps this process ran."""
    from megatron_sparse_rl.learner.checkpoint import load_learner, save_learner
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world, model_dir, pp=pp, cp=cp, lr=1e-2, load=mode == "straight")
    mask = _real(lengths, tokens.shape[1] - 1).float()
    steps = 2
    if mode == "resume":
        load_learner(learner, ckpt)
        steps = 1
    losses = []
    for step in range(steps):
        if mode == "straight" and step == 1:
            save_learner(learner, ckpt)
        losses.append(learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()), lengths=lengths).get("loss"))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("layers,pp", [(3, 2), (4, 3)], ids=["pp2_cp2", "pp3_cp2"])
def test_checkpoint_from_pp1_resumes_at_uneven_pp_cp2(tmp_path, batch, layers, pp):
    """A learner checkpoint saved at pp 1 cp 1 resumes at pp 2 x cp 2 (3 layers, stages 2,1; 4 ranks) and at pp 3 x
    cp 2 (4 layers, stages 2,1,1; 6 ranks): the next step's loss equals the straight run's."""
    tokens, lengths = batch
    model_dir = str(build_tiny_hf_model(tmp_path / "model", layers=layers, seed=3))
    ckpt = str(tmp_path / "ckpt")
    straight = run_distributed(resume_worker, 1, args=(model_dir, tokens, lengths, 1, 1, ckpt, "straight"))[0]
    resumed = run_distributed(resume_worker, 2 * pp, args=(model_dir, tokens, lengths, pp, 2, ckpt, "resume"))[-1]
    assert straight[0] - straight[1] > 1e-3, "the first step must change the model"
    assert resumed[0] == pytest.approx(straight[1], rel=1e-6, abs=1e-6)


@pytest.mark.slow
def test_mla_cp2_losses_and_keep_sets_equal_cp1(tmp_path, batch):
    """Multi-latent attention at cp 2: one keep set per layer for all heads (MLA's shared latent rows) gives cp 1's
    logprobs, and each loss aggregation equals cp 1's."""
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    tokens, lengths = batch
    model_dir = str(build_tiny_deepseek(tmp_path / "ds", seed=3, layers=2))
    allowed = _keep_sets(tokens, kv_heads=1)
    ref = run_distributed(loss_worker, 1, args=(model_dir, tokens, lengths, 1, 1, allowed))[0]
    assert (ref["masked"] - ref["plain"]).abs().max() > 1e-3, "the keep sets must change the logprobs"
    for out in run_distributed(loss_worker, 2, args=(model_dir, tokens, lengths, 1, 2, allowed)):
        assert (out["masked"] - ref["masked"]).abs().max() < 1e-5
        for case in AGGREGATIONS:
            assert abs(out[case]["loss"] - ref[case]["loss"]) < 1e-6, case
