"""Which R3 route captures and sampling-support records multi-turn episodes accept (config/validate.py
`_env_problems`), and that an episode batch refuses records that do not cover its rows (rollout/episodes.py). Both
across turns on the real engine, and the learner using them: tests/e2e/test_episodes.py.
Run: .venv/bin/python -m pytest -q tests/unit/test_episode_routes.py
"""
import pytest
import torch

from megatron_sparse_rl.config import ConfigError, validate
from megatron_sparse_rl.moe.storage import RouteStore, RoutingError
from megatron_sparse_rl.rollout.episodes import _Episode, _record_fields
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
    with pytest.raises(ConfigError, match=r"rollout.kv.policy cannot run with env.kind = 'tools'"):  # still refused
        validate(run_of(*TOOLS_ENV, "routing.mode=R3", "rollout.kv.policy=snapkv"), 1, cuda=False)


def _episode(prompt, response, routed):
    store = RouteStore.from_sequences([torch.zeros(len(routed), 1, 2, dtype=torch.int16)], [routed], num_experts=4,
                                      layers=(0,))
    return _Episode(env=None, group=0, prompt=prompt, response=response, records={"routed_experts": store})


def test_episode_batch_routes_must_cover_every_input_position():
    full = _episode([1, 2], [3, 4], [1, 2, 3])
    assert _record_fields([full, full])["routed_experts"].lengths.tolist() == [3, 3]
    with pytest.raises(RoutingError, match=r"episode 1: its routes do not cover its 3 input positions"):
        _record_fields([full, _episode([1, 2], [3, 4], [1, 2])])  # the last turn's routes missing
    with pytest.raises(RoutingError, match=r"episode 0: its routes do not cover"):
        _record_fields([_episode([1, 2], [3, 4], [1, 9, 3])])  # routes of other tokens


def test_episode_batch_support_must_cover_every_response_token():
    def episode(counts):
        support = SamplingSupport(prompt_lens=torch.tensor([2]), counts=(torch.tensor(counts, dtype=torch.int32),),
                                  ids=(torch.arange(sum(counts), dtype=torch.int32),))
        return _Episode(env=None, group=0, prompt=[1, 2], response=[3, 4, 5], records={"sampling_mask": support})

    joined = _record_fields([episode([2, 0, 1]), episode([0, 0, 3])])["sampling_mask"]
    assert [c.tolist() for c in joined.counts] == [[2, 0, 1], [0, 0, 3]] and joined.prompt_lens.tolist() == [2, 2]
    with pytest.raises(ValueError, match=r"episode 1: its sampling support does not cover its 3 response tokens"):
        _record_fields([episode([2, 0, 1]), episode([2, 0])])
