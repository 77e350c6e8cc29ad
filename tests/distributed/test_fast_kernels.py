"""learner.kernels: fast against local (models/kernels.py), fp32 on CPU.

- grouped-GEMM experts (models/grouped_experts.py) against Megatron's SequentialMLP: the expert module alone with an
  empty expert (output and every gradient bit-identical), and the whole model at EP 1 and EP 2 under R2 route
  replay (logprobs, loss and every parameter's gradient bit-identical; the test swaps only the experts' class);
- SDPA core attention (models/sdpa_attention.py) within 1e-6 of Megatron's DotProductAttention, output and input
  gradients: causal, right-padded, per-head sparse-KV keep sets (GQA), MLA's narrower value head;
- the whole fast learner: with per-layer keep-set masks through learner/attention_mask.py's hooks, logprobs
  within 1e-5 of the local learner;
- a torch_dist checkpoint saved under local loads under fast, optimizer state included (the next step agrees).
Logprobs against transformers for every family run under the default (auto = fast on CPU) in the parity tests
(test_learner, test_adapters_more, test_deepseek, test_dsa).
Run: .venv/bin/python -m pytest -q tests/distributed/test_fast_kernels.py
"""
import pytest
import torch

from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests import learner_workers as W
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

TOKENS = torch.tensor([[1, 5, 6, 14, 11, 18, 22, 20, 27, 21, 19, 5, 13],
                       [1, 43, 21, 19, 9, 7, 15, 4, 4, 18, 22, 30, 31],
                       [1, 8, 8, 9, 30, 31, 2, 6, 17, 23, 24, 11, 0],
                       [1, 12, 13, 40, 41, 3, 3, 3, 25, 26, 0, 0, 0]])
LENGTHS = torch.tensor([13, 13, 12, 10])


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("moe"), seed=3))


def _swap_experts(model, cls):
    from megatron.core.transformer.moe.experts import SequentialMLP

    for module in model.modules():
        if isinstance(module, SequentialMLP):
            module.__class__ = cls


def _experts_module_worker(rank, world_size, model_dir):
    """One MoE layer's experts, SequentialMLP vs GroupedExperts on the same weights, expert 1 given no tokens."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_sparse_rl.models.grouped_experts import GroupedExperts

    learner = W.make_learner(world_size, model_dir, kernels="local")
    experts = next(m for m in learner.model.modules() if isinstance(m, SequentialMLP))
    counts = torch.tensor([5, 0, 9, 3] + [4] * (experts.num_local_experts - 4))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(int(counts.sum()), learner.config.hidden_size, generator=g)
    probs = torch.rand(x.shape[0], generator=g)
    params = list(experts.parameters())
    out = {}
    for cls in (SequentialMLP, GroupedExperts):
        experts.__class__ = cls
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, _ = experts(xi, counts, pi)
        grads = torch.autograd.grad(y, [xi, pi, *params], torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
        out[cls.__name__] = (y.detach(), grads)
    return out


def test_grouped_experts_module_bit_identical_with_an_empty_expert(moe_dir):
    out = run_distributed(_experts_module_worker, 1, args=(moe_dir,))[0]
    (y0, g0), (y1, g1) = out["SequentialMLP"], out["GroupedExperts"]
    assert torch.equal(y0, y1)
    assert len(g0) == len(g1) > 2
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)
    assert any(bool((g == 0).all()) for g in g1[2:]), "the empty expert's weights get a zero gradient"


def _experts_model_worker(rank, world_size, model_dir, ep):
    """Logprobs, loss and every gradient (main_grad after a zero-lr step) of the whole model under R2 replay, with
    SequentialMLP and then GroupedExperts on the same weights."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.learner.extras import ForwardExtras, RouteRequest
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.models.grouped_experts import GroupedExperts

    learner = W.make_learner(world_size, model_dir, ep=ep, kernels="local", clip=0.0,
                             routing=RoutingConfig(mode="R2"))
    record = learner.forward_logprobs(TOKENS, lengths=LENGTHS,
                                      extras=ForwardExtras(routes=RouteRequest(record=True, lengths=LENGTHS)))
    replay = ForwardExtras(routes=RouteRequest(replay=record["routing"].routes, lengths=LENGTHS))
    rows = torch.arange(TOKENS.shape[0]).chunk(learner.layout.dp)[learner.groups.dp_rank]
    mask = (torch.arange(TOKENS.shape[1] - 1)[None] < (LENGTHS - 1)[:, None]).float()
    out = {}
    for cls in (SequentialMLP, GroupedExperts):
        _swap_experts(learner.model, cls)
        lp = learner.forward_logprobs(TOKENS, lengths=LENGTHS, extras=replay)["logprobs"]
        m = learner.train_step(TOKENS[rows], make_sft_loss(mask[rows], mask.sum().item()), lengths=LENGTHS[rows],
                               lr=0.0, extras=replay.select(rows))
        grads = {n: p.main_grad.clone() for n, p in learner.model.module.named_parameters()}
        out[cls.__name__] = (lp, m["loss"], m["routing/replay_applied_fraction"], grads)
    return out


@pytest.mark.parametrize("ep", [1, 2], ids=["ep1", "ep2"])
def test_grouped_experts_model_bit_identical_under_route_replay(moe_dir, ep):
    for out in run_distributed(_experts_model_worker, ep, args=(moe_dir, ep)):
        (lp0, loss0, applied0, g0), (lp1, loss1, applied1, g1) = out["SequentialMLP"], out["GroupedExperts"]
        assert applied0 == applied1 == 1.0
        assert torch.equal(lp0, lp1) and loss0 == loss1
        assert g0.keys() == g1.keys() and any("local_experts" in n for n in g0)
        for name in g0:
            assert torch.equal(g0[name], g1[name]), name


def _attention_worker(rank, world_size):
    """DotProductAttention vs SDPAttention on the same inputs: output and q/k/v gradients per case."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_sparse_rl.config.schema import ParallelConfig
    from megatron_sparse_rl.models.sdpa_attention import SDPAttention
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    ParallelLayout.from_config(ParallelConfig(), world_size).initialize()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    g = torch.Generator().manual_seed(0)
    b, s, heads, groups = 3, 24, 4, 2
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    lengths = torch.tensor([24, 17, 9])
    padded = causal | (torch.arange(s)[None, None, :] >= lengths[:, None, None])  # keys past each row's length
    padded = padded & ~torch.eye(s, dtype=torch.bool)  # a padding query still sees itself
    keep = causal | (torch.rand(b, heads, s, s, generator=g) < 0.4)
    keep &= ~torch.eye(s, dtype=torch.bool)  # every query keeps itself (a keep set always holds the current token)
    cases = {"causal": (32, 32, groups, None), "padded": (32, 32, groups, padded[:, None]),
             "keep_sets": (32, 32, groups, keep), "mla": (24, 16, heads, None), "mla_keep_sets": (24, 16, heads, keep)}
    out = {}
    for name, (dk, dv, kv_heads, mask) in cases.items():
        config = TransformerConfig(num_layers=1, hidden_size=heads * dk, num_attention_heads=heads,
                                   num_query_groups=kv_heads, kv_channels=dk, use_cpu_initialization=True,
                                   attention_dropout=0.0)
        extra = {"k_channels": dk, "v_channels": dv} if dv != dk else {}
        q = torch.randn(s, b, heads, dk, generator=g)
        k = torch.randn(s, b, kv_heads, dk, generator=g)
        v = torch.randn(s, b, kv_heads, dv, generator=g)
        res = []
        for cls in (DotProductAttention, SDPAttention):
            module = cls(config, 1, AttnMaskType.causal, "self", softmax_scale=dk ** -0.5, **extra)
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            y = module(*inputs, mask)
            res.append((y.detach(), torch.autograd.grad(y, inputs, torch.ones_like(y) / y.shape[-1])))
        out[name] = res
    return out


def _close(a, b, tol=1e-6) -> bool:
    """|a - b| <= tol at the scale of the values (fp32 rounding of outputs ~2 is 2.4e-7 a step)."""
    return bool((a - b).abs().max() <= tol * max(1.0, float(a.abs().max())))


def test_sdpa_attention_within_1e6_of_local():
    for name, ((y0, g0), (y1, g1)) in run_distributed(_attention_worker, 1)[0].items():
        assert y0.shape == y1.shape, name
        assert _close(y0, y1), (name, float((y0 - y1).abs().max()))
        for a, b in zip(g0, g1):
            assert _close(a, b), (name, float((a - b).abs().max()))


def _keep_set_logprobs_worker(rank, world_size, model_dir, allowed):
    from megatron_sparse_rl.learner.extras import ForwardExtras

    out = {}
    for kernels in ("local", "fast"):
        learner = W.make_learner(world_size, model_dir, kernels=kernels)
        out[kernels] = learner.forward_logprobs(TOKENS, extras=ForwardExtras(attention_mask=allowed))["logprobs"]
    return out


def test_fast_learner_with_keep_set_masks_matches_local(moe_dir):
    from megatron_sparse_rl.models import load_spec

    _, spec = load_spec(moe_dir)
    b, s = TOKENS.shape[0], TOKENS.shape[1] - 1
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool)) & (torch.rand(b, spec.num_layers, spec.num_kv_heads, s, s,
                                                                          generator=torch.Generator().manual_seed(4)) < 0.6)
    allowed |= torch.eye(s, dtype=torch.bool)
    out = run_distributed(_keep_set_logprobs_worker, 1, args=(moe_dir, allowed))[0]
    plain = run_distributed(W.logprobs_worker, 1, args=(moe_dir, TOKENS, 1, 1))[0][0]
    assert (out["fast"] - out["local"]).abs().max() < 1e-5
    assert (out["fast"] - plain).abs().max() > 1e-3, "the keep sets must change the logprobs for this to mean anything"


def _checkpoint_worker(rank, world_size, model_dir, ckpt, mode, kernels):
    """'save': one SFT step under `kernels`, save; 'load': load (optimizer included) under `kernels`. Then one more
    step; returns the logprobs after it."""
    from megatron_sparse_rl.learner.checkpoint import load_learner, save_learner
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world_size, model_dir, kernels=kernels, load=mode == "save", lr=1e-2)
    mask = torch.ones(TOKENS.shape[0], TOKENS.shape[1] - 1)
    if mode == "save":
        learner.train_step(TOKENS, make_sft_loss(mask, mask.sum().item()))
        save_learner(learner, ckpt)
    else:
        load_learner(learner, ckpt, load_optimizer=True)
    learner.train_step(TOKENS, make_sft_loss(mask, mask.sum().item()))
    return learner.forward_logprobs(TOKENS)["logprobs"]


def test_checkpoint_saved_under_local_loads_under_fast(moe_dir, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = run_distributed(_checkpoint_worker, 1, args=(moe_dir, ckpt, "save", "local"))[0]
    resumed = run_distributed(_checkpoint_worker, 1, args=(moe_dir, ckpt, "load", "fast"))[0]
    assert (straight - resumed).abs().max() < 1e-4
