"""Which R3 route captures and sampling-support records multi-turn episodes accept (validation/validate.py
`_env_problems`), that an episode batch refuses records that do not cover its rows (rollout/multi_turn.py), and how
the route capture fills positions vLLM served from its prefix cache (rollout/routes.py `_rows_routes`, on hand-built
step records). Both across turns on the real engine, and the learner using them: tests/e2e/test_episodes.py.
Run: .venv/bin/python -m pytest -q tests/unit/test_episode_routes.py
"""
import pytest
import torch

from megatron_sparse_rl.config import ConfigError
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.moe.storage import RouteStore, RoutingError
from megatron_sparse_rl.rollout.multi_turn import _Episode, _features
from megatron_sparse_rl.rollout.sampling_mask import SamplingSupport
from tests.unit.test_envs import TOOLS_ENV, run_of


def test_episodes_take_r3_through_the_router_callback_and_refuse_vllm_routes():
    validate(run_of(*TOOLS_ENV, "routing.mode=R3"), 1, cuda=False)  # auto without CUDA: the router callback
    validate(run_of(*TOOLS_ENV, "routing.capture_rollout_routes=true", "routing.engine_routes=hook"), 1, cuda=True)
    for routes in ("vllm", "auto"):  # vLLM's own routed-experts output (auto with CUDA) does not follow turns yet
        with pytest.raises(ConfigError, match=rf"routing.engine_routes = '{routes}' \(vLLM's own routed-experts "
                                              r"output; set routing.engine_routes: hook\) cannot run with env.kind"):
            validate(run_of(*TOOLS_ENV, "routing.mode=R3", f"routing.engine_routes={routes}"), 1, cuda=True)
    validate(run_of(*TOOLS_ENV, "routing.mode=R3", "rollout.record_sampling_mask=true",
                    "algorithm.keep_sampling_mask=true"), 1, cuda=False)
    validate(run_of(*TOOLS_ENV, "routing.mode=R3", "rollout.kv.policy=snapkv"), 1, cuda=False)  # both follow turns


def _episode(prompt, response, routed):
    store = RouteStore.from_sequences([torch.zeros(len(routed), 1, 2, dtype=torch.int16)], [routed], num_experts=4,
                                      layers=(0,))
    return _Episode(env=None, group=0, prompt=prompt, response=response, records={"routed_experts": store})


def test_episode_batch_routes_must_cover_every_input_position():
    full = _episode([1, 2], [3, 4], [1, 2, 3])
    assert _features([full, full]).routed_experts.lengths.tolist() == [3, 3]
    with pytest.raises(RoutingError, match=r"episode 1: its routes do not cover its 3 input positions"):
        _features([full, _episode([1, 2], [3, 4], [1, 2])])  # the last turn's routes missing
    with pytest.raises(RoutingError, match=r"episode 0: its routes do not cover"):
        _features([_episode([1, 2], [3, 4], [1, 9, 3])])  # routes of other tokens


def test_episode_batch_support_must_cover_every_response_token():
    def episode(counts):
        support = SamplingSupport(prompt_lens=torch.tensor([2]), counts=(torch.tensor(counts, dtype=torch.int32),),
                                  ids=(torch.arange(sum(counts), dtype=torch.int32),))
        return _Episode(env=None, group=0, prompt=[1, 2], response=[3, 4, 5], records={"sampling_mask": support})

    joined = _features([episode([2, 0, 1]), episode([0, 0, 3])]).sampling_mask
    assert [c.tolist() for c in joined.counts] == [[2, 0, 1], [0, 0, 3]] and joined.prompt_lens.tolist() == [2, 2]
    with pytest.raises(ValueError, match=r"episode 1: its sampling support does not cover its 3 response tokens"):
        _features([episode([2, 0, 1]), episode([2, 0])])


def _capture(keeps_prefixes):
    from megatron_sparse_rl.rollout.routes import EngineRouteCapture

    capture = EngineRouteCapture()
    capture.layers, capture.num_experts, capture.keeps_prefixes = (0,), 4, keeps_prefixes
    return capture


def _seen(seq, positions, expert):
    return {p: (seq[p], torch.tensor([[expert, p % 4]], dtype=torch.int16)) for p in positions}


def test_positions_served_from_the_prefix_cache_take_the_routes_of_the_same_prefix():
    a, b, c = [1, 2, 3, 4, 5], [1, 2, 3, 7, 8], [9, 2, 3, 4, 5]
    capture = _capture(True)
    # b's first two positions came from the cache (a computed them); c differs from position 0 on: nothing to take
    got_a, got_b = capture._rows_routes([a, b], [_seen(a, range(4), 0), _seen(b, range(2, 4), 1)], [None, None])
    assert got_a[:, 0, 0].tolist() == [0, 0, 0, 0] and got_b[:, 0, 0].tolist() == [0, 0, 1, 1]
    with pytest.raises(RoutingError, match=r"sequence 0: the engine never routed position 0"):
        capture._rows_routes([c], [_seen(c, range(2, 4), 2)], [None])
    # a later call (same weights) finds a's routes; after a prefix-cache reset it does not
    [again] = capture._rows_routes([a], [_seen(a, [3], 3)], [None])
    assert again[:, 0, 0].tolist() == [0, 0, 0, 3]
    capture.on_prefix_reset()
    with pytest.raises(RoutingError, match=r"never routed position 0"):
        capture._rows_routes([a], [_seen(a, [3], 3)], [None])
    # an earlier turn's record comes first; without prefix caching nothing is shared between rows
    old = torch.full((2, 1, 2), 3, dtype=torch.int16)
    [turn2] = capture._rows_routes([a], [_seen(a, range(4), 2)], [old])
    assert turn2[:, 0, 0].tolist() == [3, 3, 2, 2]
    with pytest.raises(RoutingError, match=r"sequence 1: the engine never routed position 0"):
        _capture(False)._rows_routes([a, b], [_seen(a, range(4), 0), _seen(b, range(2, 4), 1)], [None, None])
    with pytest.raises(RoutingError, match=r"sequence 0: position 1 was routed for token 9, the sequence has 2"):
        capture._rows_routes([a], [{**_seen(a, range(4), 0), 1: (9, torch.zeros(1, 2, dtype=torch.int16))}], [None])
