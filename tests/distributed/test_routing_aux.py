"""The load-balancing aux loss under routing replay (`routing.aux_loss`), on a real tiny Qwen3-MoE learner.

A test-side spy on Megatron's `switch_load_balancing_loss_func` sees every aux-loss computation of an R2
update whose routers were perturbed after recording (so their own top-k differs from the replayed routes):
- `replayed`: computed once per MoE layer and micro-batch, on the expert counts of the routing map the
  experts really ran (observed by a forward hook on each router), not on the router's fresh top-k of
  the same scores;
- `off`: never computed while replaying, though the same model computes it without replay.
Run: .venv/bin/python -m pytest -q tests/distributed/test_routing_aux.py
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.test_routing import LENGTHS, TOKENS, _learner, _perturb_routers, _router_maps
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed


def aux_worker(rank, world_size, model_dir, mode):
    import megatron.core.transformer.moe.router as router_mod

    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.learner.extras import ForwardExtras, RouteRequest
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = _learner(world_size, model_dir, aux_coeff=0.01,
                       routing=RoutingConfig(mode="R2", aux_loss=mode, record_stats=False))
    record = ForwardExtras(routes=RouteRequest(record=True, lengths=LENGTHS))  # R2's old forward
    routes = learner.forward_logprobs(TOKENS, extras=record)["routing"].routes
    _perturb_routers(learner)
    calls, original = [], router_mod.switch_load_balancing_loss_func

    def spy(probs, tokens_per_expert, total_num_tokens, topk, *args, **kwargs):
        calls.append((probs.detach().clone(), tokens_per_expert.detach().clone(), topk))
        return original(probs, tokens_per_expert, total_num_tokens, topk, *args, **kwargs)

    router_mod.switch_load_balancing_loss_func = spy
    mask = torch.ones(TOKENS.shape[0], TOKENS.shape[1] - 1)
    loss = make_sft_loss(mask, mask.sum().item())
    maps, handles = _router_maps(learner)
    learner.train_step(TOKENS, loss, extras=ForwardExtras(routes=RouteRequest(replay=routes, lengths=LENGTHS)))
    for h in handles:
        h.remove()
    replayed_calls = list(calls)
    calls.clear()
    learner.train_step(TOKENS, loss)  # no replay: Megatron's own aux loss on the router's top-k
    ran = [m for layer in sorted(maps) for m in maps[layer]]  # layer-major; calls come micro-batch-major
    return replayed_calls, len(calls), ran, len(maps)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    return str(build_tiny_hf_model(tmp_path_factory.mktemp("routing_aux") / "moe", experts=8, topk=2, seed=0))


def test_aux_loss_on_the_replayed_map(model_dir):
    calls, unreplayed_calls, ran, layers = run_distributed(aux_worker, 1, (model_dir, "replayed"), timeout=240)[0]
    micro_batches = len(ran) // layers
    assert len(calls) == len(ran) == layers * micro_batches and unreplayed_calls == len(calls)
    differs = 0
    for i, (probs, counts, topk) in enumerate(calls):
        layer, mb = i % layers, i // layers
        dispatched = ran[layer * micro_batches + mb]
        assert torch.equal(counts.long(), dispatched.sum(dim=0).long()), f"call {i}: not the replayed map"
        fresh = torch.zeros_like(dispatched).scatter(1, probs.topk(topk, dim=1).indices, True)
        differs += int(not torch.equal(counts.long(), fresh.sum(dim=0).long()))
    assert differs > 0, "the perturbed routers' own top-k should differ from the replayed routes"


def test_aux_loss_off_under_replay(model_dir):
    calls, unreplayed_calls, _, _ = run_distributed(aux_worker, 1, (model_dir, "off"), timeout=240)[0]
    assert calls == [] and unreplayed_calls > 0
