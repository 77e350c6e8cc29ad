"""DeepSeek-V3 / Kimi-K2 architecture (multi-head latent attention, sigmoid group-limited router with expert bias,
shared experts, first-k dense layers, YaRN or default RoPE) on the Megatron learner, against HF transformers (fp32):

- learner logprobs and entropies within 1e-4 of transformers at TP1 (YaRN and default RoPE) and at TP2 x EP2, and
  every parameter's gradient within 1e-4 relative of transformers' autograd;
- HF -> torch_dist -> HF round trips bit-exact at TP2 x EP2 and PP2 (every tensor, the router's
  e_score_correction_bias included), and the converted checkpoint loads into a learner that matches transformers;
- routing replay with the grouped sigmoid router: replay selects the recorded experts even after the router
  weights and expert bias are re-drawn, the combine weights are the UNBIASED sigmoid scores at those experts
  (renormalised, times the routed scaling factor; checked against a float64 formula written here), and a train
  step under replay still moves every router weight.
Run: .venv/bin/python -m pytest -q tests/distributed/test_deepseek.py
"""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import learner_workers as W
from tests.distributed.test_learner import hf_reference
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

TOKENS = torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    """4 layers (1 dense + 3 MoE) so that PP2 splits it; YaRN RoPE as the released models."""
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    return str(build_tiny_deepseek(tmp_path_factory.mktemp("ds") / "hf", seed=3, layers=4))


@pytest.fixture(scope="module")
def reference(ds_dir):
    return hf_reference(ds_dir, TOKENS)


def _close(got, ref):
    lp, ent = got
    return max(float((lp.double() - ref[0]).abs().max()), float((ent.double() - ref[1]).abs().max()))


def test_learner_tp1_matches_transformers(ds_dir, reference):
    assert _close(run_distributed(W.logprobs_worker, 1, args=(ds_dir, TOKENS, 1, 1))[0], reference) < 1e-4


def test_learner_tp1_default_rope_matches_transformers(tmp_path):
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    model_dir = str(build_tiny_deepseek(tmp_path / "hf", seed=4, rope="default", layers=2))
    got = run_distributed(W.logprobs_worker, 1, args=(model_dir, TOKENS, 1, 1))[0]
    assert _close(got, hf_reference(model_dir, TOKENS)) < 1e-4


def test_learner_tp2_ep2_matches_transformers(ds_dir, reference):
    for got in run_distributed(W.logprobs_worker, 2, args=(ds_dir, TOKENS, 2, 2)):
        assert _close(got, reference) < 1e-4


def grads_worker(rank, world, model_dir, tokens, tp=1, sp=None):
    """Gradients of the mean next-token NLL on every parameter (Megatron's main_grad after the schedule's
    finalize_model_grads), each gathered whole over its tensor-parallel group; with them the logprobs."""
    from megatron_sparse_rl.learner.extras import ForwardExtras
    from megatron_sparse_rl.learner.params import gather_full, local_params
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world, model_dir, tp=tp, sp=sp)
    logprobs = learner.forward_logprobs(tokens)["logprobs"]
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    learner.model.train()
    learner.model.zero_grad_buffer()
    learner._run_schedule(tokens, make_sft_loss(mask, mask.sum().item()), forward_only=False, extras=ForwardExtras(),
                          lengths=learner._check_lengths(tokens, None))
    grads = {n: gather_full(type(lp)(lp.full_name, lp.param.main_grad, lp.tp_dim, lp.glu, lp.expert), learner.groups)
             for n, lp in local_params(learner.model, learner.groups).items()
             if getattr(lp.param, "main_grad", None) is not None}
    return logprobs, grads


def hf_grads(model_dir, tokens, mask=None, **load) -> dict[str, torch.Tensor]:
    """transformers' fp32 autograd of the mean next-token NLL (over the positions `mask` [b, S-1] keeps; None:
    all): HF checkpoint name -> gradient (fused experts split per expert as the checkpoint names them); parameters
    without a gradient are left out. `load`: from_pretrained arguments."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load)
    logp = torch.log_softmax(model(tokens).logits[:, :-1].double(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    mask = torch.ones_like(logp) if mask is None else mask.double()
    (-(logp * mask).sum() / mask.sum()).backward()
    hf = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        if n.endswith("mlp.experts.gate_up_proj"):  # transformers 5 fuses experts in memory: [E, 2 ffn, h]
            for e, g in enumerate(p.grad.float()):
                gate, up = g.chunk(2)
                hf[n.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                hf[n.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif n.endswith("mlp.experts.down_proj"):
            for e, g in enumerate(p.grad.float()):
                hf[n.replace("down_proj", f"{e}.down_proj.weight")] = g
        else:
            hf[n] = p.grad.float()
    return hf


def assert_grads_match_transformers(model_dir, ours, tokens=TOKENS):
    """`ours` (full Megatron name -> gradient) holds every parameter's gradient, each within 1e-4 relative of
    transformers' autograd on the same loss."""
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.models.tensor_map import to_mcore

    hf = hf_grads(model_dir, tokens)
    adapter, spec = load_spec(model_dir)
    compared = 0
    for tm in adapter.tensor_maps(spec):
        if tm.mcore.endswith("router.expert_bias"):
            continue  # a buffer: no gradient on either side
        ref = to_mcore(tm, [hf[n] for n in tm.hf], spec)
        assert ref.norm() > 0, tm.mcore
        rel = float((ours[tm.mcore] - ref).norm() / ref.norm())
        assert rel < 1e-4, (tm.mcore, rel)
        compared += 1
    assert compared == len(ours)


def test_learner_gradients_match_transformers(ds_dir):
    """Every parameter's gradient (MLA projections and latent norms, YaRN RoPE path, grouped sigmoid router,
    experts, shared experts) within 1e-4 relative of transformers' autograd on the same loss."""
    assert_grads_match_transformers(ds_dir, run_distributed(grads_worker, 1, args=(ds_dir, TOKENS))[0][1])


@pytest.fixture(scope="module")
def ds2_dir(tmp_path_factory):
    """2 layers (1 dense + 1 MoE): the tp 2 gradient test's model, small enough for `make test`."""
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    return str(build_tiny_deepseek(tmp_path_factory.mktemp("ds2") / "hf", seed=5, layers=2))


def test_learner_tp2_gradients_match_transformers(ds2_dir):
    """MLA at tensor parallel 2 (sequence parallel on, as MoE requires): logprobs and every parameter's gradient,
    gathered whole, against transformers. The decoupled RoPE key k_pos_emb is shared by all heads; Megatron-Core
    0.16.1's local path summed its gradient over this rank's heads only (patches/megatron_mla.py item 3), which put
    every gradient upstream of linear_kv_down_proj 10-36% off."""
    ref = hf_reference(ds2_dir, TOKENS)[0]
    for logprobs, grads in run_distributed(grads_worker, 2, args=(ds2_dir, TOKENS, 2)):
        assert float((logprobs.double() - ref).abs().max()) < 1e-4
        assert_grads_match_transformers(ds2_dir, grads)


@pytest.mark.slow
def test_learner_tp2_dense_no_sequence_parallel_gradients_match_transformers(tmp_path):
    """The same with sequence parallelism off (a dense MLA model: MoE needs it on), the other branch of the fix."""
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    model_dir = str(build_tiny_deepseek(tmp_path / "hf", seed=5, layers=2, first_k_dense=2))
    ref = hf_reference(model_dir, TOKENS)[0]
    for logprobs, grads in run_distributed(grads_worker, 2, args=(model_dir, TOKENS, 2, False)):
        assert float((logprobs.double() - ref).abs().max()) < 1e-4
        assert_grads_match_transformers(model_dir, grads)


# ---- conversion -------------------------------------------------------------------------------------------------
def roundtrip_worker(rank, world, hf, root, tp, ep, pp):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    name = f"tp{tp}ep{ep}pp{pp}"
    hf_to_mcore(hf, f"{root}/mc_{name}", tp=tp, ep=ep, pp=pp)
    mcore_to_hf(f"{root}/mc_{name}", f"{root}/hf_{name}", tp=tp, ep=ep, pp=pp)


def load_converted_worker(rank, world, hf, mcore, tokens):
    from megatron_sparse_rl.learner.checkpoint import load_learner

    learner = W.make_learner(world, hf, tp=1, ep=1, load=False)  # random init: the checkpoint supplies every value
    load_learner(learner, mcore, load_optimizer=False)
    out = learner.forward_logprobs(tokens)
    return out["logprobs"], out["entropy"]


@pytest.fixture(scope="module")
def converted(ds_dir, tmp_path_factory):
    """Round trips at TP2 x EP2 and at PP2 (2 ranks each) into one directory."""
    root = tmp_path_factory.mktemp("converted")
    for tp, ep, pp in ((2, 2, 1), (1, 1, 2)):
        run_distributed(roundtrip_worker, 2, args=(ds_dir, str(root), tp, ep, pp), timeout=300)
    return root


@pytest.mark.parametrize("tp,ep,pp", [(2, 2, 1), (1, 1, 2)], ids=["tp2ep2", "pp2"])
def test_conversion_roundtrip_is_bit_exact(ds_dir, converted, tp, ep, pp):
    original = load_file(f"{ds_dir}/model.safetensors")
    back = {}
    for f in Path(converted, f"hf_tp{tp}ep{ep}pp{pp}").glob("*.safetensors"):
        back.update(load_file(str(f)))
    assert sorted(back) == sorted(original)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert original[bias].abs().max() > 0.01, "a zero bias would not tell a dropped buffer from a kept one"
    assert any(".self_attn.kv_b_proj." in n for n in back) and any(".mlp.shared_experts." in n for n in back)
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_converted_checkpoint_loads_into_a_learner(ds_dir, reference, converted):
    got = run_distributed(load_converted_worker, 1, args=(ds_dir, str(converted / "mc_tp2ep2pp1"), TOKENS),
                          timeout=300)[0]
    assert _close(got, reference) < 1e-4


# ---- routing replay with the grouped sigmoid router ----------------------------------------------------------
def _probs_observer(learner):
    """Test-side: every router call's (logits input, routing probs) per layer, by forward hooks."""
    from megatron_sparse_rl.moe.replay import find_routers

    seen, handles = {}, []
    for r in find_routers(learner.model):
        def hook(mod, args, out, _layer=r.layer_number - 1):
            logits = mod.gating(args[0]).view(-1, mod.config.num_moe_experts)
            seen.setdefault(_layer, []).append((logits.detach().double(), out[0].detach().double(), out[1].detach()))
        handles.append(r.register_forward_hook(hook))
    return seen, handles


def replay_worker(rank, world, model_dir):
    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.learner.extras import ForwardExtras, RouteRequest
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.moe.replay import find_routers
    from megatron_sparse_rl.moe.stats import agreement

    from tests.distributed.test_routing import _expected_maps, _learner

    learner = _learner(world, model_dir, routing=RoutingConfig(mode="R2"))
    lengths = torch.full((TOKENS.shape[0],), TOKENS.shape[1])
    recorded = learner.forward_logprobs(TOKENS, extras=ForwardExtras(routes=RouteRequest(record=True,
                                                                                         lengths=lengths)))
    routes = recorded["routing"].routes
    g = torch.Generator().manual_seed(7)
    for r in find_routers(learner.model):  # re-draw the gate and the expert bias
        r.weight.data.copy_(torch.randn(r.weight.shape, generator=g) * r.weight.data.std())
        r.expert_bias.copy_(torch.randn(r.expert_bias.shape, generator=g) * 0.3)
    natural = learner.forward_logprobs(TOKENS, extras=ForwardExtras(routes=RouteRequest(record=True, lengths=lengths)))
    out = {"agreement_unreplayed": agreement(routes, natural["routing"].routes).min().item()}
    replay = ForwardExtras(routes=RouteRequest(replay=routes, lengths=lengths))
    seen, handles = _probs_observer(learner)
    up = learner.forward_logprobs(TOKENS, extras=replay)
    for h in handles:
        h.remove()
    out["applied"] = up["routing"].metrics["routing/replay_applied_fraction"]
    spec = learner.spec
    worst, selected_ok, mismatched = 0.0, True, 0
    for col, layer in enumerate(routes.layers):
        router = find_routers(learner.model)[col]
        expected = _expected_maps(routes, list(range(TOKENS.shape[0])), TOKENS.shape[1] - 1, col, spec.num_experts)
        for (logits, probs, routing_map), (want_map, valid) in zip(seen[layer], expected, strict=True):
            mismatched += int((routing_map[valid] != want_map[valid]).any(dim=1).sum())
            ids = routing_map.nonzero()[:, 1].view(-1, spec.moe_topk)
            # float64 reference: unbiased sigmoid scores at the selected experts, renormalised, scaled
            s = torch.sigmoid(logits).gather(1, ids)
            want = s / s.sum(-1, keepdim=True) * spec.routed_scaling_factor
            worst = max(worst, float((probs.gather(1, ids) - want).abs().max()))
            selected_ok &= bool((probs > 0).sum(-1).eq(spec.moe_topk).all())
            assert router.expert_bias.abs().max() > 0.1
    out["combine_vs_unbiased"], out["selected_ok"], out["mismatched_tokens"] = worst, selected_ok, mismatched
    before = [r.weight.detach().clone() for r in find_routers(learner.model)]
    mask = torch.ones(TOKENS.shape[0], TOKENS.shape[1] - 1)
    learner.train_step(TOKENS, make_sft_loss(mask, mask.sum().item()), extras=replay)
    out["router_moved"] = [float((r.weight - b).abs().max()) for r, b in zip(find_routers(learner.model), before)]
    out["layers"] = routes.layers
    return out


def test_replay_with_grouped_sigmoid_router(ds_dir):
    out = run_distributed(replay_worker, 1, args=(ds_dir,), timeout=300)[0]
    print(out)
    assert out["layers"] == (1, 2, 3), "only the MoE layers (layer 0 is dense) carry routes"
    assert out["agreement_unreplayed"] < 0.9, "the re-drawn router must route differently on its own"
    assert out["applied"] == 1.0 and out["mismatched_tokens"] == 0
    assert out["selected_ok"]
    assert out["combine_vs_unbiased"] < 1e-6
    assert all(m > 0 for m in out["router_moved"]), "router weights must still get gradients under replay"
