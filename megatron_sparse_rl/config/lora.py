"""`model.lora`: LoRA adapters (issue 49), off unless the section is set. Field checks are here; whether the model
has the target modules is checked by validate() against its config.json (validation/validate.py, lora/targets.py).

    model:
      lora: {rank: 16, alpha: 32, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj]}
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sparse_rl.config.checks import check as _check

MAX_LORA_RANK = 1 << 16
"""The largest adapter rank (65,536: above every hidden size of released models; a rank past a linear's own width
adds nothing)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class LoraConfig:
    """LoRA adapters: the base model is frozen and every targeted linear W x gains scale x B A x, with A [rank, in],
    B [out, rank] and scale = alpha / rank (Hugging Face PEFT's `LoraConfig`, whose defaults these are). Unset
    (null): no adapters, every parameter trains."""

    rank: int = 8
    """Adapter rank r (PEFT's `r`): A is r x in, B is out x r. At least 1."""
    alpha: float = 8.0
    """Scale numerator (PEFT's `lora_alpha`): the adapter's output is multiplied by alpha / rank. > 0."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (PEFT's `lora_dropout`), in [0, 1); 0 at parallel.tp > 1."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """The linears adapted, by PEFT's module names: q_proj, k_proj, v_proj, o_proj (MLA: q_a_proj, q_b_proj or
    q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj); gate_proj, up_proj, down_proj (the dense MLP and shared experts);
    experts (every routed expert's three linears; not trained yet, so refused at validate, and so is all-linear on
    an MoE model); or all-linear for every one the model has. A name the model lacks is refused at validate,
    listing the ones it has."""

    def __post_init__(self):
        _check(isinstance(self.rank, int) and 1 <= self.rank <= MAX_LORA_RANK,
               f"model.lora.rank must be an integer in [1, {MAX_LORA_RANK}] (got {self.rank!r}); to train without "
               "adapters leave model.lora unset")
        _check(math.isfinite(self.alpha) and self.alpha > 0, f"model.lora.alpha must be a finite number > 0 "
               f"(got {self.alpha!r})")
        _check(math.isfinite(self.dropout) and 0 <= self.dropout < 1,
               f"model.lora.dropout must be in [0, 1) (got {self.dropout!r})")
        _check(len(self.target_modules) > 0, "model.lora.target_modules must name at least one module (or "
               "'all-linear')")
        dup = sorted({t for t in self.target_modules if self.target_modules.count(t) > 1})
        _check(not dup, f"model.lora.target_modules names {dup} more than once")
        _check(all(t.strip() == t and t for t in self.target_modules),
               f"model.lora.target_modules must be module names without spaces (got {list(self.target_modules)})")

    @property
    def scale(self) -> float:
        """alpha / rank: what B A x is multiplied by."""
        return self.alpha / self.rank
