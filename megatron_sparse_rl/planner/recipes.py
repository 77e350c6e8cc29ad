"""Learner layouts that published RL recipes use, which the planner ranks first among equals (`msrl plan`).

    published_recipe(shape, gpus=256, tp=8, pp=8, ep=32)   # -> Recipe or None

A recipe names its model by shape (architecture, layers, hidden size, routed experts), so a local copy of the
same model directory matches as the bundled name does. Every entry was read from the recipe file it cites
(NVIDIA-NeMo/RL, `examples/configs/recipes/llm/`); a recipe matches its layout at cp 1 (the planner ranks the
recipe's context parallelism as a candidate of its own), and what else it sets (its cp, its hand-written stages) is
stated in `note` and printed with the layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sparse_rl.planner.shapes import ModelShape


@dataclass(kw_only=True, frozen=True, slots=True)
class Recipe:
    name: str
    """How the report names it: project and recipe file."""
    architecture: str
    layers: int
    hidden: int
    num_experts: int
    gpus: int
    """The GPUs of the learner (nodes x GPUs per node)."""
    tp: int
    pp: int
    ep: int
    note: str = ""
    """What the recipe sets that the planner does not model."""


_NEMO_RL = "NeMo-RL examples/configs/recipes/llm/"
_DSV3 = dict(architecture="DeepseekV3ForCausalLM", layers=61, hidden=7168, num_experts=256)
_QWEN3_235B = dict(architecture="Qwen3MoeForCausalLM", layers=94, hidden=4096, num_experts=128)
_QWEN3_30B = dict(architecture="Qwen3MoeForCausalLM", layers=48, hidden=2048, num_experts=128)

RECIPES: tuple[Recipe, ...] = (
    Recipe(name=_NEMO_RL + "grpo-dapomath17k-dsv3-megatron.yaml", gpus=256, tp=8, pp=8, ep=32, **_DSV3,
           note="the recipe adds context parallel 4 (tp8 pp8 cp4 ep32, dp 1; this row is its cp 1 variant, dp 4); "
                "stages of 7, 8 x 6, 6 layers; 16384 tokens"),
    Recipe(name=_NEMO_RL + "performance/grpo-deepseek-v3-32n8g.yaml", gpus=256, tp=1, pp=16, ep=16, **_DSV3,
           note="stages of 3, 4 x 14, 2 layers; 1536 tokens"),
    Recipe(name=_NEMO_RL + "performance/grpo-qwen3-235b-16n8g.yaml", gpus=128, tp=2, pp=8, ep=16, **_QWEN3_235B,
           note="the recipe adds context parallel 2 (this row is its cp 1 variant); stages of 11, 12 x 6, 11 "
                "layers; 8192 tokens"),
    Recipe(name=_NEMO_RL + "performance/grpo-qwen3-30ba3b-4n8g.yaml", gpus=32, tp=1, pp=1, ep=8, **_QWEN3_30B,
           note="4096 tokens"),
)


def published_recipe(shape: ModelShape, *, gpus: int, tp: int, pp: int, ep: int) -> Recipe | None:
    """The published recipe that trains `shape` on `gpus` GPUs at exactly (tp, pp, ep), if there is one."""
    for r in RECIPES:
        if ((r.architecture, r.layers, r.hidden, r.num_experts, r.gpus, r.tp, r.pp, r.ep)
                == (shape.architecture, shape.layers, shape.hidden, shape.num_experts, gpus, tp, pp, ep)):
            return r
    return None
