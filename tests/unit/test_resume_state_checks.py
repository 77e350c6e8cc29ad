"""A checkpoint's own state files of the wrong shape are refused at resume, naming the file and the field, before
anything is loaded or set: common_state.json fields of the wrong type (step, scheduler, extra, world_size, the run's
loop counters) and RNG files whose states are not what their generators take. Before, the first was a TypeError
traceback from `common["step"] > 0`, the second `random.setstate`'s "state vector is the wrong size", both after the
weights had loaded. The generators themselves are the reference for an RNG state (a state written by `_save_rng`
loads; the same with one field broken does not).

    .venv/bin/python -m pytest -q tests/unit/test_resume_state_checks.py
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from megatron_sparse_rl.learner import checkpoint as C
from megatron_sparse_rl.learner.checkpoint import StateFileError
from megatron_sparse_rl.training.state import LoopState
from tests.snapshot import snapshot

GOOD = {"step": 2, "scheduler": {"num_steps": 2, "max_lr": 1e-5}, "world_size": 1,
        "extra": {"counters": {"sft_step": 0, "rl_step": 2, "sft_done": True, "syncs": 3, "metrics_records": 4},
                  "task": {"train": {"epoch": 0, "index": 4, "size": 20, "seed": 0, "shuffle": True}}}}


def _common(tmp_path, **changes) -> "Path":  # noqa: F821
    state = {**GOOD, **changes}
    (tmp_path / C.COMMON).write_text(json.dumps({"format": C.COMMON_FORMAT, **state}))
    return tmp_path / C.COMMON


def test_a_well_formed_common_state_reads_back_as_written(tmp_path):
    _common(tmp_path)
    assert C.read_common_state(tmp_path) == {"format": C.COMMON_FORMAT, **GOOD}


@pytest.mark.parametrize("field, value, rule, got", [
    ("step", "2", "an integer >= 0", "'2'"),
    ("step", -1, "an integer >= 0", "-1"),
    ("step", True, "an integer >= 0", "True"),
    ("step", 2.0, "an integer >= 0", "2.0"),
    ("scheduler", [], "a mapping", "[]"),
    ("extra", "none", "a mapping", "'none'"),
    ("world_size", "1", "an integer >= 1", "'1'"),
    ("world_size", 0, "an integer >= 1", "0"),
])
def test_a_common_state_field_of_the_wrong_type_is_named(tmp_path, field, value, rule, got):
    file = _common(tmp_path, **{field: value})
    before = snapshot(tmp_path)
    with pytest.raises(StateFileError) as err:
        C.read_common_state(tmp_path)
    assert str(err.value) == f"{file}: field '{field}' must be {rule} (got {got})"
    assert snapshot(tmp_path) == before


def test_a_missing_scheduler_is_named(tmp_path):
    state = {k: v for k, v in GOOD.items() if k != "scheduler"}
    (tmp_path / C.COMMON).write_text(json.dumps({"format": C.COMMON_FORMAT, **state}))
    with pytest.raises(StateFileError, match=r"common_state.json: field 'scheduler' must be a mapping \(got nothing\)"):
        C.read_common_state(tmp_path)


@pytest.mark.parametrize("change, field, rule", [
    (lambda c: c.update(rl_step="2"), "rl_step", "an integer >= 0"),
    (lambda c: c.pop("syncs"), "syncs", "an integer >= 0"),
    (lambda c: c.update(sft_done=1), "sft_done", "true or false"),
    (lambda c: c.update(metrics_records=-4), "metrics_records", "an integer >= 0"),
    (lambda c: c.update(kv_budget=0), "kv_budget", "an integer >= 1"),  # rollout.kv.budget_schedule's budget
    (lambda c: c.update(kv_budget="48"), "kv_budget", "an integer >= 1"),
])
def test_a_loop_counter_of_the_wrong_type_is_named(tmp_path, change, field, rule):
    counters = dict(GOOD["extra"]["counters"])
    change(counters)
    file = tmp_path / C.COMMON
    with pytest.raises(StateFileError, match=rf"^{file}: field 'extra.counters.{field}' must be {rule} \(got "):
        LoopState.from_saved(file, {"counters": counters})


def test_counters_that_are_not_a_mapping_and_well_formed_ones(tmp_path):
    file = tmp_path / C.COMMON
    with pytest.raises(StateFileError, match=r"field 'extra.counters' must be a mapping of the run's loop counters"):
        LoopState.from_saved(file, {"counters": [0, 2]})
    counters = {k: v for k, v in GOOD["extra"]["counters"].items() if k != "metrics_records"}  # optional
    loop = LoopState.from_saved(file, {"counters": counters})
    assert (loop.metrics_records, loop.kv_budget) == (0, None)
    assert loop.saved(None) == counters  # the same mapping back, as the next checkpoint writes it
    assert loop.saved(7) == {**counters, "metrics_records": 7}
    loop = LoopState.from_saved(file, {"counters": {**counters, "kv_budget": 48}})  # optional too
    assert loop.kv_budget == 48 and loop.saved(None) == {**counters, "kv_budget": 48}


# ---- RNG files -------------------------------------------------------------------------------------------------

def _rewrite_rng(file, change) -> None:
    """The RNG file with `change(meta, tensors)` applied (what a foreign writer could have written)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), "pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    change(meta, tensors)
    save_file(tensors, str(file), metadata=meta)


def _python(meta, keys):
    version, _, gauss = json.loads(meta["python"])
    meta["python"] = json.dumps([version, keys, gauss])


def _numpy(meta, index, value):
    state = json.loads(meta["numpy"])
    state[index] = value
    meta["numpy"] = json.dumps(state)


BROKEN = {
    "python keys too few": (lambda m, t: _python(m, [1, 2, 3]), "python", "state vector is the wrong size"),
    "python keys not ints": (lambda m, t: _python(m, ["a"] * 625), "python", ""),
    "python not a list of 3": (lambda m, t: m.update(python="[3, [1, 2]]"), "python", "a JSON list of 3 items"),
    "numpy kind": (lambda m, t: _numpy(m, 0, "PCG64"), "numpy", ""),
    "numpy keys too few": (lambda m, t: _numpy(m, 1, [1, 2, 3]), "numpy", ""),
    "numpy key out of range": (lambda m, t: _numpy(m, 1, [2**40] * 624), "numpy", ""),
    "numpy not a list of 5": (lambda m, t: m.update(numpy='{"kind": "MT19937"}'), "numpy", "a JSON list of 5 items"),
    "torch state of floats": (lambda m, t: t.update(torch=torch.zeros(5056)), "torch", ""),
    "torch state cut short": (lambda m, t: t.update(torch=t["torch"][:100].clone()), "torch", ""),
    "torch state missing": (lambda m, t: t.pop("torch"), "torch", ""),
    "tracker state of floats": (lambda m, t: t.update({"tracker.model-parallel-rng": torch.ones(2, 3)}),
                                "tracker.model-parallel-rng", "a 1-D uint8 tensor"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_an_rng_state_its_generator_refuses_is_named_and_nothing_is_set(tmp_path, name):
    change, field, detail = BROKEN[name]
    file = C.rng_file(tmp_path, 0)
    C._save_rng(file)
    _rewrite_rng(file, change)
    before = snapshot(tmp_path)
    states = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())
    with pytest.raises(StateFileError) as err:
        C._load_rng(tmp_path, 0)
    message = str(err.value)
    assert message.startswith(f"{file}: field '{field}' "), message
    assert detail in message, message
    assert snapshot(tmp_path) == before
    assert random.getstate() == states[0] and np.random.get_state()[1].tolist() == states[1]  # nothing set
    assert torch.equal(torch.get_rng_state(), states[2])


def test_the_rng_file_as_saved_passes_the_generators_checks(tmp_path):
    C._save_rng(C.rng_file(tmp_path, 0))
    state = C._read_rank_rng(tmp_path, 0)
    r = random.Random()
    r.setstate(state["python"])
    assert r.getstate() == random.getstate()
    assert C._read_rank_rng(tmp_path, 1) is None  # no file for that rank


def test_a_legacy_rng_file_of_the_wrong_shape_is_named(tmp_path):
    file = C.rng_file(tmp_path, 0, legacy=True)
    torch.save({"python": (3, (1, 2, 3), None), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "tracker": {}}, file)
    with pytest.raises(StateFileError, match=rf"^{file}: field 'python' is not a python RNG state \(ValueError: state "
                                             r"vector is the wrong size\)"):
        C._load_rng(tmp_path, 0)
