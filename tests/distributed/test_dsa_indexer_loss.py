"""The DSA indexer's KL loss on a 1-rank Megatron learner (model.dsa_indexer_loss_coeff; learner/dsa_indexer_loss.py)
against a float64 KL written here from transformers' weights and activations (fp64, eager):

- with coefficient C > 0, after one train_step (4 rows, 2 micro-batches), every indexer parameter's gradient is C
  times the float64 gradient of sum over DSA layers of mean over (rows, queries) of KL(p || q), where p is the main
  attention's dense causal softmax (transformers' own query and key, captured in its attention call) summed over
  heads and normalised, and q the softmax of the indexer scores sum_h w_h relu(q_h . k) computed by hand from the
  indexer's weights and inputs; relative 1e-4;
- indexer/kl_loss is that KL averaged over the layers (1e-4 relative);
- every other parameter's gradient equals the one of the same step with the coefficient 0, where the indexer's
  gradients are zero and indexer/kl_loss is absent;
- with model.recompute_activations (the loss is added in the backward's recompute forward) the same gradients and
  indexer/kl_loss.
One tiny DeepSeek-V3.2 (2 DSA layers, index_topk 4, sequences of 16).
Run: .venv/bin/python -m pytest -q tests/distributed/test_dsa_indexer_loss.py
"""
import pytest
import torch

from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

TOPK = 4
COEFF = 0.3
TOKENS = torch.randint(3, 40, (4, 17), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_sparse_rl.models.tiny_families import build_tiny_dsa

    return str(build_tiny_dsa(tmp_path_factory.mktemp("dsa") / "hf", arch="deepseek_v32", layers=2, index_topk=TOPK,
                              rope="yarn", seed=3))


def _learner(world, model_dir, coeff, recompute=False):
    from megatron_sparse_rl.config.schema import LearnerConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_sparse_rl.learner.learner import Learner
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    adapter, spec = load_spec(model_dir)
    layout = ParallelLayout.from_config(ParallelConfig(), world)
    model_cfg = ModelConfig(path=model_dir, dsa_indexer_loss_coeff=coeff, recompute_activations=recompute)
    learner = Learner(adapter, spec, layout, layout.initialize(), model_cfg=model_cfg,
                      cfg=LearnerConfig(micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-3, clip_grad=0.0)))
    learner.load_hf(model_dir)
    return learner


def step_worker(rank, world, model_dir, tokens):
    """Per coefficient: the main_grad of every parameter after one SFT train_step, and the step's metrics."""
    from megatron_sparse_rl.learner.params import local_params
    from megatron_sparse_rl.learner.sft import make_sft_loss

    out = {}
    for key, coeff, recompute in (("on", COEFF, False), ("off", 0.0, False), ("recompute", COEFF, True)):
        learner = _learner(world, model_dir, coeff, recompute)
        mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
        metrics = learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
        grads = {n: lp.param.main_grad.clone() for n, lp in local_params(learner.model, learner.groups).items()
                 if getattr(lp.param, "main_grad", None) is not None}
        out[key] = grads, metrics
    return out


def _rope(x, cos, sin):
    """Half-split rotary embedding of x [b, s, h, r] (DeepSeek-V3.2's indexer), cos/sin [b, s, r]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def _indexer_log_probs(ix, hidden, q_resid, cos, sin, causal):
    """log softmax over keys of the indexer scores sum_h w_h relu(q_h . k) / sqrt(d) / sqrt(heads), float64 with
    autograd through the indexer's weights: [b, s, t], -inf above the diagonal."""
    b, s, _ = hidden.shape
    heads, dim, rope = ix.n_heads, ix.head_dim, ix.qk_rope_head_dim
    q = (q_resid @ ix.wq_b.weight.T).view(b, s, heads, dim)
    k = torch.nn.functional.layer_norm(hidden @ ix.wk.weight.T, (dim,), ix.k_norm.weight, ix.k_norm.bias,
                                       eps=1e-6)[:, :, None]
    q = torch.cat((_rope(q[..., :rope], cos, sin), q[..., rope:]), dim=-1)
    k = torch.cat((_rope(k[..., :rope], cos, sin), k[..., rope:]), dim=-1)[:, :, 0]
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q, k) * dim ** -0.5)
    weights = hidden @ ix.weights_proj.weight.T * heads ** -0.5
    index = torch.einsum("bsh,bsht->bst", weights, scores).masked_fill(~causal, float("-inf"))
    return torch.log_softmax(index, dim=-1)


def reference(model_dir, inputs, monkeypatch):
    """(HF name -> d/dW of sum over layers of the mean KL, [mean KL per layer]) for the indexer weights, float64."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_module

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager")
    attention, indexer_inputs = [], []
    eager = hf_module.eager_attention_forward

    def capture(module, query, key, value, attention_mask, scaling, **kwargs):
        attention.append((query.detach(), key.detach(), scaling))
        return eager(module, query, key, value, attention_mask, scaling, **kwargs)

    monkeypatch.setattr(hf_module, "eager_attention_forward", capture)
    for layer in model.model.layers:
        layer.self_attn.indexer.register_forward_pre_hook(lambda mod, args: indexer_inputs.append(args))
    with torch.no_grad():
        model(inputs)
    seq = inputs.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    kls = []
    for layer, (query, key, scaling), args in zip(model.model.layers, attention, indexer_inputs, strict=True):
        logits = (query @ key.transpose(-1, -2) * scaling).masked_fill(~causal, float("-inf"))
        target = torch.softmax(logits, dim=-1).sum(dim=1)  # [b, s, t]: summed over heads
        target = target / target.sum(dim=-1, keepdim=True)
        hidden, q_resid, (cos, sin) = args[0], args[1], args[2]
        logq = _indexer_log_probs(layer.self_attn.indexer, hidden, q_resid, cos, sin, causal)
        kl = torch.where(causal, target * (torch.log(target) - logq), torch.zeros_like(target)).sum(-1)
        kls.append(kl.mean())
    torch.stack(kls).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ".indexer." in n}
    assert all(g is not None and g.norm() > 0 for g in grads.values())
    return grads, [float(k.detach()) for k in kls]


def test_indexer_gradient_is_coeff_times_float64_kl_gradient(model_dir, monkeypatch):
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.models.tensor_map import to_mcore

    out = run_distributed(step_worker, 1, args=(model_dir, TOKENS), timeout=300)[0]
    (grads, metrics), (off_grads, off_metrics), (re_grads, re_metrics) = out["on"], out["off"], out["recompute"]
    hf, kls = reference(model_dir, TOKENS[:, :-1], monkeypatch)
    adapter, spec = load_spec(model_dir)
    indexer = other = 0
    for tm in adapter.tensor_maps(spec):
        if ".indexer." in tm.mcore:
            ref = COEFF * to_mcore(tm, [hf[n] for n in tm.hf], spec).double()
            err = float((grads[tm.mcore].double() - ref).norm() / ref.norm())
            assert err < 1e-4, (tm.mcore, err)
            err = float((re_grads[tm.mcore].double() - ref).norm() / ref.norm())
            assert err < 1e-4, ("recompute", tm.mcore, err)
            assert torch.count_nonzero(off_grads[tm.mcore]) == 0, tm.mcore
            indexer += 1
        elif not tm.mcore.endswith("router.expert_bias"):  # a buffer: no gradient
            on, off = grads[tm.mcore].double(), off_grads[tm.mcore].double()
            assert off.norm() > 0 and float((on - off).norm() / off.norm()) < 1e-6, tm.mcore
            other += 1
    assert indexer == 2 * 5 and indexer + other == len(grads)
    mean_kl = sum(kls) / len(kls)
    assert mean_kl > 1e-3, "a KL of ~0 would not show a wrong scale"
    for m in (metrics, re_metrics):
        assert abs(m["indexer/kl_loss"] - mean_kl) < 1e-4 * mean_kl, (m["indexer/kl_loss"], kls)
    assert "indexer/kl_loss" not in off_metrics
