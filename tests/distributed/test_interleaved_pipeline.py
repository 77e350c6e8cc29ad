"""Interleaved pipelines (parallel.vpp): a tiny Qwen3-MoE of 7 layers at pp 2 x vpp 2 on 2 gloo ranks, the layers
balanced over the 4 virtual stages as 2,2,2,1 (rank 0 holds layers 1-2 and 5-6 as its two model chunks, rank 1 layers
3-4 and 7). Logprobs, entropies and every parameter's gradient against HF transformers (fp32); R2 routes recorded
equal to pp 1's and pp 1's routes replayed under re-drawn routers (applied fraction 1.0, pp 1's logprobs); per-layer
keep-set masks giving pp 1's logprobs; HF ->
torch_dist -> HF conversion bit-exact at vpp and across splits; forward-only calls of any row count (padded); a tiny
DeepSeek-V3 (MLA) against HF (slow); the weight-sync stream equal to the checkpoint; a
learner checkpoint saved with chunks reloading at pp 1 and at another split (slow). The refusals of bad settings are
unit-tested (tests/unit/test_pipeline_stages.py)."""
import pytest
import torch

from tests import learner_workers as W
from tests.distributed.test_convert import _assert_identical
from tests.distributed.test_deepseek import hf_grads
from tests.distributed.test_learner import hf_reference
from tests.distributed.test_uneven_pipeline import seven, tokens  # noqa: F401  (the 7-layer model and its batch)
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

CHUNK_LAYERS = {0: [[1, 2], [5, 6]], 1: [[3, 4], [7]]}  # layer_number of each rank's chunks at 2,2,2,1


def _chunk_layers(learner):
    from megatron_sparse_rl.learner.chunks import chunks_of, unwrap

    return [[int(layer.layer_number) for layer in unwrap(c).decoder.layers] for c in chunks_of(learner.model)]


def forward_backward_worker(rank, world, model_dir, tokens, pp, vpp, layout, mbs=2):
    """Logprobs and entropy, each chunk's layer numbers, then the gradient of the mean next-token NLL (one
    forward/backward through the schedule, no optimizer step) on every parameter this rank holds (global names)."""
    from megatron_sparse_rl.learner.extras import ForwardExtras
    from megatron_sparse_rl.learner.params import gather_full, local_params
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world, model_dir, pp=pp, vpp=vpp, pipeline_layout=layout, mbs=mbs)
    out = learner.forward_logprobs(tokens)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    learner.model.train()
    learner.model.zero_grad_buffer()
    learner._run_schedule(tokens, make_sft_loss(mask, mask.sum().item()), forward_only=False, extras=ForwardExtras())
    grads = {}
    for name, lp in local_params(learner.model, learner.groups).items():
        grad = getattr(lp.param, "main_grad", None)
        if grad is not None:
            grads[name] = gather_full(type(lp)(lp.full_name, grad, lp.tp_dim, lp.glu, lp.expert), learner.groups)
    return dict(lp=out["logprobs"], ent=out["entropy"], layers=_chunk_layers(learner), grads=grads)


def _check_against_hf(model_dir, tokens, results):
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.models.tensor_map import to_mcore

    ref_lp, ref_ent = hf_reference(model_dir, tokens)
    held = {}
    for r in results:
        assert (r["lp"].double() - ref_lp).abs().max() < 1e-4
        assert (r["ent"].double() - ref_ent).abs().max() < 1e-4
        assert not held.keys() & r["grads"].keys(), "a parameter held by two pipeline ranks"
        held.update(r["grads"])
    hf = hf_grads(model_dir, tokens)
    adapter, spec = load_spec(model_dir)
    compared = 0
    for tm in adapter.tensor_maps(spec):
        if tm.mcore.endswith("router.expert_bias"):
            continue  # DeepSeek-V3's router bias: a buffer, no gradient on either side
        ref = to_mcore(tm, [hf[n] for n in tm.hf], spec)
        assert ref.norm() > 0, tm.mcore
        assert (held[tm.mcore] - ref).abs().max() < 1e-4, tm.mcore
        compared += 1
    assert compared == len(held)


def test_interleaved_matches_hf_logprobs_and_gradients(seven, tokens):
    """Micro-batches of 1 row: 4 of them, twice pp, so the schedule's steady state sends an activation forward and a
    gradient back in one exchange (batched, at pp 2 the peer received them swapped: learner/model.py)."""
    results = run_distributed(forward_backward_worker, 2, args=(seven, tokens, 2, 2, None, 1))
    assert [r["layers"] for r in results] == [CHUNK_LAYERS[0], CHUNK_LAYERS[1]]
    _check_against_hf(seven, tokens, results)


@pytest.mark.slow
def test_interleaved_written_layout_matches_hf(seven, tokens):
    """A written layout of 4 virtual stages, 1,3,2,1: rank 0 holds layers 1 and 5-6, rank 1 layers 2-4 and 7."""
    results = run_distributed(forward_backward_worker, 2, args=(seven, tokens, 2, 2, "Et|ttt|tt|tL"))
    assert [r["layers"] for r in results] == [[[1], [5, 6]], [[2, 3, 4], [7]]]
    _check_against_hf(seven, tokens, results)


@pytest.mark.slow
def test_interleaved_mla_matches_hf(tmp_path):
    """A tiny DeepSeek-V3 (multi-head latent attention, YaRN RoPE, a first dense layer, grouped sigmoid router) of 5
    layers at pp 2 x vpp 2 (virtual stages 2,1,1,1), micro-batches of 1 row: logprobs, entropies and every gradient
    against transformers (measured: logprobs 1.7e-5, gradients 1.4e-5 relative at worst)."""
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek
    from tests.distributed.test_deepseek import TOKENS

    model_dir = str(build_tiny_deepseek(tmp_path / "hf", seed=3, layers=5))
    results = run_distributed(forward_backward_worker, 2, args=(model_dir, TOKENS, 2, 2, None, 1))
    assert [r["layers"] for r in results] == [[[1, 2], [4]], [[3], [5]]]
    _check_against_hf(model_dir, TOKENS, results)


def small_calls_worker(rank, world, model_dir, tokens, lengths, pp, vpp):
    """Forward-only calls at micro-batches of 2 whose rows make no multiple of pp equal micro-batches: 1 row (a run's
    weight-sync probe) and 3 rows with `lengths` (grouped longest first); then a routed call of 1 row, which would
    need padding at vpp > 1: its error, or None where it ran."""
    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.learner.extras import ForwardExtras, RouteRequest

    learner = W.make_learner(world, model_dir, pp=pp, vpp=vpp, mbs=2, routing=RoutingConfig(mode="R2"))
    out = {"one": learner.forward_logprobs(tokens[:1])["logprobs"],
           "three": learner.forward_logprobs(tokens[:3], lengths=lengths)["logprobs"], "refused": None}
    try:
        learner.forward_logprobs(tokens[:1], extras=ForwardExtras(routes=RouteRequest(record=True)))
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_forward_only_calls_of_any_row_count_at_vpp(seven, tokens):
    """At pp 2 x vpp 2 a forward-only call of 1 row, or of 3 rows of micro-batch 2, is padded to 2 micro-batches with
    repeats of its last row, whose outputs are dropped: the logprobs equal HF transformers' on the same rows (1e-4)
    and the unpadded pp 1 learner's (1e-5); a routed call that would need padding is refused."""
    lengths = torch.tensor([14, 9, 12])
    hf, _ = hf_reference(seven, tokens[:3])
    real = torch.arange(tokens.shape[1] - 1)[None] < (lengths - 1)[:, None]  # beyond: 0 (forward_logprobs)
    ref = run_distributed(small_calls_worker, 1, args=(seven, tokens, lengths, 1, 1))[0]
    assert ref["refused"] is None
    for r in [ref, *run_distributed(small_calls_worker, 2, args=(seven, tokens, lengths, 2, 2))]:
        assert (r["one"].double() - hf[:1]).abs().max() < 1e-4
        assert (r["three"][real].double() - hf[real]).abs().max() < 1e-4
        assert not r["three"][~real].any()
        assert (r["one"] - ref["one"]).abs().max() < 1e-5
        assert (r["three"] - ref["three"]).abs().max() < 1e-5
    assert "would need padding rows at parallel.pp=2 x vpp=2" in r["refused"]


def routes_worker(rank, world, model_dir, tokens, pp, vpp, routes, allowed):
    """The routes the learner records in its forward (R2's old forward) and its logprobs; the logprobs under the
    per-layer, per-KV-head keep-set masks `allowed` (learner/attention_mask.py picks each layer's slice by its global
    layer number); then `routes` (None: the ones just recorded) replayed under re-drawn routers in a forward, and in a training step (lr 0) in its forward and
    backward: the learner's side of R2 and R3 alike (they differ in whose routes are handed in)."""
    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.learner.extras import ForwardExtras, RouteRequest
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.moe.replay import find_routers

    learner = W.make_learner(world, model_dir, pp=pp, vpp=vpp, mbs=2, routing=RoutingConfig(mode="R2"), clip=0.0)
    lengths = torch.full((tokens.shape[0],), tokens.shape[1])
    out = learner.forward_logprobs(tokens, extras=ForwardExtras(routes=RouteRequest(record=True, lengths=lengths)))
    kept = learner.forward_logprobs(tokens, extras=ForwardExtras(attention_mask=allowed))["logprobs"]
    for router in find_routers(learner.model):  # re-drawn per global layer: the same at every split
        g = torch.Generator().manual_seed(7 + int(router.layer_number))
        router.weight.data.copy_(torch.randn(router.weight.shape, generator=g) * router.weight.data.std())
    request = RouteRequest(replay=out["routing"].routes if routes is None else routes, lengths=lengths)
    up = learner.forward_logprobs(tokens, extras=ForwardExtras(routes=request))
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    step = learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()), lengths=lengths,
                              extras=ForwardExtras(routes=request), lr=0.0)
    return dict(routes=out["routing"].routes, plain=out["logprobs"], kept=kept, replayed=up["logprobs"], applied=(
        up["routing"].metrics["routing/replay_applied_fraction"], step["routing/replay_applied_fraction"]),
        loss=step.get("loss"))


def test_routing_replay_and_keep_sets_at_vpp_equal_pp1(seven, tokens):
    """Routes recorded at pp 2 x vpp 2 equal pp 1's (every layer's column from the chunk holding it); pp 1's routes
    replayed under re-drawn routers, in a forward and in a training step, apply to every router token and give pp 1's
    logprobs and loss; random per-layer keep-set masks give pp 1's logprobs."""
    b, s = tokens.shape[0], tokens.shape[1] - 1
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool)) & (
        torch.rand(b, 7, 2, s, s, generator=torch.Generator().manual_seed(4)) < 0.6)
    allowed |= torch.eye(s, dtype=torch.bool)
    ref = run_distributed(routes_worker, 1, args=(seven, tokens, 1, 1, None, allowed))[0]
    routes = ref["routes"]
    assert (ref["replayed"] - ref["plain"]).abs().max() > 1e-3, "the re-drawn routers must change the logprobs"
    assert (ref["kept"] - ref["plain"]).abs().max() > 1e-3, "the keep sets must change the logprobs"
    results = run_distributed(routes_worker, 2, args=(seven, tokens, 2, 2, routes, allowed))
    for r in results:
        assert r["routes"].layers == routes.layers == tuple(range(7))
        assert torch.equal(r["routes"].indices.sort(-1).values, routes.indices.sort(-1).values)
        assert r["applied"] == (1.0, 1.0)
        assert (r["plain"] - ref["plain"]).abs().max() < 1e-5
        assert (r["kept"] - ref["kept"]).abs().max() < 1e-5
        assert (r["replayed"] - ref["replayed"]).abs().max() < 1e-5
    assert abs(results[-1]["loss"] - ref["loss"]) < 1e-5  # the last pipeline rank computes the loss


def convert_worker(rank, world, hf, root):
    """HF -> torch_dist at pp 2 x vpp 2 (virtual stages 2,2,2,1) -> HF at the same split, and at pp 2 without
    interleaving (stages 4,3)."""
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf, f"{root}/mc_vpp", tp=1, ep=1, pp=2, vpp=2)
    mcore_to_hf(f"{root}/mc_vpp", f"{root}/hf_vpp", pp=2, vpp=2)
    mcore_to_hf(f"{root}/mc_vpp", f"{root}/hf_vpp_at_pp2", pp=2)


def export_pp1_worker(rank, world, root):
    from megatron_sparse_rl.checkpoint.convert import mcore_to_hf

    mcore_to_hf(f"{root}/mc_vpp", f"{root}/hf_vpp_at_pp1")


def test_conversion_bit_exact_at_vpp(seven, tmp_path):
    run_distributed(convert_worker, 2, args=(seven, str(tmp_path)))
    _assert_identical(seven, tmp_path / "hf_vpp")
    _assert_identical(seven, tmp_path / "hf_vpp_at_pp2")
    run_distributed(export_pp1_worker, 1, args=(str(tmp_path),))  # saved with chunks, exported unpipelined
    _assert_identical(seven, tmp_path / "hf_vpp_at_pp1")


def export_worker(rank, world, model_dir):
    """The weight-sync stream (weight_sync/export.py iter_hf_tensors) of a freshly loaded learner: on every rank."""
    from megatron_sparse_rl.weight_sync import iter_hf_tensors

    learner = W.make_learner(world, model_dir, pp=2, vpp=2)
    return {name: t.clone() for name, t in iter_hf_tensors(learner)}


def test_weight_sync_stream_at_vpp_is_the_checkpoint(seven):
    """Each rank sends its chunks' layers: the stream every rank sees equals the HF checkpoint, tensor for tensor."""
    from tests.distributed.test_convert import _load_dir

    original = _load_dir(seven)
    for streamed in run_distributed(export_worker, 2, args=(seven,)):
        assert sorted(streamed) == sorted(original)
        for name, t in original.items():
            assert torch.equal(streamed[name].to(t.dtype), t), name


def save_load_worker(rank, world, model_dir, tokens, pp, vpp, layout, ckpt, mode):
    """'save': one SFT step from HF, save the learner (weights and optimizer); 'load': load it. Logprobs after."""
    from megatron_sparse_rl.learner.checkpoint import load_learner, save_learner
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world, model_dir, pp=pp, vpp=vpp, pipeline_layout=layout, load=mode == "save")
    if mode == "save":
        mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
        learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
        save_learner(learner, ckpt)
    else:
        load_learner(learner, ckpt, load_optimizer=True)
    return learner.forward_logprobs(tokens)["logprobs"]


@pytest.mark.slow
def test_learner_checkpoint_saved_with_chunks_reloads_at_other_splits(seven, tokens, tmp_path):
    """Saved at pp 2 x vpp 2 (2,2,2,1) after one step: reloads (weights and optimizer) at a written 1,3,2,1, at pp 1,
    and a checkpoint saved at pp 1 reloads with chunks; logprobs equal (< 1e-5)."""
    ckpt, ckpt1 = str(tmp_path / "ckpt"), str(tmp_path / "ckpt1")
    saved = run_distributed(save_load_worker, 2, args=(seven, tokens, 2, 2, None, ckpt, "save"))[0]
    for lp in run_distributed(save_load_worker, 2, args=(seven, tokens, 2, 2, "Et|ttt|tt|tL", ckpt, "load")):
        assert (lp - saved).abs().max() < 1e-5
    assert (run_distributed(save_load_worker, 1, args=(seven, tokens, 1, 1, None, ckpt, "load"))[0] - saved
            ).abs().max() < 1e-5
    saved1 = run_distributed(save_load_worker, 1, args=(seven, tokens, 1, 1, None, ckpt1, "save"))[0]
    for lp in run_distributed(save_load_worker, 2, args=(seven, tokens, 2, 2, None, ckpt1, "load")):
        assert (lp - saved1).abs().max() < 1e-5
