"""Cross-component checks of a `RunConfig`, run before anything expensive starts.

Each component's dataclass checks its own fields in `__post_init__`; `validate` checks what spans
components: parallel degrees against the world size and the model's shapes, the model against vLLM's
CPU attention, the launch shape against the world size, rollout sampling against the algorithm.

    spec = validate(run, world_size=4)   # ModelSpec (or None); ConfigError listing every problem

The model's shapes come from `config.json` at `model.path` when it exists, otherwise from `model.tiny`
(the same config dict `models/tiny.py` would write, derived here without building any weights).
Heavy modules (torch, models, parallel) are imported inside functions: importing the config package
stays cheap and cannot form an import cycle with `parallel.layout`, which imports the schema.
"""
from __future__ import annotations

from pathlib import Path

from megatron_sparse_rl.config.loader import ConfigError
from megatron_sparse_rl.config.schema import RunConfig, TinyModelConfig


def tiny_hf_config(tiny: TinyModelConfig) -> dict:
    """The Hugging Face config dict `build_tiny_hf_model(**tiny)` would write (no weights, no transformers):
    models/tiny.py's `hf_config_kwargs` plus the keys transformers fills in with their defaults.

    `tests/unit/test_config_validate.py` checks the resulting ModelSpec against a model really built by
    `models/tiny.py`.
    """
    from megatron_sparse_rl.models.tiny import hf_config_kwargs

    family, kwargs = hf_config_kwargs(tiny.arch, **tiny_fields(tiny, seed=False))
    return {"architectures": ["Qwen3MoeForCausalLM" if family == "qwen3_moe" else "Qwen3ForCausalLM"],
            "model_type": family, "hidden_act": "silu", "attention_bias": False,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, **kwargs}


def tiny_fields(tiny: TinyModelConfig, *, seed: bool = True) -> dict:
    """`model.tiny` as the keyword arguments of `build_tiny_hf_model` (less `arch` and, without `seed`, the seed)."""
    names = ("hidden", "layers", "heads", "kv_heads", "head_dim", "experts", "topk", "moe_ffn", "ffn")
    return {n: getattr(tiny, n) for n in (*names, *(("seed",) if seed else ()))}


def _has_config(run: RunConfig) -> bool:
    return bool(run.model.path) and (Path(run.model.path) / "config.json").is_file()


def model_spec(run: RunConfig):
    """ModelSpec of the run's model: from `model.path`/config.json if present, else from `model.tiny`.

    Returns None when neither is available here (e.g. a cluster path validated on a laptop).
    Raises ConfigError when both `model.path` and `model.tiny` are unset or config.json is unusable.
    """
    from megatron_sparse_rl.models import get_adapter
    from megatron_sparse_rl.models.spec import read_hf_config

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


def _layout_problems(run: RunConfig, world_size: int, spec, cuda: bool) -> list[str]:
    """Problems of the parallel layout over the LEARNER ranks (all of `world_size` when colocated)."""
    from megatron_sparse_rl.parallel.layout import ParallelLayout

    rollout = run.launch.rollout_world_size
    learners = world_size - rollout
    if learners < 1:
        return [f"a disaggregated run needs at least one learner rank: world size {world_size} - "
                f"{rollout} rollout ranks (launch.rollout_ranks / launch.rollout_nodes) = {learners}"]
    try:
        layout = ParallelLayout.from_config(run.parallel, learners, rollout_ranks=rollout, cuda=cuda)
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
    return problems


def _model_problems(run: RunConfig, spec, cuda: bool) -> list[str]:
    from megatron_sparse_rl.models.tiny import CPU_ATTENTION_HEAD_DIMS

    if spec is None:
        return []
    problems = []
    where = "model.tiny.head_dim" if run.model.tiny is not None and not _has_config(run) else "the model's head_dim"
    if not cuda and spec.head_dim not in CPU_ATTENTION_HEAD_DIMS:
        problems.append(f"{where} = {spec.head_dim} is not supported by vLLM's CPU attention (no CUDA here); "
                        f"allowed: {', '.join(map(str, CPU_ATTENTION_HEAD_DIMS))}")
    if run.rollout.max_model_len > spec.max_position_embeddings:
        problems.append(f"rollout.max_model_len = {run.rollout.max_model_len} exceeds the model's "
                        f"max_position_embeddings ({spec.max_position_embeddings})")
    rollout_tp = run.rollout.tensor_parallel_size
    if spec.num_kv_heads % rollout_tp or spec.num_heads % rollout_tp:
        problems.append(f"rollout.tensor_parallel_size = {rollout_tp} must divide the attention heads "
                        f"({spec.num_heads}) and KV heads ({spec.num_kv_heads})")
    return problems


def _rollout_algorithm_problems(run: RunConfig, world_size: int) -> list[str]:
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
    kv = run.rollout.kv
    if kv.policy != "none" and kv.budget >= run.rollout.max_model_len:
        problems.append(f"rollout.kv.budget = {kv.budget} must be < rollout.max_model_len = "
                        f"{run.rollout.max_model_len}, or rollout.kv.policy={kv.policy!r} never compresses")
    rollout_tp, rollout_ranks = run.rollout.tensor_parallel_size, run.launch.rollout_world_size
    if rollout_ranks and (rollout_ranks % rollout_tp or (world_size - rollout_ranks) % rollout_tp):
        problems.append(f"rollout.tensor_parallel_size = {rollout_tp} must divide both the rollout ranks "
                        f"({rollout_ranks}) and the learner ranks ({world_size - rollout_ranks}): vLLM cuts the "
                        "whole world into engines of that many consecutive ranks")
    elif not rollout_ranks and world_size % rollout_tp:
        problems.append(f"rollout.tensor_parallel_size = {rollout_tp} must divide the world size {world_size} "
                        "(colocated, each engine spans that many consecutive ranks)")
    return problems


def validate(run: RunConfig, world_size: int | None = None, *, cuda: bool | None = None):
    """Check `run` across components for `world_size` ranks; return the model's ModelSpec (None if unknown).

    Args:
        run: the loaded run config (each component already checked its own fields).
        world_size: total ranks; None means `launch.nodes * launch.nproc_per_node`. Given explicitly it
            must equal that product. In a disaggregated run (`launch.rollout_ranks` or
            `launch.rollout_nodes`) the parallel degrees are checked against the learner ranks only.
        cuda: whether the run will have CUDA (None: `torch.cuda.is_available()`). Without CUDA the model's
            head size must be one vLLM's CPU attention supports.
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
    elif world_size != launch_world:
        problems.append(f"world size {world_size} != launch.nodes * launch.nproc_per_node = {run.launch.nodes} * "
                        f"{run.launch.nproc_per_node} = {launch_world}; make them equal")
    spec = model_spec(run)
    problems += _layout_problems(run, world_size, spec, cuda)
    problems += _model_problems(run, spec, cuda)
    problems += _rollout_algorithm_problems(run, world_size)
    if run.routing.engine_routes == "vllm" and not cuda:
        problems.append("routing.engine_routes = 'vllm' needs CUDA (vLLM returns routed experts from its GPU model "
                        "runner only); use 'hook' or 'auto' (the router callback) without CUDA")
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return spec
