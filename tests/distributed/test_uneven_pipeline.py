"""Uneven pipeline stages (parallel.pp not dividing the layer count, or parallel.pipeline_layout): a tiny Qwen3-MoE of
7 layers at pp 3 on 3 gloo ranks, stages 3,2,2 chosen automatically and 2,3,2 written as a layout string. Logprobs
against HF transformers (fp32, 1e-4), each stage's layers where Megatron's offset puts them, routes recorded equal
to pp 1's and pp 1's routes replayed under re-drawn routers, a training step's gradients equal to pp 1's (slow),
the weight-sync stream equal to the checkpoint, per-layer keep-set masks giving pp 1's logprobs, DSA indexer replay
(a 5-layer DeepSeek-V3.2 at stages 2,2,1, slow) recording and replaying as pp 1 does, and HF -> torch_dist -> HF conversion bit-exact at the uneven split
and across splits (3,2,2 -> pp 1; 2,3,2 -> 3,2,2), and a learner checkpoint (weights and optimizer) saved at 3,2,2
reloading at 2,3,2 and at pp 1 with the same logprobs (slow). The refusals of bad layouts are unit-tested (tests/unit/test_pipeline_stages.py)."""
import pytest
import torch

from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests import learner_workers as W
from tests.distributed.test_convert import _assert_identical
from tests.distributed.test_learner import hf_reference
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("seven"), layers=7, seed=3))


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(0))


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def stage_worker(rank, world, model_dir, tokens, pp, layout, routes):
    """Logprobs with the learner's routes recorded (R2's old forward), each stage's layer numbers and Megatron's
    offset; then, given `routes` (pp 1's), the logprobs replaying them under re-drawn routers."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.learner.extras import ForwardExtras, RouteRequest
    from megatron_sparse_rl.moe.replay import find_routers

    learner = W.make_learner(world, model_dir, pp=pp, pipeline_layout=layout, routing=RoutingConfig(mode="R2"))
    lengths = torch.full((tokens.shape[0],), tokens.shape[1])
    out = learner.forward_logprobs(tokens, extras=ForwardExtras(routes=RouteRequest(record=True, lengths=lengths)))
    model = _unwrap(learner.model)
    numbers = [int(layer.layer_number) for layer in model.decoder.layers]
    replayed = None
    if routes is not None:
        for router in find_routers(learner.model):  # re-drawn per global layer: the same at every split
            g = torch.Generator().manual_seed(7 + int(router.layer_number))
            router.weight.data.copy_(torch.randn(router.weight.shape, generator=g) * router.weight.data.std())
        up = learner.forward_logprobs(tokens, extras=ForwardExtras(routes=RouteRequest(replay=routes, lengths=lengths)))
        assert up["routing"].metrics["routing/replay_applied_fraction"] == 1.0
        replayed = up["logprobs"]
    return dict(lp=out["logprobs"], ent=out["entropy"], routes=out["routing"].routes, numbers=numbers,
                offset=get_transformer_layer_offset(model.config), replayed=replayed)


@pytest.fixture(scope="module")
def pp1(seven, tokens):
    """pp 1: the routes it records, and the logprobs replaying them under re-drawn routers."""
    routes = run_distributed(stage_worker, 1, args=(seven, tokens, 1, None, None))[0]["routes"]
    return routes, run_distributed(stage_worker, 1, args=(seven, tokens, 1, None, routes))[0]["replayed"]


@pytest.mark.parametrize("layout,stages", [(None, (3, 2, 2)), ("Ett|ttt|ttL", (2, 3, 2))], ids=["auto", "layout"])
def test_uneven_stages_match_hf_and_replay(seven, tokens, pp1, layout, stages):
    ref_lp, ref_ent = hf_reference(seven, tokens)
    routes, replayed = pp1
    results = run_distributed(stage_worker, 3, args=(seven, tokens, 3, layout, routes))
    start = 0
    for r in results:
        assert (r["lp"].double() - ref_lp).abs().max() < 1e-4
        assert (r["ent"].double() - ref_ent).abs().max() < 1e-4
        assert r["offset"] == start and r["numbers"] == list(range(start + 1, start + 1 + len(r["numbers"])))
        start += len(r["numbers"])
        assert r["routes"].layers == routes.layers == tuple(range(7))
        assert torch.equal(r["routes"].indices.sort(-1).values, routes.indices.sort(-1).values)
        assert (r["replayed"] - replayed).abs().max() < 1e-5
    assert tuple(len(r["numbers"]) for r in results) == stages


def grads_worker(rank, world, model_dir, tokens, pp, layout):
    """One SFT step's loss and every full gradient this rank's stage holds (global names)."""
    from megatron_sparse_rl.learner.params import gather_full, local_params
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world, model_dir, pp=pp, pipeline_layout=layout, mbs=4, clip=0.0)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    metrics = learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
    grads = {}
    for name, lp in local_params(learner.model, learner.groups).items():
        grad = getattr(lp.param, "main_grad", None)
        if grad is None:
            grad = lp.param.grad
        if grad is not None:
            grads[name] = gather_full(type(lp)(lp.full_name, grad, lp.tp_dim, lp.glu, lp.expert), learner.groups)
    return metrics.get("loss"), grads


@pytest.mark.slow
def test_uneven_stages_gradients_equal_pp1(seven, tokens):
    loss1, ref = run_distributed(grads_worker, 1, args=(seven, tokens, 1, None))[0]
    held, losses = {}, []
    for loss, grads in run_distributed(grads_worker, 3, args=(seven, tokens, 3, None)):
        held.update(grads)
        losses.append(loss)
    assert abs(losses[-1] - loss1) < 1e-5  # the last stage computes the loss
    assert sorted(held) == sorted(ref)
    for name, g in ref.items():
        assert (held[name] - g).abs().max() < 1e-5, name


def convert_worker(rank, world, hf, root, pp):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf, f"{root}/mc_pp{pp}", tp=1, ep=1, pp=pp)
    mcore_to_hf(f"{root}/mc_pp{pp}", f"{root}/hf_pp{pp}", pp=pp)
    # saved at a written split (2,3,2), exported at the balanced one (3,2,2)
    hf_to_mcore(hf, f"{root}/mc_layout", tp=1, ep=1, pp=pp, pipeline_layout="Ett|ttt|ttL")
    mcore_to_hf(f"{root}/mc_layout", f"{root}/hf_layout_at_auto", pp=pp)


def export_pp1_worker(rank, world, root):
    from megatron_sparse_rl.checkpoint.convert import mcore_to_hf

    mcore_to_hf(f"{root}/mc_pp3", f"{root}/hf_pp3_at_pp1")


def test_conversion_bit_exact_at_uneven_pp(seven, tmp_path):
    run_distributed(convert_worker, 3, args=(seven, str(tmp_path), 3))
    _assert_identical(seven, tmp_path / "hf_pp3")
    _assert_identical(seven, tmp_path / "hf_layout_at_auto")
    run_distributed(export_pp1_worker, 1, args=(str(tmp_path),))  # saved at stages 3,2,2, exported unpipelined
    _assert_identical(seven, tmp_path / "hf_pp3_at_pp1")


def export_worker(rank, world, model_dir, layout):
    """The weight-sync stream (weight_sync/export.py iter_hf_tensors) of a freshly loaded learner: on every rank."""
    from megatron_sparse_rl.weight_sync import iter_hf_tensors

    learner = W.make_learner(world, model_dir, pp=3, pipeline_layout=layout)
    return {name: t.clone() for name, t in iter_hf_tensors(learner)}


@pytest.mark.parametrize("layout", [None, pytest.param("Ett|ttt|ttL", marks=pytest.mark.slow)], ids=["auto", "layout"])
def test_weight_sync_stream_at_uneven_pp_is_the_checkpoint(seven, layout):
    from tests.distributed.test_convert import _load_dir

    original = _load_dir(seven)
    for streamed in run_distributed(export_worker, 3, args=(seven, layout)):
        assert sorted(streamed) == sorted(original)
        for name, t in original.items():
            assert torch.equal(streamed[name].to(t.dtype), t), name


def keep_set_worker(rank, world, model_dir, tokens, pp, allowed):
    """Logprobs under per-layer, per-KV-head keep-set masks (learner/attention_mask.py picks each layer's slice by
    its global layer number)."""
    from megatron_sparse_rl.learner.extras import ForwardExtras

    learner = W.make_learner(world, model_dir, pp=pp)
    return learner.forward_logprobs(tokens, extras=ForwardExtras(attention_mask=allowed))["logprobs"]


def test_keep_set_masks_follow_uneven_stages(seven, tokens):
    b, s = tokens.shape[0], tokens.shape[1] - 1
    g = torch.Generator().manual_seed(4)
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool)) & (torch.rand(b, 7, 2, s, s, generator=g) < 0.6)
    allowed |= torch.eye(s, dtype=torch.bool)
    ref = run_distributed(keep_set_worker, 1, args=(seven, tokens, 1, allowed))[0]
    plain = run_distributed(keep_set_worker, 1, args=(seven, tokens, 1, None))[0]
    assert (ref - plain).abs().max() > 1e-3, "the keep sets must change the logprobs for this to mean anything"
    for lp in run_distributed(keep_set_worker, 3, args=(seven, tokens, 3, allowed)):  # stages 3,2,2
        assert (lp - ref).abs().max() < 1e-5


def indexer_worker(rank, world, model_dir, pp, recorded):
    """DSA indexer replay (R2) at `pp`: the old forward's record; given `recorded` (pp 1's), the logprobs replaying it
    under perturbed indexers (each perturbed by its global layer) and the applied fraction."""
    from megatron_sparse_rl.learner.extras import ForwardExtras
    from megatron_sparse_rl.learner.indexer_replay import IndexerRequest
    from tests.distributed.test_indexer_replay import LENGTHS, TOKENS, perturb

    learner = W.make_learner(world, model_dir, pp=pp, mbs=2, indexer_replay="R2")

    def call(request):
        return learner.forward_logprobs(TOKENS, lengths=LENGTHS, extras=ForwardExtras(indexer=request))

    out = {"record": call(learner.indexer.old_forward())["indexer"].record}
    if recorded is not None:
        for j, module in enumerate(learner.indexer.model.indexers):
            perturb(module.linear_weights_proj.weight, learner.indexer._first + j)
        up = call(IndexerRequest(replay=recorded, record=True, compare_with=recorded))
        out["replayed"], out["metrics"] = up["logprobs"], up["indexer"].metrics
    return out


@pytest.mark.slow
def test_indexer_replay_follows_uneven_stages(tmp_path):
    """A tiny DeepSeek-V3.2 (DSA) of 5 layers at pp 3, stages 2,2,1: the indexers' record equals pp 1's, and pp 1's
    record replayed under perturbed indexers gives pp 1's logprobs, applied everywhere."""
    from megatron_sparse_rl.models.tiny_families import build_tiny_dsa
    from tests.distributed.test_indexer_replay import LENGTHS, TOKENS, TOPK

    model_dir = str(build_tiny_dsa(tmp_path / "hf", arch="deepseek_v32", layers=5, index_topk=TOPK, rope="yarn",
                                   seed=3))
    recorded = run_distributed(indexer_worker, 1, args=(model_dir, 1, None), timeout=300)[0]["record"]
    ref = run_distributed(indexer_worker, 1, args=(model_dir, 1, recorded), timeout=300)[0]
    assert ref["metrics"]["indexer/flip_rate"] > 0, "the perturbed indexers must choose otherwise somewhere"
    real = torch.arange(TOKENS.shape[1] - 1)[None, :] < (LENGTHS - 1)[:, None]  # pp > 1 runs padded rows whole
    for out in run_distributed(indexer_worker, 3, args=(model_dir, 3, recorded), timeout=300):
        assert out["record"].indices.shape == recorded.indices.shape and recorded.indices.shape[2] == 5
        assert torch.equal(out["record"].indices[real], recorded.indices[real])
        assert (out["replayed"] - ref["replayed"])[real].abs().max() < 1e-5
        assert out["metrics"]["indexer/replay_applied_fraction"] == 1.0
        assert out["metrics"] == pytest.approx(ref["metrics"])


def save_load_worker(rank, world, model_dir, tokens, pp, layout, ckpt, mode):
    """'save': one SFT step from HF, save the learner (weights and optimizer); 'load': load it. Logprobs after."""
    from megatron_sparse_rl.learner.checkpoint import load_learner, save_learner
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world, model_dir, pp=pp, pipeline_layout=layout, load=mode == "save")
    if mode == "save":
        mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
        learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
        save_learner(learner, ckpt)
    else:
        load_learner(learner, ckpt, load_optimizer=True)
    return learner.forward_logprobs(tokens)["logprobs"]


@pytest.mark.slow
def test_learner_checkpoint_saved_at_uneven_stages_reloads_at_another_split(seven, tokens, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(save_load_worker, 3, args=(seven, tokens, 3, None, ckpt, "save"))[0]  # 3,2,2
    for lp in run_distributed(save_load_worker, 3, args=(seven, tokens, 3, "Ett|ttt|ttL", ckpt, "load")):  # 2,3,2
        assert (lp - saved).abs().max() < 1e-5
    loaded = run_distributed(save_load_worker, 1, args=(seven, tokens, 1, None, ckpt, "load"))[0]
    assert (loaded - saved).abs().max() < 1e-5
