"""Set-up of one training process: the distributed world, the model directory, the learner, where the rollout
engines are (a `Placement`, placement/placements.py), the tokenizer, the task data and the metrics sinks, gathered
in a `RunContext`.

Colocated: every rank is a learner with its own engine (or a share of one spanning several ranks).
Disaggregated (`launch.rollout_ranks` / `launch.rollout_nodes`): learner ranks drive the engines of the
rollout ranks through a `RemoteEngine` (placement/disaggregated.py), and rollout ranks get a `RolloutRank` (an
engine to serve with) instead of a `RunContext`. The placement is chosen here, once."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_sparse_rl.config.schema import RunConfig
from megatron_sparse_rl.training.feature_metrics import FeatureHook, feature_hooks
from megatron_sparse_rl.weight_sync.engine_weights import EngineWeights

if TYPE_CHECKING:  # the set-up below imports these where it builds them
    from transformers import PreTrainedTokenizerBase

    from megatron_sparse_rl.data.task import Task
    from megatron_sparse_rl.learner.learner import Learner
    from megatron_sparse_rl.models.spec import ModelSpec
    from megatron_sparse_rl.observability.metrics import MetricsWriter
    from megatron_sparse_rl.parallel.layout import ParallelGroups, ParallelLayout
    from megatron_sparse_rl.placement.placements import Placement
    from megatron_sparse_rl.run.run_dir import RunDir

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    run: RunConfig
    run_dir: Path
    model_dir: Path
    rank: int
    world_size: int
    layout: ParallelLayout
    groups: ParallelGroups
    learner: Learner
    placement: Placement
    """Where the engines are (placement/placements.py): the steps generate, sync and verify through it."""
    tokenizer: PreTrainedTokenizerBase
    task: Task
    writer: MetricsWriter | None
    """Rank 0's metrics sink (`open_metrics`); None on the other ranks and before it opens."""
    spec: ModelSpec
    owner: RunDir
    """The run directory and this run's identity (run/run_dir.py `RunDir`)."""
    reference: Learner | None = None
    """A frozen copy of the initial model (a Learner never stepped) when algorithm.kl.coef > 0."""
    features: tuple[FeatureHook, ...] = ()
    """The step metrics of the features this run has on (training/feature_metrics.py `feature_hooks`)."""

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
        from megatron_sparse_rl.config.schema import MLA_ARCHS
        from megatron_sparse_rl.models.tiny_config import tiny_fields
        from megatron_sparse_rl.models.tiny import build_tiny_hf_model
        from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

        t = run.model.tiny
        log.info("building tiny %s model at %s", t.arch, path)
        if t.arch in MLA_ARCHS:
            build_tiny_deepseek(path, **tiny_fields(t))
        else:
            build_tiny_hf_model(path, arch=t.arch, **tiny_fields(t))
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

    Disaggregated, `layout.initialize()` gives the learner ranks and the rollout ranks a default world each
    (parallel/bridge.py): Megatron's groups are made in the learners', vLLM's in the rollout ranks' (each
    engine's start-up), and the bridges between them (the weight-sync group: learner rank 0 + the rollout ranks;
    with engine TP > 1 one sliced-sync group per engine TP rank) by every rank in the same order."""
    from transformers import AutoTokenizer

    from megatron_sparse_rl.data import build_task
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.observability.logging import attach_log_file
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu
    from megatron_sparse_rl.placement import disaggregated as D
    from megatron_sparse_rl.placement import placements as P
    from megatron_sparse_rl.weight_sync.engine_shards import EngineShards

    rank, world, run, summary = _checked(run)
    megatron_cpu.apply()
    owner = _claim_run_dir(run)
    run_dir = owner.path
    attach_log_file(run_dir / "logs" / f"rank{rank}.log")
    if summary:
        log.info("run summary:\n  %s", "\n  ".join(summary))
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
        return D.RolloutRank(_engine(run, model_dir, spec), sync, rank, index, engine_tp=engine_tp,
                             weights_group=shard_groups[index % engine_tp] if sliced else None)
    if n_rollout:
        remote = D.RemoteEngine(sync, list(range(layout.world_size, world)), pad_id=_pad_id(tokenizer),
                                engine_tp=engine_tp, shards=EngineShards(spec, engine_tp) if sliced else None,
                                shard_groups=shard_groups)
    learner, reference = _learners(run, adapter, spec, layout, groups, model_dir, total_steps)
    placement = (P.Disaggregated(remote, groups, layout.dp, layout.world_size, weights=EngineWeights.of(run.rollout),
                                 recompute_kv=run.trainer.in_flight_kv == "recompute",
                                 depth=run.trainer.max_staleness) if n_rollout
                 else _colocated(run, model_dir, spec, layout, groups))
    return RunContext(run, run_dir, model_dir, rank, world, layout, groups, learner, placement, tokenizer, task,
                      writer=None, spec=spec, owner=owner, reference=reference, features=feature_hooks(run))


def _checked(run: RunConfig):
    """Join the world and check the run as `msrl validate` does, before anything is written or started: the config
    (`validate`), then the files it names and its trackers (training/preflight.py: model files, tokenizer,
    directories, every data record and prompt length, the trackers rank 0 opens), on rank 0 with the same error on
    every rank. Returns (rank, world size, the run with the values left to the model resolved, rank 0's summary
    lines)."""
    from megatron_sparse_rl.validation import validate
    from megatron_sparse_rl.validation.resolve import resolve
    from megatron_sparse_rl.validation.summary import run_summary
    from megatron_sparse_rl.observability.logging import init_logging
    from megatron_sparse_rl.parallel.world import on_rank0
    from megatron_sparse_rl.training.preflight import check_files

    joined = not dist.is_initialized()
    rank, world = init_world(run.parallel)
    try:
        init_logging(rank, run.logging.level, verbose=run.logging.verbose, library_level=logging.ERROR)
        spec = validate(run, world)
        summary = run_summary(run, spec, world) if rank == 0 else []  # what the model resolves (max_model_len)
        run = resolve(run, spec)  # every rank's engine and records see the values left to the model filled in
        on_rank0(lambda: check_files(run, spec))
    except BaseException:
        # a refused run leaves no process group behind: its store and gloo threads alive at interpreter exit
        # once aborted the process ("terminate called without an active exception", exit -6 instead of 2)
        if joined:
            dist.destroy_process_group()
        raise
    _warn_truncated_support(run)
    return rank, world, run, summary


def _claim_run_dir(run: RunConfig):
    """Rank 0 decides whether this run starts fresh or continues in `logging.dir` (run/run_dir.py); every
    rank gets the same answer, or the same error, before anything expensive starts."""
    from megatron_sparse_rl.parallel.world import on_rank0
    from megatron_sparse_rl.run.run_dir import claim

    return on_rank0(lambda: claim(run))


def _colocated(run: RunConfig, model_dir: Path, spec, layout, groups):
    """This rank's engine as a colocated placement: a whole engine per rank, or (rollout.tensor_parallel_size
    t > 1) one engine over t consecutive ranks sampling for all of their data-parallel shares."""
    from megatron_sparse_rl.placement import placements as P

    engine = _engine(run, model_dir, spec)
    engine_tp, model_parallel = run.rollout.tensor_parallel_size, layout.tp * layout.pp * layout.cp
    weights = EngineWeights.of(run.rollout)
    if engine_tp == 1:
        return P.Colocated(engine, groups, model_parallel, weights=weights)
    shares = P.ColocatedSharedEngine.shares_of(groups.dp_rank, engine_tp)
    return P.ColocatedSharedEngine(engine, groups, model_parallel, shares, weights=weights)


def _pad_id(tokenizer) -> int:
    """The pad id the engine uses (its tokenizer is this one): pad, else EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _learners(run: RunConfig, adapter, spec, layout, groups, model_dir: Path, total_steps: int):
    """(learner, frozen reference or None), loaded from the HF model; the learner owns its routing replay
    state when the model is MoE and routing replay or statistics are on, and a DSA model's indexer state
    (routing.indexer_replay)."""
    from megatron_sparse_rl.learner.learner import Learner

    use_routing = spec.is_moe and run.routing.replay
    # The policy being optimised is the one that samples: logits / sampling temperature (1 for greedy).
    temperature = run.rollout.sampling.temperature or 1.0
    learner = Learner(adapter, spec, layout, groups, model_cfg=run.model, cfg=run.learner, total_steps=total_steps,
                      temperature=temperature, routing=run.routing if use_routing else None,
                      indexer_replay=run.routing.indexer_replay)
    learner.load_hf(model_dir)
    reference = None
    if run.algorithm.kl.coef > 0:  # KL to the initial policy needs its logprobs: a frozen copy of the model
        # (with model.lora a copy with adapters too, never stepped: B = 0 keeps it the base, and its base stays
        # frozen, so it holds no gradient buffers or optimizer state for the base)
        reference = Learner(adapter, spec, layout, groups, model_cfg=run.model, cfg=run.learner, total_steps=1,
                            temperature=temperature)
        reference.load_hf(model_dir)
    return learner, reference


def _engine(run: RunConfig, model_dir: Path, spec):
    """This rank's vLLM engine, with the extensions the run asks for; vLLM's CPU patches are applied first, and the
    one that keeps vLLM's start-up child out of reach of a stop signal to this process group."""
    from megatron_sparse_rl.patches import vllm_cpu, vllm_registry_session
    from megatron_sparse_rl.rollout import RolloutEngine

    if run.launch.rollout_world_size and torch.cuda.is_available():
        raise NotImplementedError("disaggregated placement runs its engines on CPU only so far (its weight-sync "
                                  "bridge is gloo over CPU buffers, and the path was never run on a GPU); set "
                                  "launch.rollout_ranks=0 and launch.rollout_nodes=0 for a colocated run")
    vllm_cpu.apply()
    vllm_registry_session.apply()  # a stop during start-up is the trainer's to handle (run/stops.py)
    # vLLM's cache is shared by the runs ($VLLM_CACHE_ROOT, else <tmp>/msrl_vllm_cache_<uid>): its model-registry
    # answers are keyed by the model file's hash and written atomically, and a run with a cache of its own paid the
    # registry's inspection child (a second Python importing vLLM, ~10 s on 2 CPU cores) at every start
    return RolloutEngine(model_dir, run.rollout, extensions=_engine_extensions(run, spec))


def _engine_extensions(run: RunConfig, spec) -> list:
    """Sparse KV (rollout.kv.policy), the sampling-mask record (rollout.record_sampling_mask), route capture
    (R3 or route recording on a MoE model: vLLM's own routed-experts output where it has one, else the router
    callback) and the DSA indexer capture (routing.indexer_replay = R3; GPU engines only, never run), in the order
    the engine calls them."""
    from megatron_sparse_rl.kv.engine_extension import sparse_kv_extensions
    from megatron_sparse_rl.rollout.indexer_capture import EngineIndexerCapture
    from megatron_sparse_rl.rollout.routes import EngineRouteCapture
    from megatron_sparse_rl.rollout.routes_vllm import VLLMRouteOutput
    from megatron_sparse_rl.rollout.sampling_mask import SamplingMaskCapture

    extensions = sparse_kv_extensions(run.rollout.kv)
    if run.rollout.record_sampling_mask:
        extensions.append(SamplingMaskCapture())
    if spec.is_moe and run.routing.capture:
        native = run.routing.vllm_routes(torch.cuda.is_available())
        extensions.append(VLLMRouteOutput() if native else EngineRouteCapture())
    if run.routing.indexer_replay == "R3":
        extensions.append(EngineIndexerCapture())
    return extensions


def open_metrics(ctx: RunContext, keep_records: int | None) -> None:
    """Rank 0's metrics sink with the trackers `logging.trackers` names, each given the run's resolved config and
    its id (a resumed run goes on logging to the same tracker run); on resume, records written after the
    checkpoint are dropped."""
    from megatron_sparse_rl.config.loader import to_dict
    from megatron_sparse_rl.observability.features import tensorboard_layout
    from megatron_sparse_rl.observability.metrics import MetricsWriter
    from megatron_sparse_rl.observability.trackers import open_trackers

    if ctx.is_main:
        cfg = ctx.run.logging
        ctx.writer = MetricsWriter(ctx.run_dir, tensorboard=cfg.tensorboard, keep_records=keep_records,
                                   layout=tensorboard_layout)
        ctx.writer.trackers = open_trackers(cfg, ctx.run_dir, ctx.owner.run_id, to_dict(ctx.run))
