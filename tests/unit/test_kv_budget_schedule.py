"""The KV budget schedule (rollout.kv.budget_schedule): its rule against a hand-made table of inputs and budgets, the
run's budget moving step by step, and the refusals at config load / validate (bounds that exclude the starting budget,
a fixed pool too small for one sequence at the lowest budget), each naming the field.

    .venv/bin/python -m pytest -q tests/unit/test_kv_budget_schedule.py
"""
from __future__ import annotations

import math

import pytest

from megatron_sparse_rl.config import ConfigError, RunConfig
from megatron_sparse_rl.config.loader import from_dict, merge_overrides
from megatron_sparse_rl.config.rollout import KVBudgetScheduleConfig, KVConfig
from megatron_sparse_rl.kv.budget_schedule import BudgetSchedule, next_budget
from megatron_sparse_rl.validation import validate

CFG = KVBudgetScheduleConfig(enabled=True, target_p5=0.86, margin=0.04, step_up=1.25, step_down=0.9,
                             min_budget=32, max_budget=200)

# (budget, p5, next budget), worked out by hand: raise below 0.86 (ceil of x1.25), cut above 0.90 (floor of x0.9),
# keep in the band [0.86, 0.90] (both edges), clamp to [32, 200]
TABLE = [
    (64, 0.50, 80),     # 64 * 1.25 = 80
    (65, 0.85, 82),     # 81.25 -> 82 (rounded up)
    (64, 0.86, 64),     # at the target: in the band
    (64, 0.90, 64),     # at target + margin: in the band
    (64, 0.95, 57),     # 57.6 -> 57 (rounded down)
    (100, 0.999, 90),   # 100 * 0.9
    (180, 0.10, 200),   # 225 clamped to max_budget
    (200, 0.10, 200),   # at the top already
    (34, 0.99, 32),     # 30.6 -> 30, clamped to min_budget
    (32, 1.00, 32),     # at the bottom already
    (33, 0.93, 32),     # 29.7 -> 29 -> 32
    (64, float("nan"), 64),  # no token measured: keep
]


@pytest.mark.parametrize("budget,p5,want", TABLE)
def test_rule_against_a_hand_table(budget, p5, want):
    assert next_budget(budget, p5, CFG) == want


def test_a_small_budget_still_moves_when_raised():
    cfg = KVBudgetScheduleConfig(enabled=True, step_up=1.01, step_down=0.99, min_budget=1, max_budget=10)
    assert next_budget(4, 0.1, cfg) == 5    # 4.04 -> 5: a raise never rounds back to the same budget
    assert next_budget(4, 0.99, cfg) == 3   # 3.96 -> 3


def test_schedule_follows_a_sequence_of_tails_and_reports_the_moves():
    kv = KVConfig(policy="rkv", budget=64, window=8, budget_schedule=CFG)
    sched = BudgetSchedule.start(kv)
    seen = []
    for p5 in (0.5, 0.5, 0.88, 0.97, 0.97):
        before = sched.budget
        m = sched.after_step(p5)
        seen.append(sched.budget)
        assert m == {"kv/budget_next": float(sched.budget), "kv/budget_change": float(sched.budget - before)}
    assert seen == [80, 100, 100, 90, 81]   # 64 -> 80 -> 100 (band) -> 90 -> 81
    assert BudgetSchedule.start(kv, resumed=90).budget == 90
    assert BudgetSchedule.start(kv, resumed=500).budget == 200 and BudgetSchedule.start(kv, resumed=3).budget == 32
    assert BudgetSchedule.start(KVConfig(policy="rkv", budget=64, window=8)) is None  # off by default
    assert not KVConfig().budget_schedule.enabled


@pytest.mark.parametrize("sets,match", [
    (("rollout.kv.budget_schedule.min_budget=80",),
     r"rollout\.kv\.budget_schedule\.min_budget = 80: the bounds \[80, 200\] must hold the starting budget "
     r"rollout\.kv\.budget = 64"),
    (("rollout.kv.budget_schedule.min_budget=100", "rollout.kv.budget_schedule.max_budget=48"),
     r"rollout\.kv\.budget_schedule\.min_budget must be <= rollout\.kv\.budget_schedule\.max_budget = 48"),
    (("rollout.kv.budget_schedule.min_budget=16", "rollout.kv.budget_schedule.max_budget=48"),
     r"rollout\.kv\.budget_schedule\.max_budget = 48: the bounds \[16, 48\] must hold the starting budget"),
    (("rollout.kv.budget_schedule.min_budget=4",), r"rollout\.kv\.budget_schedule\.min_budget must be >= 8"),
    (("rollout.kv.policy=none",), r"rollout\.kv\.budget_schedule\.enabled = true needs a sparse rollout\.kv\.policy"),
    (("rollout.kv.budget_schedule.max_budget=null",),
     r"rollout\.kv\.budget_schedule\.max_budget must be set when rollout\.kv\.budget_schedule\.enabled = true"),
    (("rollout.kv.budget_schedule.step_up=1.0",), r"rollout\.kv\.budget_schedule\.step_up must be in \(1, 16\]"),
    (("rollout.kv.budget_schedule.step_down=1.0",), r"rollout\.kv\.budget_schedule\.step_down must be in \(0, 1\)"),
])
def test_bad_schedules_are_refused_naming_the_field(sets, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        validate(run_of(*sets), 1, cuda=False)


def run_of(*overrides: str) -> RunConfig:
    """The tiny MoE (a path that does not exist) with an R-KV engine at budget 64 and a schedule in [32, 200]."""
    base = {"model": {"path": "/nonexistent/tiny", "tiny": {}}}
    sets = ["rollout.kv.policy=rkv", "rollout.kv.budget=64", "rollout.kv.interval=32", "rollout.kv.block_size=32",
            "rollout.max_model_len=512", "rollout.kv.budget_schedule.enabled=true",
            "rollout.kv.budget_schedule.min_budget=32", "rollout.kv.budget_schedule.max_budget=200", *overrides]
    return from_dict(RunConfig, merge_overrides(base, sets))


def test_a_valid_schedule_passes_validate():
    validate(run_of(), 1, cuda=False)
    validate(run_of("rollout.kv.pool_blocks=3"), 1, cuda=False)  # (32 + 32) / 32 = 2 blocks + 1 held back


def test_pool_too_small_for_one_sequence_at_the_lowest_budget_is_refused():
    # lowest budget 32 + interval 32 = 64 tokens = 2 blocks of 32, + the block vLLM's pool holds back = 3
    with pytest.raises(ConfigError, match=r"rollout\.kv\.pool_blocks = 2 is too small for one sequence at the lowest "
                                          r"budget \(rollout\.kv\.budget_schedule\.min_budget = 32\).*"
                                          r"set rollout\.kv\.pool_blocks >= 3"):
        validate(run_of("rollout.kv.pool_blocks=2"), 1, cuda=False)
    # without a schedule the lowest budget is rollout.kv.budget: 64 + 32 = 96 tokens = 3 blocks (+ 1)
    off = ("rollout.kv.budget_schedule.enabled=false",)
    with pytest.raises(ConfigError, match=r"rollout\.kv\.pool_blocks = 3 is too small .*\(rollout\.kv\.budget = 64\)"
                                          r".*>= 4"):
        validate(run_of(*off, "rollout.kv.pool_blocks=3"), 1, cuda=False)
    validate(run_of(*off, "rollout.kv.pool_blocks=4"), 1, cuda=False)
    # the default CPU block (128 tokens) when rollout.kv.block_size is unset: 200 + 32 tokens -> 2 blocks + 1
    big = (*off, "rollout.kv.block_size=null", "rollout.kv.budget=200")
    with pytest.raises(ConfigError, match=r"2 blocks of 128 tokens.*>= 3"):
        validate(run_of(*big, "rollout.kv.pool_blocks=2"), 1, cuda=False)
    validate(run_of(*big, "rollout.kv.pool_blocks=3"), 1, cuda=False)


def test_schedule_needs_a_synchronous_colocated_run():
    with pytest.raises(ConfigError, match=r"rollout\.kv\.budget_schedule\.enabled = true needs trainer\.max_staleness"):
        validate(run_of("trainer.max_staleness=1", "launch.rollout_ranks=1", "launch.nproc_per_node=2"), 2,
                 cuda=False)


def test_nan_tail_is_nan_not_a_number_compared():
    assert math.isnan(float("nan")) and next_budget(50, float("nan"), CFG) == 50
