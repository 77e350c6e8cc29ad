"""R3 end to end: routes captured on the real vLLM engine (CPU hook on its MoE routers) replayed in the real
Megatron learner.

- the captured routes are the engine's: the unperturbed fp32 learner's own routes agree with them, and the
  learner replaying them reproduces the engine's sampled-token logprobs;
- with the learner's routers perturbed (so learner and engine route differently, as bf16-vs-fp32 or
  stale weights would), replaying the engine's routes brings the learner's logprobs closer to the engine's
  than its own routing does (measured and printed);
- the rollout batch carries one packed uint8 route sequence per row, n - 1 positions long.
Both for Qwen3-MoE (softmax router) and DeepSeek-V3 (MLA engine; sigmoid group-limited router with expert bias,
a dense first layer, shared experts).
Run: .venv/bin/python -m pytest -q tests/e2e/test_routing_r3.py -s
"""
import math
from dataclasses import replace

import pytest
import torch

from tests.spawn import run_distributed

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

PROMPTS = [[1, 5, 6, 14, 11], [1, 43, 21, 19], [1, 8, 8, 9, 30, 31], [1, 12, 13]]


def _response_diff(learner_lp, batch, tokens):
    """mean |learner - engine| logprob over response tokens (learner position t scores token t + 1)."""
    diffs = []
    for i in range(len(batch)):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        diffs.append((learner_lp[i, p - 1:p - 1 + r] - batch.rollout_logprobs[i, :r]).abs())
    return float(torch.cat(diffs).mean())


def r3_worker(rank, world_size, model_dir):
    from megatron_sparse_rl.config.algorithm import AlgorithmConfig
    from megatron_sparse_rl.config.rollout import RolloutConfig, SamplingConfig
    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.learner.extras import ForwardExtras, RouteRequest
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.rollout.routes import EngineRouteCapture
    from megatron_sparse_rl.training import update as U
    from megatron_sparse_rl.training.learner_batch import LearnerBatch
    from megatron_sparse_rl.moe.replay import find_routers
    from megatron_sparse_rl.moe.stats import agreement
    from tests.distributed.test_routing import _learner

    learner = _learner(world_size, model_dir, routing=RoutingConfig(mode="R3", attribute_mismatch=True))
    vllm_cpu.apply()
    capture = EngineRouteCapture()
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=8, kv_cache_gb=1),
                           extensions=[capture])
    batch = engine.generate(PROMPTS, SamplingConfig(n=2, max_tokens=12, temperature=1.0, seed=3))
    engine.remove_extension(capture)
    engine.shutdown()
    routes = batch.features.routed_experts
    tokens, mask, _ = batch.sequences(pad_id=0)
    lengths = mask.sum(dim=1)
    routing = learner.routing
    out = {"dtype": routes.indices.dtype, "lengths": routes.lengths, "want_lengths": lengths - 1,
           "bytes_per_token": routes.bytes_per_token()}
    own = learner.forward_logprobs(tokens, extras=ForwardExtras(routes=RouteRequest(record=True, lengths=lengths)))
    out["agree_unperturbed"] = agreement(routes, own["routing"].routes)
    out["diff_own_unperturbed"] = _response_diff(own["logprobs"], batch, tokens)
    old_forward = ForwardExtras(routes=replace(routing.old_forward(routes), lengths=lengths))  # R3: the engine's
    lp = learner.forward_logprobs(tokens, extras=old_forward)["logprobs"]
    out["diff_replay_unperturbed"] = _response_diff(lp, batch, tokens)
    g = torch.Generator().manual_seed(5)
    for r in find_routers(learner.model):
        r.weight.data += 0.15 * r.weight.data.std() * torch.randn(r.weight.shape, generator=g)
    lp_own = learner.forward_logprobs(tokens)["logprobs"]
    replayed = learner.forward_logprobs(tokens, extras=old_forward)
    lp_replay = replayed["logprobs"]
    out["metrics"] = routing.after_old_forward(replayed["routing"], routes).metrics
    out["diff_own"] = _response_diff(lp_own, batch, tokens)
    # the RL step's old forward with routing.attribute_mismatch: k1/k3 with the engine's and the learner's routes
    view = LearnerBatch.from_rollout(batch, pad_id=0)
    assert torch.equal(view.tokens, tokens) and torch.equal(view.lengths, lengths)
    x = U.OldPolicyInputs(view, None)
    out["attribution"] = U.old_logprob_source(AlgorithmConfig()).old_policy(learner, x)[2]
    out["diff_replay"] = _response_diff(lp_replay, batch, tokens)
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_r3_replay_brings_learner_to_engine(tmp_path, family):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    if family == "qwen3_moe":
        model_dir = str(build_tiny_hf_model(tmp_path / "moe", experts=8, topk=2, seed=0))
    else:  # MLA engine, grouped sigmoid router with expert bias, a dense first layer
        model_dir = str(build_tiny_deepseek(tmp_path / "ds", seed=0))
    out = run_distributed(r3_worker, 1, args=(model_dir,), timeout=300)[0]
    m = out["metrics"]
    print(f"\nR3 {family}: bytes/token {out['bytes_per_token']:.2f}; unperturbed agreement {out['agree_unperturbed'].tolist()}, "
          f"|learner-engine| own {out['diff_own_unperturbed']:.2e} replay {out['diff_replay_unperturbed']:.2e}; "
          f"perturbed routers: flip rate {m['routing/flip_rate_mean']:.3f}, flipped tokens "
          f"{m['routing/flipped_token_fraction']:.3f}, |learner-engine| own {out['diff_own']:.4f} "
          f"vs replayed {out['diff_replay']:.4f}; "
          + ", ".join(f"{k} {v:.4f}" for k, v in out["attribution"].items() if k.startswith("mismatch/")))
    assert out["dtype"] == torch.uint8
    assert torch.equal(out["lengths"], out["want_lengths"])
    # the captured routes are what the engine computed: an fp32 learner routes the same and, replaying them,
    # reproduces the engine's logprobs
    assert out["agree_unperturbed"].min() > 0.98
    assert out["diff_replay_unperturbed"] < 1e-4
    # routing differs after the perturbation; replaying the engine's routes recovers most of the mismatch
    assert m["routing/replay_applied_fraction"] == 1.0
    assert m["routing/flipped_token_fraction"] > 0.05
    assert out["diff_replay"] < 0.7 * out["diff_own"]
    names = ("routing_share", "k1_engine_routes", "k3_engine_routes", "k1_learner_routes", "k3_learner_routes")
    assert all(math.isfinite(out["attribution"][f"mismatch/{n}"]) for n in names)
