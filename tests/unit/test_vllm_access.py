"""`vllm_access.check`: passes on the installed vLLM; a missing or changed internal fails naming the vLLM
version, the piece and the feature that needs it (simulated by removing or replacing it, or with stand-ins).

    .venv/bin/python -m pytest -q tests/unit/test_vllm_access.py
"""
from types import SimpleNamespace

import pytest

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.vllm_access import Need, VLLMInternalsError

vllm = pytest.importorskip("vllm")


def test_every_feature_passes_on_the_installed_vllm():
    assert vllm.__version__ == vllm_access.VLLM_VERSION
    vllm_access.check(features=tuple(vllm_access.FEATURES))


def test_the_sparse_kv_patch_relies_on_what_the_accessor_checks():
    patched = {("vllm.v1.worker.gpu_model_runner:GPUModelRunner", n)
               for n in ("_update_states", "_prepare_inputs", "execute_model")}
    methods = {(n.owner, n.name) for n in vllm_access.NEEDS if n.feature == "sparse_kv" and n.kind == "method"}
    assert patched <= methods


def test_a_missing_method_names_the_version_the_piece_and_the_feature(monkeypatch):
    from vllm.v1.worker.block_table import BlockTable

    monkeypatch.setattr(vllm, "__version__", "9.9.9")
    monkeypatch.delattr(BlockTable, "clear_row")
    with pytest.raises(VLLMInternalsError) as e:
        vllm_access.check(features=("sparse_kv",))
    message = str(e.value)
    assert "vLLM 9.9.9" in message and "written for vLLM 0.32.0" in message
    assert "vllm.v1.worker.block_table:BlockTable.clear_row is missing" in message
    assert "sparse KV" in message
    vllm_access.check(features=("engine",))  # a feature that does not need it still passes


def test_a_changed_signature_is_named(monkeypatch):
    from vllm.v1.core.block_pool import BlockPool

    monkeypatch.setattr(BlockPool, "free_blocks", lambda self, blocks, urgent=False: None)
    with pytest.raises(VLLMInternalsError, match=r"BlockPool.free_blocks has parameters \['self', 'blocks', "
                                                 r"'urgent'\], expected \['self', 'ordered_blocks'\] first"):
        vllm_access.check(features=("sparse_kv",))


def test_a_missing_attribute_and_a_class_that_takes_no_rider_are_named(monkeypatch):
    needs = (Need("engine", "fractions:Fraction", "numerator"), Need("engine", "fractions:Fraction", "msrl_sparse_kv",
                                                                      "rider"))
    monkeypatch.setattr(vllm_access, "NEEDS", needs)
    with pytest.raises(VLLMInternalsError, match="fractions:Fraction instances take no extra attribute"):
        vllm_access.check()
    monkeypatch.setattr(vllm_access, "NEEDS", (Need("engine", "fractions:Fraction", "no_such_field"),))
    with pytest.raises(VLLMInternalsError, match="fractions:Fraction.no_such_field is missing; needed for every "
                                                 "RolloutEngine"):
        vllm_access.check()


def test_instance_attributes_are_found_without_an_instance():
    """Attributes vLLM assigns in __init__ (behind a decorator) count as defined; names nobody assigns do not."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert vllm_access._defines(GPUModelRunner, "query_start_loc")
    assert not vllm_access._defines(GPUModelRunner, "no_such_buffer")


def test_live_objects_are_checked():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class BareRunner(GPUModelRunner):
        def __init__(self):  # none of vLLM's instance attributes
            pass

    with pytest.raises(VLLMInternalsError, match=r"GPUModelRunner.input_batch \(on the live BareRunner\) is missing"):
        vllm_access.check_worker(SimpleNamespace(model_runner=BareRunner()), ("step",))
    with pytest.raises(VLLMInternalsError, match="Worker.model_runner is missing"):
        vllm_access.check_worker(SimpleNamespace(), ("engine",))
    with pytest.raises(VLLMInternalsError, match="is not the V1 vllm.v1.worker.gpu_model_runner:GPUModelRunner"):
        vllm_access.check_worker(SimpleNamespace(model_runner=object()), ("sparse_kv",))
    with pytest.raises(VLLMInternalsError, match=r"Scheduler.running \(on the live Scheduler\) is missing"):
        vllm_access.check_instance(object.__new__(Scheduler), ("engine",))
    with pytest.raises(VLLMInternalsError, match="LLM.llm_engine.engine_core is missing"):
        vllm_access.check(SimpleNamespace(llm_engine=SimpleNamespace()))


def test_unknown_feature_is_refused():
    with pytest.raises(ValueError, match="unknown features"):
        vllm_access.check(features=("sparse-kv",))


def test_request_ids():
    assert vllm_access.request_key("7-0123abcd") == ("7", 0)
    assert vllm_access.request_key("3_7-0123abcd") == ("7", 3)
    assert vllm_access.request_key("7") is None
    from megatron_sparse_rl.rollout.step_capture import requests_by_sample

    assert requests_by_sample(["1_7-0123abcd", "0_7-89abcdef"], KeyError) == {
        ("7", 1): "1_7-0123abcd", ("7", 0): "0_7-89abcdef"}
    with pytest.raises(KeyError, match="cannot parse vLLM request id 'x'"):
        requests_by_sample(["x"], KeyError)


def test_schedule_wraps_nest_and_unwrap_in_reverse_order():
    """A probe around `generate` (which probes the scheduler itself) wraps a wrapped schedule: each unwrap restores
    the wrap that was there before it, the last one the class method."""
    class Sched:
        def schedule(self):
            return "out"

    s, seen = Sched(), []
    vllm_access.wrap_schedule(s, lambda out: seen.append(("outer", out)))
    vllm_access.wrap_schedule(s, lambda out: seen.append(("inner", out)))
    assert s.schedule() == "out" and seen == [("outer", "out"), ("inner", "out")]
    vllm_access.unwrap_schedule(s)
    seen.clear()
    assert s.schedule() == "out" and seen == [("outer", "out")]
    vllm_access.unwrap_schedule(s)
    seen.clear()
    assert s.schedule() == "out" and seen == [] and "schedule" not in vars(s)
