"""The KV budget schedule (`rollout.kv.budget_schedule`): each RL step's sparse-KV budget from the tail of the
per-token ratio the step before measured. Pure Python; the trainer applies the budget to its engines
(kv/engine_extension.py `set_sparse_kv_budget`) before each step's rollouts.

The rule (`next_budget`), for budget b and p5 = the 5th percentile of rho_t = pi_old / mu (`mismatch/rho_p5`):
    p5 < target_p5           -> ceil(b * step_up)
    p5 > target_p5 + margin  -> floor(b * step_down)
    otherwise                -> b
then clamped to [min_budget, max_budget]. Sparrow (arXiv 2606.08446) trains stably while p5 stays >= 0.86: a low
tail asks for more KV, a comfortable one gives KV back; the dead band (margin) keeps the budget from oscillating.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sparse_rl.config.rollout import KVBudgetScheduleConfig, KVConfig


def next_budget(budget: int, p5: float, cfg: KVBudgetScheduleConfig) -> int:
    """The budget of the next step after a step at `budget` measured `p5` (see the module docstring). A NaN p5 (no
    token measured) keeps the budget."""
    if cfg.min_budget is None or cfg.max_budget is None:
        raise ValueError("rollout.kv.budget_schedule needs min_budget and max_budget")
    if math.isnan(p5):
        new = budget
    elif p5 < cfg.target_p5:
        new = math.ceil(budget * cfg.step_up)
    elif p5 > cfg.target_p5 + cfg.margin:
        new = math.floor(budget * cfg.step_down)
    else:
        new = budget
    return min(max(new, cfg.min_budget), cfg.max_budget)


@dataclass
class BudgetSchedule:
    """The run's current budget: `budget` for the coming step's rollouts; `after_step` moves it by the rule."""

    cfg: KVBudgetScheduleConfig
    budget: int

    @classmethod
    def start(cls, kv: KVConfig, resumed: int | None = None) -> "BudgetSchedule | None":
        """The schedule of `kv` starting at rollout.kv.budget, or at the budget a resumed run had reached (clamped to
        the bounds, like every budget the rule gives); None when the schedule is off."""
        if kv.policy == "none" or not kv.budget_schedule.enabled:
            return None
        sched = kv.budget_schedule
        start = kv.budget if resumed is None else min(max(int(resumed), sched.min_budget), sched.max_budget)
        return cls(sched, start)

    def after_step(self, p5: float) -> dict[str, float]:
        """Move to the next step's budget from this step's `p5`; the metrics kv/budget_next and kv/budget_change."""
        old, self.budget = self.budget, next_budget(self.budget, p5, self.cfg)
        return {"kv/budget_next": float(self.budget), "kv/budget_change": float(self.budget - old)}
