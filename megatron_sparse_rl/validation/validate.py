"""Cross-component checks of a `RunConfig`, run before anything expensive starts.

Each component's dataclass checks its own fields in `__post_init__`; `validate` checks what spans
components: parallel degrees against the world size and the model's shapes, the model against vLLM's
CPU attention (MLA models: the latent width, no sparse KV; DSA models: no CPU engine) and against what its adapter
can build, the launch shape against the world size, rollout sampling against the algorithm, multi-turn
episodes (env.kind) against the engine features that follow turns (`_env_problems`: episodes run colocated,
disaggregated and with asynchronous RL; vLLM's own routed-experts output is refused).

The layout's checks are in validation/layout.py, the model families' against the engine in validation/families.py.

    spec = validate(run, world_size=4)   # ModelSpec (or None); ConfigError listing every problem
    run = resolve(run, spec)             # validation/resolve.py: the values left to the model filled in

The model's shapes come from `config.json` at `model.path` when it exists, otherwise from `model.tiny`
(the config dict `models/tiny_config.py` derives, the one the tiny builder would write, without building weights).
models/ and torch are imported inside functions: importing the config package stays free of torch.
"""
from __future__ import annotations

from pathlib import Path

from megatron_sparse_rl.config.loader import ConfigError
from megatron_sparse_rl.lora.targets import config_problems as lora_config_problems
from megatron_sparse_rl.validation.families import mla_problems
from megatron_sparse_rl.validation.layout import context_parallel_problems, layout_problems
from megatron_sparse_rl.validation.resolve import max_model_len, max_model_len_origin
from megatron_sparse_rl.config.rollout import RolloutConfig
from megatron_sparse_rl.config.schema import RunConfig
from megatron_sparse_rl.config.trainer import SFT_KV_POLICIES


def _has_config(run: RunConfig) -> bool:
    return bool(run.model.path) and (Path(run.model.path) / "config.json").is_file()


def model_spec(run: RunConfig):
    """ModelSpec of the run's model: from `model.path`/config.json if present, else from `model.tiny`.

    Returns None when neither is available here (e.g. a cluster path validated on a laptop).
    Raises ConfigError when both `model.path` and `model.tiny` are unset or config.json is unusable.
    """
    from megatron_sparse_rl.models import get_adapter
    from megatron_sparse_rl.models.spec import read_hf_config
    from megatron_sparse_rl.models.tiny_config import tiny_hf_config

    model = run.model
    if not model.path and model.tiny is None:
        raise ConfigError("model.path is empty and model.tiny is unset: set model.path to a Hugging Face model "
                          "directory, or set model.tiny (e.g. `model: {tiny: {}}`) to build a tiny random model")
    if _has_config(run):
        where = f"model.path={model.path!r}"
    elif model.tiny is not None:
        where = "model.tiny"
    else:
        return None
    try:
        source = read_hf_config(model.path) if _has_config(run) else tiny_hf_config(model.tiny)
        return get_adapter(source).spec_from_hf(source)
    except (ValueError, NotImplementedError, KeyError) as e:
        raise ConfigError(f"{where}: cannot read the model architecture: {e}") from None


def _from_tiny(run: RunConfig) -> bool:
    """Whether the model's shapes come from `model.tiny` (no config.json at `model.path`)."""
    return run.model.tiny is not None and not _has_config(run)


def _model_problems(run: RunConfig, spec, cuda: bool) -> list[str]:
    from megatron_sparse_rl.models.deepseek import DeepseekSpec
    from megatron_sparse_rl.models.tiny import CPU_ATTENTION_HEAD_DIMS

    if spec is None:
        return []
    problems = []
    if isinstance(spec, DeepseekSpec):  # MLA: the cache is one latent row per token, not heads x head_dim
        problems += mla_problems(run, spec, cuda, from_tiny=_from_tiny(run))
    elif not cuda and spec.head_dim not in CPU_ATTENTION_HEAD_DIMS:
        where = "model.tiny.head_dim" if _from_tiny(run) else "the model's head_dim"
        problems.append(f"{where} = {spec.head_dim} is not supported by vLLM's CPU attention (no CUDA here); "
                        f"allowed: {', '.join(map(str, CPU_ATTENTION_HEAD_DIMS))}")
    if run.rollout.max_model_len is not None and run.rollout.max_model_len > spec.max_position_embeddings:
        problems.append(f"rollout.max_model_len = {run.rollout.max_model_len} exceeds the model's "
                        f"max_position_embeddings ({spec.max_position_embeddings}); leave it unset (null) to use "
                        "the model's")
    problems += _resolved_len_problems(run.rollout, spec)
    rollout_tp = run.rollout.tensor_parallel_size
    if spec.num_kv_heads % rollout_tp or spec.num_heads % rollout_tp:
        problems.append(f"rollout.tensor_parallel_size = {rollout_tp} must divide the attention heads "
                        f"({spec.num_heads}) and KV heads ({spec.num_kv_heads})")
    return problems + _learner_problems(run, spec)


def _resolved_len_problems(rollout: RolloutConfig, spec) -> list[str]:
    """The dataclass's own `sampling.max_tokens < max_model_len` check, on a max_model_len resolved from the model
    (a value set in the config was checked when the config loaded)."""
    origin = max_model_len_origin(rollout, spec)
    resolved = max_model_len(rollout, spec)
    if origin and rollout.sampling.max_tokens >= resolved:
        fix = ("lower rollout.sampling.max_tokens" if resolved == spec.max_position_embeddings
               else "set rollout.max_model_len, lower rollout.sampling.max_tokens, or raise rollout.kv_cache_gb")
        return [f"rollout.sampling.max_tokens must be < rollout.max_model_len (got {rollout.sampling.max_tokens} >= "
                f"{resolved}; rollout.max_model_len unset: {origin}): {fix}"]
    return []


def _learner_problems(run: RunConfig, spec) -> list[str]:
    """What the model's adapter refuses when it makes Megatron's config for this layout (e.g. DeepSeek-V3's
    group-limited routing with topk // topk_group != 2): found here rather than when the learner starts."""
    import torch

    from megatron_sparse_rl.models import adapter_for

    p = run.parallel
    try:
        adapter_for(spec).config_kwargs(spec, tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp,
                                        sequence_parallel=p.sequence_parallel, dtype=getattr(torch, run.model.dtype),
                                        recompute=run.model.recompute_activations,
                                        aux_loss_coeff=run.model.moe_aux_loss_coeff)
    except (ValueError, NotImplementedError) as e:
        where = "model.tiny" if _from_tiny(run) else f"model.path={run.model.path!r}"
        return [f"{where}: the learner cannot build this {spec.architecture}: {e}"]
    return []


def _rollout_algorithm_problems(run: RunConfig, world_size: int, spec) -> list[str]:
    sampling, algo = run.rollout.sampling, run.algorithm
    problems = []
    # Both estimators (grpo, rloo) compare a sample with the other samples of its prompt's group.
    if sampling.n < 2:
        problems.append(f"rollout.sampling.n must be >= 2 for algorithm.advantage.estimator="
                        f"{algo.advantage.estimator!r}, which computes advantages within a group (got {sampling.n})")
    elif sampling.temperature == 0:
        problems.append(f"rollout.sampling.temperature = 0 (greedy) makes the n={sampling.n} samples of a group "
                        "identical, so every group advantage is 0; use temperature > 0")
    if algo.keep_sampling_mask and not run.rollout.record_sampling_mask:
        problems.append("algorithm.keep_sampling_mask = true needs rollout.record_sampling_mask = true "
                        "(the kept token ids must be recorded at sampling time)")
    kv, context = run.rollout.kv, max_model_len(run.rollout, spec)  # None: unset, and the model unknown here
    if kv.policy != "none" and context is not None and kv.budget >= context:
        origin = max_model_len_origin(run.rollout, spec)
        problems.append(f"rollout.kv.budget = {kv.budget} must be < rollout.max_model_len = {context}"
                        + (f" (unset: {origin})" if origin else "")
                        + f", or rollout.kv.policy={kv.policy!r} never compresses")
    rollout_tp, rollout_ranks = run.rollout.tensor_parallel_size, run.launch.rollout_world_size
    if rollout_ranks and (rollout_ranks % rollout_tp or (world_size - rollout_ranks) % rollout_tp):
        problems.append(f"rollout.tensor_parallel_size = {rollout_tp} must divide both the rollout ranks "
                        f"({rollout_ranks}) and the learner ranks ({world_size - rollout_ranks}): vLLM cuts the "
                        "whole world into engines of that many consecutive ranks")
    elif not rollout_ranks and world_size % rollout_tp:
        problems.append(f"rollout.tensor_parallel_size = {rollout_tp} must divide the world size {world_size} "
                        "(colocated, each engine spans that many consecutive ranks)")
    return problems


def _indexer_replay_problems(run: RunConfig, spec, cuda: bool) -> list[str]:
    """routing.indexer_replay needs a DeepSeek Sparse Attention model; R3 also needs the GPU engine that captures the
    indices (rollout/indexer_capture.py: vLLM serves DSA on GPU only) in eager mode without prefix caching."""
    from megatron_sparse_rl.models.dsa import DsaSpec

    mode = run.routing.indexer_replay
    if mode == "none" or spec is None:
        return []
    if not isinstance(spec, DsaSpec):
        return [f"routing.indexer_replay = {mode!r} replays a DeepSeek Sparse Attention indexer's top-k, but "
                f"{spec.architecture} has no indexer (DSA models: DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM); set "
                "routing.indexer_replay = 'none'"]
    if mode != "R3":
        return []
    problems = []
    if not cuda:
        problems.append("routing.indexer_replay = 'R3' replays the indices the rollout engine's indexers chose, which "
                        "only the GPU engine records (vLLM serves DeepSeek Sparse Attention on GPU only; no CUDA "
                        "here); use 'R2' (the learner's old forward) or 'none'")
    if not run.rollout.enforce_eager:
        problems.append("routing.indexer_replay = 'R3' captures the engine's indices with forward hooks, which a CUDA "
                        "graph does not replay: set rollout.enforce_eager = true")
    if run.rollout.prefix_caching:
        problems.append("routing.indexer_replay = 'R3' needs every position run by the engine (a cached prefix is not "
                        "indexed again): set rollout.prefix_caching = false")
    return problems


def _indexer_loss_problems(run: RunConfig, spec) -> list[str]:
    """model.dsa_indexer_loss_coeff > 0 needs a DeepSeek Sparse Attention model (learner/dsa_indexer_loss.py)."""
    from megatron_sparse_rl.models.dsa import indexer_loss_problem

    problem = None if spec is None else indexer_loss_problem(spec, run.model.dsa_indexer_loss_coeff)
    return [problem] if problem else []


def _lora_problems(run: RunConfig, spec) -> list[str]:
    """model.lora: targets the model lacks or the learner cannot adapt (routed experts), layouts the adapters do
    not run on (lora/targets.py: tp, pp, cp > 1), and the DSA indexer loss, which trains the indexer that LoRA
    freezes with the base."""
    lora, par = run.model.lora, run.parallel
    if lora is None:
        return []
    problems = lora_config_problems(lora, spec, tp=par.tp, pp=par.pp, cp=par.cp)
    if run.model.dsa_indexer_loss_coeff > 0:
        problems.append(f"model.dsa_indexer_loss_coeff = {run.model.dsa_indexer_loss_coeff} with model.lora: the "
                        "indexer loss trains the DSA indexer, which LoRA freezes with the rest of the base; set "
                        "model.dsa_indexer_loss_coeff = 0 or leave model.lora unset")
    return problems


# corrections of mu != pi_old that compare the two: with pi_old = mu (algorithm.old_logprobs = engine) rho = 1
_RHO_CORRECTIONS = ("tis", "mis", "geo_rs", "veto", "icepop", "sparse_rl", "batch_skip")


def _old_logprobs_problems(run: RunConfig) -> list[str]:
    """What the pi_old source (algorithm.old_logprobs) cannot be combined with."""
    algo = run.algorithm
    source = algo.old_logprobs
    if source == "learner":
        return []
    problems = []
    if run.routing.mode == "R2":
        problems.append(f"algorithm.old_logprobs = {source!r} skips the learner's old-policy forward, which is where "
                        "routing.mode = 'R2' records the routes it replays; use R3 (the engine's routes) or "
                        "algorithm.old_logprobs = 'learner'")
    if run.routing.indexer_replay == "R2":
        problems.append(f"algorithm.old_logprobs = {source!r} skips the learner's old-policy forward, which is where "
                        "routing.indexer_replay = 'R2' records the indexer top-k it replays; use "
                        "algorithm.old_logprobs = 'learner' or routing.indexer_replay = 'none'")
    if run.routing.indexer_replay == "R3":
        problems.append(f"algorithm.old_logprobs = {source!r} skips the learner's old-policy forward, which is where "
                        "routing.indexer_replay = 'R3' replays the engine's indexer top-k and compares the learner's "
                        "own; use algorithm.old_logprobs = 'learner'")
    if run.routing.attribute_mismatch:
        problems.append(f"routing.attribute_mismatch compares the learner's pi_old with and without the engine's "
                        f"routes; algorithm.old_logprobs = {source!r} takes pi_old from the engine (use 'learner' "
                        "or set routing.attribute_mismatch = false)")
    if source == "engine":
        enabled = [name for name in _RHO_CORRECTIONS if getattr(algo.corrections, name).enabled]
        if enabled:
            problems.append(f"algorithm.old_logprobs = 'engine' makes pi_old the sampler's mu, so rho = pi_old / mu "
                            f"= 1 and algorithm.corrections.{', '.join(enabled)} would never act; disable them or "
                            "use old_logprobs 'learner' or 'engine_mean'")
        return problems
    temperature = run.rollout.sampling.temperature
    if temperature != 1.0:
        problems.append(f"algorithm.old_logprobs = 'engine_mean' re-scores with vLLM's prompt logprobs, which are "
                        f"at temperature 1; rollout.sampling.temperature must be 1.0 (got {temperature})")
    if algo.keep_sampling_mask:
        problems.append("algorithm.old_logprobs = 'engine_mean' re-scores over the full vocabulary; it cannot be "
                        "combined with algorithm.keep_sampling_mask = true (pi_old over the sampler's support)")
    return problems


def _async_problems(run: RunConfig) -> list[str]:
    """What asynchronous RL (trainer.max_staleness k > 0) needs: rollout ranks, whole engines, no dense recompute of a
    compressed cache."""
    cfg = run.trainer
    if cfg.max_staleness == 0:
        return []
    problems = []
    if not run.launch.rollout_world_size:
        problems.append(f"trainer.max_staleness = {cfg.max_staleness} samples on the rollout ranks while the learner "
                        "ranks train: it needs the disaggregated placement (launch.rollout_ranks or "
                        "launch.rollout_nodes > 0); colocated, sampling and training share each rank, so use max_staleness = 0")
    if run.rollout.tensor_parallel_size != 1:
        problems.append(f"trainer.max_staleness = {cfg.max_staleness} needs rollout.tensor_parallel_size = 1 (got "
                        f"{run.rollout.tensor_parallel_size}): every rank of an engine would have to take the new "
                        "weights at the same engine step")
    if cfg.in_flight_kv == "recompute" and run.rollout.kv.policy != "none":
        problems.append(f"trainer.in_flight_kv = 'recompute' re-prefills the running requests densely, which undoes "
                        f"the compressed cache of rollout.kv.policy = {run.rollout.kv.policy!r}; use 'keep'")
    return problems


CPU_DEFAULT_BLOCK, GPU_DEFAULT_BLOCK = 128, 16
"""vLLM's default KV block size (tokens) on CPU and on GPU, when rollout.kv.block_size is unset."""


def _kv_pool_problems(run: RunConfig, spec, cuda: bool) -> list[str]:
    """A fixed sparse-KV pool (rollout.kv.pool_blocks) must hold one sequence at the lowest budget the run uses
    (rollout.kv.budget_schedule.min_budget when the schedule is on, else rollout.kv.budget): its stored KV peaks at
    budget + interval tokens (compaction then cuts it back; capped by max_model_len), in whole blocks, plus the one
    block vLLM's pool holds back. The schedule's budgets: colocated, synchronous runs only."""
    kv = run.rollout.kv
    if kv.policy == "none":
        return []
    problems = []
    sched = kv.budget_schedule
    if sched.enabled and run.launch.rollout_world_size:
        problems.append("rollout.kv.budget_schedule.enabled = true needs the colocated placement (the budget is set on "
                        "the engines of this process); the run has rollout ranks (launch.rollout_ranks or "
                        "launch.rollout_nodes): turn the schedule off or run colocated")
    if sched.enabled and run.trainer.max_staleness:
        problems.append(f"rollout.kv.budget_schedule.enabled = true needs trainer.max_staleness = 0 (got "
                        f"{run.trainer.max_staleness}): a batch sampled ahead would not use the budget its previous "
                        "step's tail asks for")
    if kv.pool_blocks is None:
        return problems
    lowest = sched.min_budget if sched.enabled else kv.budget
    block = kv.block_size or (GPU_DEFAULT_BLOCK if cuda else CPU_DEFAULT_BLOCK)
    context = max_model_len(run.rollout, spec)
    peak = lowest + kv.interval if context is None else min(lowest + kv.interval, context)
    need = -(-peak // block) + 1
    if kv.pool_blocks < need:
        field = "rollout.kv.budget_schedule.min_budget" if sched.enabled else "rollout.kv.budget"
        problems.append(f"rollout.kv.pool_blocks = {kv.pool_blocks} is too small for one sequence at the lowest budget "
                        f"({field} = {lowest}): its KV peaks at budget + interval = {lowest} + {kv.interval} tokens"
                        + (f" (capped by max_model_len {context})" if context is not None and peak < lowest + kv.interval
                           else "")
                        + f", {need - 1} blocks of {block} tokens, plus the block vLLM's pool holds back: "
                        f"set rollout.kv.pool_blocks >= {need}")
    return problems


def _env_problems(run: RunConfig, cuda: bool) -> list[str]:
    """What multi-turn episodes (env.kind) need: chat-templated data, and none of the engine
    features that do not follow an episode across turns yet (docs/episodes.md). R3 / route capture does, through
    the router callback (routing.engine_routes hook; auto without CUDA), not vLLM's own routed-experts output; sparse
    KV (rollout.kv.policy) does, its keep record merged turn by turn (prefix caching with it is refused in
    config/rollout.py); engine_mean re-scores each finished episode as one sequence. The disaggregated placement
    (launch.rollout_ranks / rollout_nodes) runs the episodes and their environments on the rollout ranks, and
    asynchronous RL (trainer.max_staleness k >= 1, checked by `_async_problems`) loads weights between the engine
    steps of a turn, every token keeping the version that sampled it (docs/async.md, "Multi-turn episodes")."""
    env = run.env
    if not env.multi_turn:
        return []
    problems = []  # tool names against the registry: training/preflight.py tool_problems
    if run.data.template != "chat":
        problems.append(f"data.template = {run.data.template!r} with env.kind = {env.kind!r}: an episode's turns are "
                        "chat-template messages (tool results come back as tool messages); set data.template: chat")
    unsupported = {f"routing.engine_routes = {run.routing.engine_routes!r} (vLLM's own routed-experts output; "
                   "set routing.engine_routes: hook)": run.routing.capture and run.routing.vllm_routes(cuda),
                   "routing.indexer_replay = 'R3' (the engine's DSA indexer capture; R2 replays the learner's own "
                   "record and works with episodes)": run.routing.indexer_replay == "R3"}
    problems += [f"{name} cannot run with env.kind = {env.kind!r} yet: it does not follow an episode across turns "
                 "(docs/episodes.md); turn it off" for name, on in unsupported.items() if on]
    if run.rollout.max_model_len is not None and run.data.max_prompt_tokens + env.max_total_tokens > \
            run.rollout.max_model_len:
        problems.append(f"data.max_prompt_tokens + env.max_total_tokens = {run.data.max_prompt_tokens} + "
                        f"{env.max_total_tokens} must be <= rollout.max_model_len = {run.rollout.max_model_len}: "
                        "an episode must fit the engine")
    return problems


def _sft_kv_problems(run: RunConfig, spec) -> list[str]:
    """Sparsity-aware SFT (trainer.sft.kv_keep, training/sft_kv.py) simulates the run's own sparse engine on one
    learner rank that holds every layer and head."""
    from megatron_sparse_rl.models.deepseek import DeepseekSpec

    if not run.trainer.sft.kv_keep.enabled:
        return []
    field, policy, p = "trainer.sft.kv_keep.enabled", run.rollout.kv.policy, run.parallel
    if policy == "none":
        return [f"{field} trains under the keep sets of the run's sparse KV cache, but rollout.kv.policy is 'none' "
                "(nothing to follow): set rollout.kv.policy or turn it off"]
    problems = []
    if policy not in SFT_KV_POLICIES:
        problems.append(f"{field} simulates rollout.kv.policy in {list(SFT_KV_POLICIES)} (got {policy!r}: H2O's "
                        "attention accumulated over every query is not replayed)")
    if p.tp > 1 or p.cp > 1 or p.pp > 1:
        problems.append(f"{field} captures every layer's queries and keys on one learner rank: it needs "
                        f"parallel.tp = cp = pp = 1 (got tp {p.tp}, cp {p.cp}, pp {p.pp})")
    if isinstance(spec, DeepseekSpec):
        problems.append(f"{field} is not implemented for multi-head latent attention (the engine keeps latent rows; "
                        "kv/latent.py)")
    if run.env.multi_turn:
        problems.append(f"{field} follows single-turn rows; env.kind = {run.env.kind!r} (episodes) is not supported")
    return problems


def cpu_engine_runs_bf16() -> bool:
    """Whether vLLM's CPU platform computes in bfloat16 on this machine (its `supported_dtypes`)."""
    import torch
    from vllm.platforms import current_platform

    return torch.bfloat16 in current_platform.supported_dtypes


def _precision_problems(run: RunConfig, spec, cuda: bool) -> list[str]:
    """rollout.dtype bfloat16 on a CPU vLLM cannot run it in. (FP8 rollouts' shapes are the model's: checked with
    the model files, training/preflight.py `fp8_rollout_problems`.)"""
    problems = []
    rollout = run.rollout
    if rollout.dtype == "bfloat16" and not cuda and not cpu_engine_runs_bf16():
        problems.append("rollout.dtype = 'bfloat16': vLLM's CPU engine cannot compute in bfloat16 on this CPU (no "
                        "bf16 support); use rollout.dtype = 'float32' (with rollout.quantization = 'fp8' for "
                        "low-precision weights) or a GPU")
    return problems


def validate(run: RunConfig, world_size: int | None = None, *, cuda: bool | None = None):
    """Check `run` across components for `world_size` ranks; return the model's ModelSpec (None if unknown).

    Args:
        run: the loaded run config (each component already checked its own fields).
        world_size: total ranks; None means `launch.nodes * launch.nproc_per_node`. Given explicitly it
            must equal that product when the config sets a launch shape (a product above 1); with `launch.*` at its
            defaults (1 x 1, colocated) any world size is checked, as `msrl validate --world-size N` or a bare
            torchrun gives it. In a disaggregated run (`launch.rollout_ranks` or `launch.rollout_nodes`) the
            parallel degrees are checked against the learner ranks only.
        cuda: whether the run will have CUDA (None: `torch.cuda.is_available()`). Without CUDA the model's
            head size must be one vLLM's CPU attention supports; an MLA model's latent (kv_lora_rank +
            qk_rope_head_dim) must be the one vLLM's CPU MLA decode runs (512 + 64).
    Raises:
        ConfigError: one message listing every problem, each naming the fields and what is allowed.
    """
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    launch_world = run.launch.nodes * run.launch.nproc_per_node
    problems = []
    if world_size is None:
        world_size = launch_world
    elif world_size != launch_world and launch_world > 1:  # 1 x 1: launch.* left at its defaults, no shape to match
        problems.append(f"world size {world_size} != launch.nodes * launch.nproc_per_node = {run.launch.nodes} * "
                        f"{run.launch.nproc_per_node} = {launch_world}; make them equal")
    spec = model_spec(run)
    problems += layout_problems(run, world_size, spec, cuda)
    problems += context_parallel_problems(run, world_size, spec, cuda)
    problems += _model_problems(run, spec, cuda)
    problems += _rollout_algorithm_problems(run, world_size, spec)
    problems += _old_logprobs_problems(run)
    problems += _indexer_replay_problems(run, spec, cuda)
    problems += _indexer_loss_problems(run, spec)
    problems += _lora_problems(run, spec)
    problems += _async_problems(run)
    problems += _kv_pool_problems(run, spec, cuda)
    problems += _env_problems(run, cuda)
    problems += _precision_problems(run, spec, cuda)
    problems += _sft_kv_problems(run, spec)
    if run.routing.engine_routes == "vllm" and not cuda:
        problems.append("routing.engine_routes = 'vllm' needs CUDA (vLLM returns routed experts from its GPU model "
                        "runner only); use 'hook' or 'auto' (the router callback) without CUDA")
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return spec
