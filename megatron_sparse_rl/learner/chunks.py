"""`ModelChunks`: the model chunks of one pipeline rank under an interleaved pipeline (`parallel.vpp` > 1), and the
helpers that treat one model and several chunks alike.

    model = ModelChunks([chunk0, chunk1])   # chunk i: GPTModel(vp_stage=i), virtual stage i * pp + pp_rank
    chunks_of(model)                        # [chunk0, chunk1]; [model] for a single model (vpp 1)
    sharded_state_dict(model)               # {"model0": ..., "model1": ...}, as Megatron's training names them
    load_sharded(model, state["model"])     # back into each chunk

A `ModelChunks` is a `torch.nn.ModuleList`, so `modules()`, `parameters()`, `train()` and `eval()` reach every chunk:
what finds layers by walking the modules (routers, indexers, attention hooks) sees all of this rank's layers and reads
each one's global index from `layer_number`. At vpp 1 the learner keeps its single model as before (no ModelChunks).
torch_dist keys are global (layer offsets are part of each sharded tensor), so a checkpoint saved with chunks loads
into one model and the other way round: only the nesting of the Python dict differs.
`pipeline_split`: how a forward-only call of any row count splits into micro-batches at pp > 1;
`check_micro_batches`: whether the schedule can run a call's micro-batches.
"""
from __future__ import annotations

import torch


class ModelChunks(torch.nn.ModuleList):
    """This pipeline rank's model chunks, in chunk (vp_stage) order; each a GPTModel or its DDP wrapper."""

    def zero_grad_buffer(self) -> None:
        for chunk in self:
            chunk.zero_grad_buffer()


def chunks_of(model) -> list:
    """The chunks of `model`: its members for a ModelChunks, else [model]."""
    return list(model) if isinstance(model, ModelChunks) else [model]


def unwrap(model):
    """The GPTModel inside DDP (and other `.module`) wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def sharded_state_dict(model) -> dict:
    """Megatron's sharded state dict of `model`; of several chunks, one per chunk under model0, model1, ..."""
    chunks = chunks_of(model)
    if len(chunks) == 1:
        return unwrap(chunks[0]).sharded_state_dict()
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def load_sharded(model, state: dict) -> None:
    """Load what `dist_checkpointing.load` returned for `sharded_state_dict(model)` into `model`."""
    chunks = chunks_of(model)
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(state)
        return
    for i, c in enumerate(chunks):
        unwrap(c).load_state_dict(state[f"model{i}"])


def pipeline_split(rows: int, micro_batch_size: int, pp: int, vpp: int = 1) -> tuple[int, int]:
    """(micro-batches, rows in each) for a forward-only call of `rows` rows at pp > 1: the fewest equal micro-batches
    of at most `micro_batch_size` rows, a multiple of pp of them at vpp > 1 (Megatron-Core's interleaved schedule runs
    them in groups of pp per model chunk). count * size - rows slots are padding: 1 row at pp 2 x vpp 2 -> (2, 1);
    5 rows of micro-batch 4 at pp 2 -> (2, 3). A batch that already splits so keeps its split."""
    count = -(-rows // micro_batch_size)
    if vpp > 1:
        count = -(-count // pp) * pp
    return count, -(-rows // count)


def check_micro_batches(batches, *, rows: int, layout, micro_batch_size: int, recorded: bool) -> int:
    """The rows per micro-batch of `batches` ((row index, real rows) each), after checking that the pipeline schedule
    runs them: equal micro-batches at pp > 1, a multiple of pp of them at vpp > 1, and no padding rows in a call
    that carries per-row records (`recorded`: routes or DSA indexer choices). Raises ValueError naming the fields."""
    mbs = len(batches[0][0])
    if layout.pp > 1 and any(len(index) != mbs for index, _ in batches):
        # pipeline stages exchange activations of one fixed [seq, micro_batch, hidden] shape
        raise ValueError(f"with parallel.pp={layout.pp} the batch ({rows} rows) must split into "
                         f"equal micro-batches of learner.micro_batch_size={micro_batch_size}")
    if layout.vpp > 1 and len(batches) % layout.pp:
        # the interleaved schedule runs micro-batches in groups of pp per chunk (microbatch_group_size_per_vp_stage)
        raise ValueError(f"with parallel.vpp={layout.vpp} the batch ({rows} rows) must split into a multiple of "
                         f"parallel.pp={layout.pp} micro-batches of learner.micro_batch_size={micro_batch_size} "
                         f"(got {len(batches)})")
    if recorded and any(real < len(index) for index, real in batches):
        # their records are assembled per micro-batch row; the run's routed calls carry the step's whole batch
        raise ValueError(f"a routed call (extras.routes / extras.indexer) of {rows} rows would need padding rows "
                         f"at parallel.pp={layout.pp} x vpp={layout.vpp} with learner.micro_batch_size="
                         f"{micro_batch_size}; give it a batch that splits into equal micro-batches (a multiple of pp "
                         "of them at vpp > 1)")
    return mbs
