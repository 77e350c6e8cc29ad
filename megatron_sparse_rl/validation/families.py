"""The model families' checks against the rollout engine in `validate` (validation/validate.py): multi-head latent
attention (vLLM's CPU MLA decode, sparse KV on the latent cache) and DeepSeek Sparse Attention (no CPU engine, no
sparse KV). `RolloutEngine` asks `mla_rollout_problems` too, before vLLM starts."""
from __future__ import annotations

from megatron_sparse_rl.config.rollout import RolloutConfig
from megatron_sparse_rl.config.schema import RunConfig


def mla_problems(run: RunConfig, spec, cuda: bool, *, from_tiny: bool) -> list[str]:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2) against the rollout engine: vLLM's CPU MLA decode runs
    one latent width in 16-token blocks, and sparse KV compacts the latent cache of single-rank engines only.
    `from_tiny`: the shapes come from model.tiny (the message names its fields)."""
    from megatron_sparse_rl.models.tiny_families import MLA_CPU_LATENT

    problems = []
    if not cuda and (spec.kv_lora_rank, spec.qk_rope_head_dim) != MLA_CPU_LATENT:
        names = ("model.tiny.kv_lora_rank + model.tiny.qk_rope_head_dim" if from_tiny
                 else "the model's kv_lora_rank + qk_rope_head_dim")
        lora, rope = MLA_CPU_LATENT
        problems.append(f"{names} = {spec.kv_lora_rank} + {spec.qk_rope_head_dim} = {spec.latent_width} (the MLA "
                        f"latent) is not supported by vLLM's CPU MLA decode (no CUDA here); allowed: kv_lora_rank "
                        f"{lora} + qk_rope_head_dim {rope} = {lora + rope}")
    dsa = dsa_rollout_problems(spec, run.rollout, cuda)
    return problems + dsa + mla_rollout_problems(run.rollout, spec.architecture, cuda)


def dsa_rollout_problems(spec, rollout: RolloutConfig, cuda: bool) -> list[str]:
    """A DeepSeek Sparse Attention model (models/dsa.py) has no rollout engine without CUDA: vLLM's CPU platform
    refuses sparse attention (`CpuPlatform.get_attn_backend_cls`: "Sparse Attention is not supported on CPU.").
    Sparse KV is refused on any device: the engine's compaction would drop latent rows and keep the indexer's keys,
    and the learner's keep-set masks reach DotProductAttention only, which a DSA layer does not have."""
    from megatron_sparse_rl.models import ADAPTERS
    from megatron_sparse_rl.models.dsa import DeepseekV32Adapter, DsaSpec

    if not isinstance(spec, DsaSpec):
        return []
    problems = []
    if rollout.kv.policy != "none":
        problems.append(f"rollout.kv.policy = {rollout.kv.policy!r}: sparse KV does not run on a DeepSeek Sparse "
                        f"Attention model ({spec.architecture}: its attention already reads index_topk = "
                        f"{spec.index_topk} tokens chosen by the indexer); set rollout.kv.policy = 'none'")
    if cuda:
        return problems
    dense = sorted(a for a, cls in ADAPTERS.items() if not issubclass(cls, DeepseekV32Adapter))
    problems.append(f"the model's architecture {spec.architecture} uses DeepSeek Sparse Attention (an indexer "
                    f"choosing index_topk = {spec.index_topk} tokens per query), which vLLM cannot serve on CPU (its "
                    "CPU platform refuses sparse attention) and this run needs a rollout engine (no CUDA here); "
                    f"allowed without CUDA: {', '.join(dense)}; a DSA model's learner and checkpoint conversion (msrl "
                    "convert) do run on CPU")
    return problems


def mla_rollout_problems(rollout: RolloutConfig, model: str, cuda: bool) -> list[str]:
    """The rollout engine of a multi-head latent attention model (`model` names it): sparse KV compacts the latent
    cache of single-rank engines only; vLLM's CPU MLA backend runs 16-token blocks. The one statement of these
    rules: `validate` and `RolloutEngine` (before vLLM starts) both ask it."""
    kv, problems = rollout.kv, []
    if kv.policy != "none" and rollout.tensor_parallel_size != 1:
        problems.append(f"rollout.kv.policy = {kv.policy!r} with rollout.tensor_parallel_size = "
                        f"{rollout.tensor_parallel_size}: sparse KV on the MLA latent cache runs on single-rank "
                        f"engines ({model} uses multi-head latent attention: every rank holds the shared latent rows "
                        "and would score them with its own heads only); set rollout.tensor_parallel_size = 1 or "
                        "rollout.kv.policy = 'none'")
    if not cuda and kv.block_size not in (None, 16):
        problems.append(f"rollout.kv.block_size = {kv.block_size}: vLLM's CPU MLA backend runs 16-token blocks only "
                        "(no CUDA here); leave it null or set 16")
    return problems
