"""The parallel layout's checks in `validate` (validation/validate.py): the degrees over the learner ranks against
the world size and the model, the interleaved pipeline, the training batches a pipeline splits, and context
parallelism's kernels and sequence split."""
from __future__ import annotations

from megatron_sparse_rl.config.degrees import ParallelDegrees
from megatron_sparse_rl.config.schema import RunConfig
from megatron_sparse_rl.validation.resolve import max_model_len, max_model_len_origin


def layout_problems(run: RunConfig, world_size: int, spec, cuda: bool) -> list[str]:
    """Problems of the parallel layout over the LEARNER ranks (all of `world_size` when colocated)."""
    rollout = run.launch.rollout_world_size
    learners = world_size - rollout
    if learners < 1:
        return [f"a disaggregated run needs at least one learner rank: world size {world_size} - "
                f"{rollout} rollout ranks (launch.rollout_ranks / launch.rollout_nodes) = {learners}"]
    try:
        layout = ParallelDegrees.from_config(run.parallel, learners, rollout_ranks=rollout, cuda=cuda)
    except ValueError as e:
        where = f"learner ranks = world size {world_size} - {rollout} rollout ranks = {learners}: " if rollout else ""
        return [where + str(e)]
    problems = []
    if spec is not None:
        try:
            layout.check_model(spec)
        except ValueError as e:
            problems.append(str(e))
    if layout.backend == "nccl" and not cuda:
        problems.append("parallel.backend='nccl' needs CUDA, which is not available; use 'auto' or 'gloo'")
    return problems + _interleaved_problems(run, layout) + _pipeline_batch_problems(run, layout)


def _interleaved_problems(run: RunConfig, layout: ParallelDegrees) -> list[str]:
    """parallel.vpp > 1: what the interleaved schedule does not run yet (DSA indexer replay and loss). (At cp > 1 it
    runs: tests/distributed/test_context_parallel.py, pp 2 x vpp 2 x cp 2.)"""
    if layout.vpp == 1:
        return []
    problems = []
    if run.routing.indexer_replay != "none" or run.model.dsa_indexer_loss_coeff > 0:
        problems.append(f"routing.indexer_replay = {run.routing.indexer_replay!r} and model.dsa_indexer_loss_coeff = "
                        f"{run.model.dsa_indexer_loss_coeff:g} need parallel.vpp = 1 (got {layout.vpp}): a rank's DSA "
                        "layers are not one run of the record's columns across model chunks; set 'none' and 0")
    return problems


def _pipeline_batch_problems(run: RunConfig, layout: ParallelDegrees) -> list[str]:
    """parallel.pp > 1: the training batches must split as the pipeline runs them. Stages exchange activations of
    one shape, so the micro-batches must be equal (the rows a multiple of learner.micro_batch_size, or one
    micro-batch of fewer), and Megatron-Core's interleaved schedule (vpp > 1) runs them in groups of pp per model
    chunk (microbatch_group_size_per_vp_stage = pp), refusing a count that is not a multiple of pp. Checked on each
    update's rows per data-parallel rank (prompts_per_step * n / dp / updates_per_rollout) and on the SFT
    warm-start's (sft.batch_size / dp) when it runs. (Forward-only calls, such as the weight-sync probe's one row,
    are padded by the learner: learner.pipeline_split.)"""
    if layout.pp == 1:
        return []
    t, n, mbs, pp, vpp = run.trainer, run.rollout.sampling.n, run.learner.micro_batch_size, layout.pp, layout.vpp
    batches = [("each update's rows per data-parallel rank (trainer.prompts_per_step * rollout.sampling.n / dp / "
                f"trainer.updates_per_rollout = {t.prompts_per_step} * {n} / {layout.dp} / {t.updates_per_rollout})",
                t.prompts_per_step * n, layout.dp * t.updates_per_rollout)]
    if t.sft.max_steps > 0:
        batches.append(("the SFT warm-start's rows per data-parallel rank (trainer.sft.batch_size / dp = "
                        f"{t.sft.batch_size} / {layout.dp})", t.sft.batch_size, layout.dp))
    problems = []
    for what, total, parts in batches:
        rows, rest = divmod(total, parts)
        if vpp > 1 and (rest or rows % mbs or (rows // mbs) % pp):
            problems.append(f"parallel.vpp={vpp}: {what} must split into micro-batches of "
                            f"learner.micro_batch_size={mbs} whose count is a multiple of parallel.pp={pp} "
                            f"(Megatron-Core's interleaved schedule runs them in groups of pp per model chunk); got "
                            f"{total / parts:g} rows")
        elif vpp == 1 and not rest and rows > mbs and rows % mbs:
            problems.append(f"parallel.pp={pp}: {what} must split into equal micro-batches of "
                            f"learner.micro_batch_size={mbs} (pipeline stages exchange activations of one shape): "
                            f"got {rows} rows; make it a multiple of {mbs}, or set the micro-batch size to a "
                            "divisor of it")
    return problems


def context_parallel_problems(run: RunConfig, world_size: int, spec, cuda: bool) -> list[str]:
    """parallel.cp > 1: the kernels that run it and the sequence length limit its split needs. (What the model or
    the other degrees cannot run at cp > 1 is `ParallelDegrees.check_model`'s.)"""
    from megatron_sparse_rl._optional import has_te
    from megatron_sparse_rl.models import kernels as model_kernels

    if run.parallel.cp == 1:
        return []
    problems = []
    try:
        model_kernels.check_context_parallel(model_kernels.resolve(run.learner.kernels, "cuda" if cuda else "cpu"),
                                             use_te=cuda and has_te(),
                                             sparse_attention=bool(getattr(spec, "index_topk", 0)))
    except ValueError as e:
        problems.append(f"{e} (parallel.cp = {run.parallel.cp})")
    limit = max_model_len(run.rollout, spec)
    if limit is None:
        return problems
    rollout = run.launch.rollout_world_size
    try:
        degrees = ParallelDegrees.from_config(run.parallel, world_size - rollout, rollout_ranks=rollout, cuda=cuda)
    except ValueError:
        return problems  # the layout's own problem is reported by layout_problems
    positions, chunks = limit - 1, 2 * degrees.cp
    where = f"rollout.max_model_len = {limit}" + (f" ({max_model_len_origin(run.rollout, spec)})"
                                                  if run.rollout.max_model_len is None else "")
    if positions < chunks:
        problems.append(f"{where} gives the learner {positions} input positions, fewer than the 2 x parallel.cp = "
                        f"{chunks} chunks context parallelism splits every sequence into; raise "
                        f"rollout.max_model_len to at least {chunks + 1} or lower parallel.cp")
    elif spec is not None and degrees.padded_positions(positions) > spec.max_position_embeddings:
        padded = degrees.padded_positions(positions)
        problems.append(f"{where}: the learner pads a sequence's {positions} input positions to a multiple of "
                        f"{degrees.sequence_multiple} (2 x parallel.cp" + (" x parallel.tp, sequence parallel"
                                                                             if degrees.sequence_parallel else "")
                        + f") = {padded}, beyond the model's max_position_embeddings ({spec.max_position_embeddings}); "
                        f"lower rollout.max_model_len to at most {spec.max_position_embeddings // degrees.sequence_multiple * degrees.sequence_multiple + 1}")
    return problems
