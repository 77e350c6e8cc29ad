"""`PipelineStages`: how many decoder layers each pipeline stage holds, from `parallel.pp`, `parallel.vpp`,
`parallel.pipeline_layout` and the model's layer count, and the Megatron-Core setting that builds it.

    stages = pipeline_stages(pp=3, num_layers=7)                 # (3, 2, 2): balanced, chosen automatically
    stages = pipeline_stages(pp=3, num_layers=7, layout="Ett|ttt|ttL")   # (2, 3, 2): as written
    stages.megatron_kwargs()   # {"pipeline_model_parallel_layout": "Ettt|tt|ttL"}; {} for an even split
    stages = pipeline_stages(pp=2, num_layers=7, vpp=2)          # (2, 2, 2, 1): virtual stages 0..3
    stages.chunks(pp_rank=0)   # (0, 2): rank 0 holds virtual stages 0 and 2, as model chunks 0 and 1

Stage p starts at layer sum(layers[:p]), which is what Megatron-Core's `get_transformer_layer_offset` computes from
the layout this returns; the learner reads each layer's global index from the layer itself (`layer_number`), so
routes, keep sets, names and conversion follow whatever split Megatron built. A pp that divides the layer count with
no layout keeps Megatron's default (no layout passed).

Interleaved pipelines (`parallel.vpp` > 1): pp * vpp virtual stages in layer order, virtual stage v on pipeline rank
v % pp as its model chunk v // pp (Megatron-Core's order: a layout string then has pp * vpp stages). With no layout
the layers are balanced over the virtual stages the same way, the earlier ones one layer more: 7 layers at pp 2 x
vpp 2 -> 2,2,2,1, rank 0 holding layers 0-1 and 4-5, rank 1 layers 2-3 and 6. The layout is always passed to Megatron
at vpp > 1. Multi-token-prediction layers ('m': the learner builds none) are refused.
"""
from __future__ import annotations

from dataclasses import dataclass

LAYOUT_CHARS = frozenset("EtmL|(),*0123456789 ")
"""The characters of a Megatron-Core layout string (transformer/pipeline_parallel_layer_layout.py `parse_str_to_list`):
E embedding, t decoder layer, m multi-token-prediction layer, L loss, | between stages, (..)*n and x*n repeats."""


@dataclass(frozen=True)
class PipelineStages:
    """Decoder layers per pipeline stage, and whether they were written (`parallel.pipeline_layout`) or chosen."""

    layers: tuple[int, ...]
    """Decoder layers of each (virtual) stage, in layer order: pp * vpp entries."""
    explicit: bool = False
    vpp: int = 1
    """Model chunks per pipeline rank (parallel.vpp); virtual stage v is chunk v // pp of rank v % pp."""

    @property
    def pp(self) -> int:
        return len(self.layers) // self.vpp

    def chunks(self, pp_rank: int) -> tuple[int, ...]:
        """The virtual stages of pipeline rank `pp_rank`, one per model chunk in chunk order."""
        return tuple(range(pp_rank, len(self.layers), self.pp))

    @property
    def even(self) -> bool:
        return len(set(self.layers)) == 1

    def offset(self, stage: int) -> int:
        """Index of stage `stage`'s first layer."""
        return sum(self.layers[:stage])

    def layout(self) -> str:
        """The Megatron-Core layout string of this split: embedding on the first stage, loss on the last."""
        return "E" + "|".join("t" * n for n in self.layers) + "L"

    def megatron_kwargs(self) -> dict:
        """TransformerConfig keywords that build this split ({} where Megatron's default even split is it)."""
        if len(self.layers) == 1 or (self.even and not self.explicit and self.vpp == 1):
            return {}
        return {"pipeline_model_parallel_layout": self.layout()}

    def describe(self) -> str:
        """'stages 3,2,2 (balanced, automatic)' / 'stages 2,3,2 (parallel.pipeline_layout)' / 'stages 4,4' /
        'virtual stages 2,2,2,1 (pp 2 x vpp 2; balanced, automatic)'."""
        how = "parallel.pipeline_layout" if self.explicit else "" if self.even else "balanced, automatic"
        if self.vpp > 1:
            how = f"pp {self.pp} x vpp {self.vpp}" + (f"; {how}" if how else "")
            return f"virtual stages {','.join(map(str, self.layers))} ({how})"
        return f"stages {','.join(map(str, self.layers))}" + (f" ({how})" if how else "")


def compact(layers: tuple[int, ...]) -> str:
    """Layers per stage with runs folded as Megatron's layout strings fold them: (8,8,8,8,8,7,7,7) -> '8*5,7*3'."""
    runs: list[list[int]] = []
    for n in layers:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ",".join(f"{n}*{k}" if k > 1 else str(n) for n, k in runs)


def balanced(num_layers: int, pp: int) -> tuple[int, ...]:
    """`num_layers` over `pp` stages, the earlier stages one layer more where pp does not divide: 7 over 3 -> 3,2,2;
    61 over 8 -> 8,8,8,8,8,7,7,7."""
    base, extra = divmod(num_layers, pp)
    return tuple(base + (p < extra) for p in range(pp))


def _parse(layout: str) -> list[list[str]]:
    """Megatron's own parser of a layout string -> one list of layer letters per stage."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    field = "parallel.pipeline_layout"
    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
    except (AssertionError, ValueError) as e:
        raise ValueError(f"{field} = {layout!r} is not a Megatron-Core layout string: {e}") from None
    letters = {"embedding": "E", "loss": "L", "decoder": "t", "mtp": "m"}
    return [[letters.get(t.name, t.name) for t in stage] for stage in stages]


def pipeline_stages(pp: int, num_layers: int, layout: str | None = None, vpp: int = 1) -> PipelineStages:
    """The split of `num_layers` decoder layers over `pp` * `vpp` (virtual) stages: `layout` as written (checked),
    else balanced. Raises ValueError naming parallel.pp / parallel.vpp / parallel.pipeline_layout."""
    if vpp < 1 or (vpp > 1 and pp < 2):
        raise ValueError(f"parallel.vpp={vpp} needs parallel.pp > 1 (got pp={pp}): interleaving splits each pipeline "
                         "rank's layers into vpp model chunks; use vpp 1 without pipeline parallelism")
    total = pp * vpp
    if layout is None:
        if total > num_layers:
            what = f"parallel.pp={pp}" if vpp == 1 else f"parallel.pp * parallel.vpp = {pp} * {vpp} = {total}"
            raise ValueError(f"{what} exceeds the layer count ({num_layers}): every stage needs a layer")
        return PipelineStages(balanced(num_layers, total), vpp=vpp)
    field = f"parallel.pipeline_layout = {layout!r}"
    stages = _parse(layout)
    if len(stages) != total:
        if vpp > 1:
            raise ValueError(f"{field} has {len(stages)} stages, parallel.pp * parallel.vpp = {pp} * {vpp} = {total}: "
                             "write one stage per virtual pipeline stage, in layer order (virtual stage v runs on "
                             "pipeline rank v % pp), separated by '|'")
        more = (f" (for interleaved virtual stages set parallel.vpp={len(stages) // pp})"
                if len(stages) > pp and len(stages) % pp == 0 else "")
        raise ValueError(f"{field} has {len(stages)} stages, parallel.pp={pp}: write one stage per pipeline rank, "
                         f"separated by '|'{more}")
    flat = [c for s in stages for c in s]
    if not flat or flat[0] != "E" or flat.count("E") != 1 or flat[-1] != "L" or flat.count("L") != 1:
        raise ValueError(f"{field} must start with the embedding 'E' and end with the loss 'L', once each (Megatron-Core"
                         f"'s rule), e.g. 'Ettt|tt|ttL'")
    for p, stage in enumerate(stages):
        if "m" in stage and p != total - 1:
            raise ValueError(f"{field} puts multi-token-prediction layers ('m') on stage {p}, before the last stage "
                             f"({total - 1})")
    if "m" in flat:
        raise ValueError(f"{field} places multi-token-prediction layers ('m'), but the learner builds none (a "
                         "checkpoint's MTP layers are skipped on import): leave 'm' out")
    counts = tuple(s.count("t") for s in stages)
    if sum(counts) != num_layers:
        raise ValueError(f"{field} places {sum(counts)} decoder layers ('t'), the model has {num_layers}: the layout "
                         "must cover every layer once")
    if 0 in counts:
        raise ValueError(f"{field} leaves stage {counts.index(0)} without a decoder layer ('t'): every stage needs one")
    return PipelineStages(counts, explicit=True, vpp=vpp)
