"""Set-up of one training process: the distributed world, the model directory, the learner, this rank's
rollout engine, the tokenizer, the task data and the metrics sinks, gathered in a `RunContext`.

Colocated: every rank is a learner with its own engine. Disaggregated (`launch.rollout_ranks` /
`launch.rollout_nodes`): learner ranks get a `RemoteEngine` (training/disaggregated.py) in place of an
engine, and rollout ranks get a `RolloutRank` (an engine to serve with) instead of a `RunContext`."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_sparse_rl.config.schema import RunConfig

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    run: RunConfig
    run_dir: Path
    model_dir: Path
    rank: int
    world_size: int
    layout: Any
    groups: Any
    learner: Any
    engine: Any
    tokenizer: Any
    task: Any
    writer: Any
    spec: Any
    routing: Any = None
    """LearnerRouting when the model is MoE and routing replay or statistics are on."""
    reference: Any = None
    """A frozen copy of the initial model (a Learner never stepped) when algorithm.kl.coef > 0."""
    engine_shares: tuple[int, ...] | None = None
    """Colocated engine TP > 1: the data-parallel ranks of the ranks this rank's engine spans, in order
    (the engine samples for all of them); None when every rank owns a whole engine."""
    owner: Any = None
    """The run directory and this run's identity (training/run_dir.py `RunDir`)."""

    @property
    def dp_group(self):
        return self.groups.dp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(parallel) -> tuple[int, int]:
    """Join the torchrun/srun world from the environment, or start a world of one on this machine, on
    `parallel.backend` of the run's ParallelConfig (parallel/world.py). A backend this machine cannot run is a
    ConfigError naming the field, before any process group starts."""
    from megatron_sparse_rl.parallel.world import join_world

    return join_world(parallel)


def ensure_model(run: RunConfig, rank: int) -> Path:
    """The HF model directory; rank 0 builds the tiny random model there first when configured and missing.

    Every rank waits at the same barrier (whether or not a model was built) so that none races ahead of
    the build.
    """
    path = Path(run.model.path)
    if rank == 0 and not (path / "config.json").is_file():
        if run.model.tiny is None:
            raise FileNotFoundError(f"model.path {str(path)!r} has no config.json (and model.tiny is not set)")
        from megatron_sparse_rl.models.tiny import build_tiny_hf_model

        t = run.model.tiny
        log.info("building tiny %s model at %s", t.arch, path)
        build_tiny_hf_model(path, arch=t.arch, hidden=t.hidden, layers=t.layers, heads=t.heads,
                            kv_heads=t.kv_heads, head_dim=t.head_dim, experts=t.experts, topk=t.topk,
                            moe_ffn=t.moe_ffn, ffn=t.ffn, seed=t.seed)
    dist.barrier()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path {str(path)!r} has no config.json (and model.tiny is not set)")
    return path


def _warn_truncated_support(run: RunConfig) -> None:
    """top-k/top-p without keep-sampling-mask: mu is over the truncated support, pi_old over the vocabulary, so
    the mismatch metrics and corrections also see the truncated mass (legal, but rarely what is meant)."""
    s, r = run.rollout.sampling, run.rollout
    if (s.top_p < 1 or s.top_k != -1) and r.logprobs_mode == "processed" and not run.algorithm.keep_sampling_mask:
        log.warning("rollout.sampling top_p=%s top_k=%s truncates the sampler's distribution but "
                    "algorithm.keep_sampling_mask is off: pi_old / mu then includes the truncated mass (k1 > 0 on "
                    "every token); set rollout.record_sampling_mask=true and algorithm.keep_sampling_mask=true to "
                    "renormalise the learner over the sampler's support", s.top_p, s.top_k)


def build_context(run: RunConfig, total_steps: int):
    """This rank's `RunContext`; on a rollout rank of a disaggregated run, its `RolloutRank` instead.

    Every rank creates the same process groups in the same order: Megatron's (over the learner ranks), the
    weight-sync group (learner rank 0 + the rollout ranks), with engine TP > 1 one sliced-sync group per engine
    TP rank, and vLLM's (each engine's start-up, mirrored by
    `join_vllm_groups` on learner ranks)."""
    from transformers import AutoTokenizer

    from megatron_sparse_rl.config import validate
    from megatron_sparse_rl.data import build_task, check_data
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.observability.logging import attach_log_file, init_logging
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu
    from megatron_sparse_rl.training import disaggregated as D
    from megatron_sparse_rl.weight_sync.engine_shards import EngineShards

    rank, world = init_world(run.parallel)
    init_logging(rank, run.logging.level, verbose=run.logging.verbose)
    validate(run, world)
    check_data(run.data)  # every record, before Megatron and vLLM start: a bad line is named in seconds
    _warn_truncated_support(run)
    megatron_cpu.apply()
    owner = _claim_run_dir(run, rank)
    run_dir = owner.path
    attach_log_file(run_dir / "logs" / f"rank{rank}.log")
    model_dir = ensure_model(run, rank)
    adapter, spec = load_spec(model_dir)
    # Tokenised prompts (a prompt over data.max_prompt_tokens is an error) before Megatron and vLLM start.
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    task = build_task(run.data, tokenizer)
    n_rollout = run.launch.rollout_world_size
    layout = ParallelLayout.from_config(run.parallel, world - n_rollout, rollout_ranks=n_rollout)
    layout.check_model(spec)
    groups = layout.initialize()
    sync = layout.weight_sync_group(src=D.SRC) if n_rollout else None
    engine_tp = run.rollout.tensor_parallel_size
    sliced = bool(n_rollout) and engine_tp > 1 and run.trainer.sync_engine_slices
    shard_groups = layout.engine_shard_groups(D.SRC, engine_tp) if sliced else None
    if groups is None:  # a rollout rank: an engine and the command loop, no model
        index = rank - layout.world_size
        return D.RolloutRank(_engine(run, run_dir, model_dir, spec), sync, rank, index, engine_tp=engine_tp,
                             weights_group=shard_groups[index % engine_tp] if sliced else None)
    if n_rollout:
        D.join_vllm_groups(engine_tp)
        engine = D.RemoteEngine(sync, list(range(layout.world_size, world)), pad_id=_pad_id(tokenizer),
                                engine_tp=engine_tp, shards=EngineShards(spec, engine_tp) if sliced else None,
                                shard_groups=shard_groups)
    with layout.learner_world(groups):
        learner, reference, routing = _learners(run, adapter, spec, layout, groups, model_dir, total_steps)
    shares = None
    if not n_rollout:
        engine = _engine(run, run_dir, model_dir, spec)
        shares = _engine_shares(groups.dp_rank, run.rollout.tensor_parallel_size)
    return RunContext(run, run_dir, model_dir, rank, world, layout, groups, learner, engine, tokenizer, task,
                      None, spec, routing, reference, shares, owner)


def _claim_run_dir(run: RunConfig, rank: int):
    """Rank 0 decides whether this run starts fresh or continues in `logging.dir` (training/run_dir.py); every
    rank gets the same answer, or the same error, before anything expensive starts."""
    from megatron_sparse_rl.training.run_dir import RunDirError, claim

    box: list = [None]
    if rank == 0:
        try:
            box[0] = claim(run)
        except RunDirError as err:
            box[0] = str(err)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise RunDirError(box[0])
    return box[0]


def _engine_shares(dp_rank: int, engine_tp: int) -> tuple[int, ...] | None:
    """Colocated: the data-parallel ranks of the `engine_tp` consecutive ranks that form this rank's engine
    (vLLM's external_launcher layout), sorted; None for engine TP 1. Collective over the world."""
    if engine_tp == 1:
        return None
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, dp_rank)
    first = dist.get_rank() // engine_tp * engine_tp
    return tuple(sorted(set(every[first:first + engine_tp])))


def _pad_id(tokenizer) -> int:
    """The pad id the engine uses (its tokenizer is this one): pad, else EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _learners(run: RunConfig, adapter, spec, layout, groups, model_dir: Path, total_steps: int):
    """(learner, frozen reference or None, LearnerRouting or None), loaded from the HF model."""
    from megatron_sparse_rl.learner.learner import Learner

    use_routing = spec.is_moe and run.routing.replay
    # The policy being optimised is the one that samples: logits / sampling temperature (1 for greedy).
    temperature = run.rollout.sampling.temperature or 1.0
    learner = Learner(adapter, spec, layout, groups, model_cfg=run.model, cfg=run.learner, total_steps=total_steps,
                      temperature=temperature, routing_replay=use_routing)
    learner.load_hf(model_dir)
    reference = None
    if run.algorithm.kl.coef > 0:  # KL to the initial policy needs its logprobs: a frozen copy of the model
        reference = Learner(adapter, spec, layout, groups, model_cfg=run.model, cfg=run.learner, total_steps=1,
                            temperature=temperature)
        reference.load_hf(model_dir)
    routing = None
    if use_routing:
        from megatron_sparse_rl.learner.routing import LearnerRouting

        routing = LearnerRouting(learner, run.routing)
    return learner, reference, routing


def _engine(run: RunConfig, run_dir: Path, model_dir: Path, spec):
    """This rank's vLLM engine (with route capture when R3 or route recording is on)."""
    from megatron_sparse_rl.rollout import RolloutEngine

    if run.launch.rollout_world_size and torch.cuda.is_available():
        raise NotImplementedError("disaggregated placement runs its engines on CPU only so far (on GPU the engine "
                                  "would join the whole world through vLLM's external_launcher); set "
                                  "launch.rollout_ranks=0 and launch.rollout_nodes=0 for a colocated run")
    capture = spec.is_moe and run.routing.capture
    native = capture and run.routing.vllm_routes(torch.cuda.is_available())
    engine = RolloutEngine(model_dir, run.rollout, cache_dir=run_dir / "vllm_cache", vllm_routes=native)
    if native:
        from megatron_sparse_rl.rollout.routes_vllm import VLLMRouteOutput

        VLLMRouteOutput.attach(engine)
    elif capture:
        from megatron_sparse_rl.rollout.routes import EngineRouteCapture

        EngineRouteCapture.attach(engine)
    return engine


def open_metrics(ctx: RunContext, keep_records: int | None) -> None:
    """Rank 0's metrics sink; on resume, records written after the checkpoint are dropped."""
    from megatron_sparse_rl.observability.metrics import MetricsWriter

    if ctx.is_main:
        ctx.writer = MetricsWriter(ctx.run_dir, tensorboard=ctx.run.logging.tensorboard, keep_records=keep_records)
