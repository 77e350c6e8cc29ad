"""`VLLMRouteOutput.collect`: vLLM's per-request routed-experts arrays (the 0.32 output format, built here by
hand) -> a RouteStore with one sequence per (prompt, sample) row, the MoE layers' columns of the n - 1 input
positions; malformed output raises naming the sequence.

    .venv/bin/python -m pytest -q tests/unit/test_routes_vllm.py
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_sparse_rl.validation.validate import ConfigError, validate
from megatron_sparse_rl.moe.storage import RoutingError, token_hash
from megatron_sparse_rl.rollout.routes_vllm import VLLMRouteOutput


def _completion(index, token_ids, routed_experts):
    return SimpleNamespace(index=index, token_ids=token_ids, routed_experts=routed_experts)


def _array(rows, layers=3, topk=2, seed=0, num_experts=8):
    gen = np.random.default_rng(seed)
    return gen.integers(0, num_experts, size=(rows, layers, topk)).astype(np.uint8)


def test_collect_keeps_the_moe_layers_of_the_input_positions_in_batch_order():
    # 3 model layers, layer 0 dense (vLLM's buffer has a column for it), layers 1-2 MoE
    prompts = [[1, 5, 6], [1, 9]]
    a0, a1, b0 = _array(3 + 4, seed=1), _array(3 + 2, seed=2), _array(2 + 3, seed=3)
    # vLLM may hand back a row for the last sampled token too (a0: 7 rows for 6 input positions)
    outputs = [SimpleNamespace(request_id="0", outputs=[_completion(1, [7, 8], a1[:4]), _completion(0, [2, 3, 4, 5], a0)]),
               SimpleNamespace(request_id="1", outputs=[_completion(0, [4, 4, 4], b0[:4])])]
    store = VLLMRouteOutput(layers=(1, 2), num_experts=8).collect(outputs, prompts)
    assert store.layers == (1, 2) and store.num_experts == 8 and store.indices.dtype == torch.uint8
    want = [(a0[:6, 1:], [1, 5, 6, 2, 3, 4]), (a1[:4, 1:], [1, 5, 6, 7]), (b0[:4, 1:], [1, 9, 4, 4])]
    assert store.offsets.tolist() == [0, 6, 10, 14]
    for i, (routes, tokens) in enumerate(want):
        got = store.indices[store.offsets[i]:store.offsets[i + 1]]
        assert torch.equal(got, torch.from_numpy(routes.copy())), i
        assert int(store.token_hash[i]) == token_hash(tokens)


@pytest.mark.parametrize("array,message", [
    (None, r"sequence 0: vLLM returned no routed experts"),
    (_array(3), r"sequence 0: vLLM returned routes for 3 positions, the sequence has 4 input positions"),
    (_array(4, layers=2), r"sequence 0: vLLM routed experts cover 2 layers, MoE layer 2 is missing"),
    (np.full((4, 3, 2), 9, dtype=np.uint8), r"sequence 0: vLLM routed expert ids outside \[0, 8\) \(min 9, max 9\)"),
    (np.zeros((4, 3)), r"sequence 0: vLLM routed experts must be \[tokens, layers, topk\]"),
])
def test_malformed_output_names_the_sequence(array, message):
    outputs = [SimpleNamespace(request_id="0", outputs=[_completion(0, [2, 3], array)])]
    with pytest.raises(RoutingError, match=message):
        VLLMRouteOutput(layers=(1, 2), num_experts=8).collect(outputs, [[1, 5, 6]])


def test_attach_needs_an_engine_started_for_it():
    assert VLLMRouteOutput().engine_args(None) == {"enable_return_routed_experts": True}
    with pytest.raises(RoutingError, match="needs an engine started with enable_return_routed_experts=True"):
        VLLMRouteOutput().on_started(SimpleNamespace(vllm_args={}))


def test_vllm_routes_need_cuda():
    from megatron_sparse_rl.config.loader import from_dict, merge_overrides
    from megatron_sparse_rl.config.schema import RunConfig

    def run(*sets):
        return from_dict(RunConfig, merge_overrides({"model": {"path": "/nonexistent", "tiny": {}}}, list(sets)))

    with pytest.raises(ConfigError, match=r"routing\.engine_routes = 'vllm' needs CUDA"):
        validate(run("routing.mode=R3", "routing.engine_routes=vllm"), 1, cuda=False)
    validate(run("routing.mode=R3"), 1, cuda=False)  # auto: the router callback without CUDA
    assert run().routing.vllm_routes(cuda=True) and not run().routing.vllm_routes(cuda=False)
    assert not run("routing.engine_routes=hook").routing.vllm_routes(cuda=True)
    with pytest.raises(ValueError, match=r"routing\.engine_routes: 'native' is not allowed; choose one of 'auto', "
                                         r"'hook', 'vllm'"):
        run("routing.engine_routes=native")
