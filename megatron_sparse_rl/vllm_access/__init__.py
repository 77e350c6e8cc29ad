"""The one package that reaches vLLM 0.32.0's private engine internals, and the check that they still exist
(this module; the version, features and failure in base.py, the accessors of a running engine in runtime.py,
the layers' and the scheduler messages' in layers.py, all re-exported here).

What the project uses beyond vLLM's public API (`LLM.generate`, `collective_rpc`, the outputs) goes through a
function here: the engine core and scheduler behind an `LLM`, the model runner and its per-step batch
(`StepContext`), request ids, the `SchedulerOutput` rider, the KV coordinator class swap, the runner's block
tables and attention layers (`RunnerKV`), the sampler, the MoE routers, the DSA indexers' output, whether the
engine runs multi-head latent attention (`uses_mla`), and the methods the CPU patches wrap (patches/vllm_cpu_*.py)
or replace (patches/vllm_registry_session.py).
The sparse-KV scheduler subclasses vLLM's `Scheduler` (its public `scheduler_cls` option) and uses what it
inherits: listed here too.

`NEEDS` holds every class, attribute and method (with its leading parameter names) relied on, per feature.
`check(llm, features=...)` verifies them, and with an engine its live engine core, scheduler and model runner;
a `VLLMInternalsError` names the installed vLLM version, the missing or changed piece and the feature. It runs
at `RolloutEngine` start, in the sparse-KV plugin entry point of every vLLM process (kv/vllm_hooks.py)
and when a capture attaches (`check(features=("sparse_kv",))` needs no engine). An attribute counts as present
when the class or a base defines or annotates it, or one of their methods assigns `self.<name>`.
"""
from __future__ import annotations

import dis
import functools
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from megatron_sparse_rl.vllm_access.base import (  # noqa: F401
    FEATURES, RIDER, RUNNER, STATE, VLLM_VERSION, VLLMInternalsError, fail as _fail, resolve as _resolve,
)
# the accessors of a running engine (runtime.py) and of the layers and scheduler messages (layers.py)
from megatron_sparse_rl.vllm_access.runtime import (  # noqa: F401
    scheduler, has_in_process_scheduler, shutdown, request_key, output_token_counts, model_runner,
    model_runner_class, model, uses_mla, reload_weights, runner_state, set_runner_state, tensor_parallel_group,
    StepContext, on_model_forward, step_context, sampler, wrap_sample, unwrap_sample, block_pool, pool_usage,
    wrap_schedule, unwrap_schedule, num_running, num_waiting, require_version, is_cpu_platform,
)
from megatron_sparse_rl.vllm_access.layers import (  # noqa: F401
    MoELayer, moe_layers, set_route_callback, DsaIndexer, dsa_indexers, on_indexer_output, RunnerKV, layer_kv,
    write_kv, is_latent_layer, LatentDims, latent_dims, write_latent,
    on_latent_query, on_attention_query, set_rider, rider, step_requests,
    preempted_requests, kv_coordinator, swap_coordinator,
)


@dataclass(frozen=True)
class Need:
    """One piece of vLLM relied on. kind: "attribute" (defined, annotated or assigned by the class), "method"
    (callable; `params` are its leading parameter names) or "rider" (instances take an extra attribute `name`)."""

    feature: str
    owner: str  # "module:Class", or "module" for a module-level function
    name: str
    kind: str = "attribute"
    params: tuple[str, ...] = ()


# One owner per line: feature, owner, then its attributes, methods `name(leading,parameters)` and riders <name>;
# an indented line continues the owner above.
_TABLE = f"""
engine vllm.entrypoints.llm:LLM llm_engine
engine vllm.v1.engine.llm_engine:LLMEngine engine_core
engine vllm.v1.engine.core_client:InprocClient engine_core shutdown
engine vllm.v1.engine.core:EngineCore scheduler
engine vllm.v1.worker.gpu_worker:Worker model_runner reload_weights
engine {RUNNER} get_model(self) reload_weights(self,weights_iterator,weights_path,is_checkpoint_format)
engine vllm.v1.core.sched.scheduler:Scheduler schedule running waiting kv_cache_manager
engine vllm.v1.core.kv_cache_manager:KVCacheManager block_pool
engine vllm.v1.core.block_pool:BlockPool num_gpu_blocks get_num_free_blocks
engine vllm.v1.core.sched.output:SchedulerOutput preempted_req_ids
step {RUNNER} input_batch query_start_loc
step vllm.v1.worker.gpu_input_batch:InputBatch num_reqs req_ids
step vllm.v1.utils:CpuGpuBuffer cpu
moe vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner layer_id router is_monolithic
moe vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter global_num_experts
    set_capture_fn(self,capture_fn)
dsa_indexer vllm.model_executor.models.deepseek_v2:Indexer topk_tokens topk_indices_buffer prefix
    forward(self,hidden_states,qr,positions,rotary_emb)
dsa_indexer vllm.model_executor.models.utils extract_layer_index(layer_name)
sampling_mask {RUNNER} sampler
sampling_mask vllm.v1.sample.sampler:Sampler logprobs_mode sample(self,logits,sampling_metadata)
sparse_kv {RUNNER} _update_states(self,scheduler_output) _prepare_inputs(self,scheduler_output,num_scheduled_tokens)
    execute_model(self,scheduler_output,intermediate_tensors) vllm_config kv_cache_config input_batch
    compilation_config requests seq_lens optimistic_seq_lens_cpu
sparse_kv vllm.v1.worker.gpu_input_batch:InputBatch num_reqs req_ids block_table req_id_to_index num_computed_tokens_cpu
sparse_kv vllm.v1.worker.gpu_input_batch:CachedRequestState block_ids
sparse_kv vllm.v1.worker.block_table:MultiGroupBlockTable __getitem__
sparse_kv vllm.v1.worker.block_table:BlockTable block_size block_table slot_mapping add_row(self,block_ids,row_idx)
    clear_row(self,row_idx)
sparse_kv vllm.v1.utils:CpuGpuBuffer np gpu
sparse_kv vllm.v1.kv_cache_interface:KVCacheConfig kv_cache_groups
sparse_kv vllm.v1.kv_cache_interface:KVCacheGroupSpec kv_cache_spec layer_names
sparse_kv vllm.v1.kv_cache_interface:KVCacheSpec block_size
sparse_kv vllm.config.compilation:CompilationConfig static_forward_context
sparse_kv vllm.model_executor.layers.attention.attention:Attention kv_cache layer_name impl
sparse_kv vllm.model_executor.models.utils extract_layer_index(layer_name)
sparse_kv vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl num_heads
    forward(self,layer,query,key,value,kv_cache,attn_metadata,output,output_scale,output_block_scale)
    do_kv_cache_update(self,layer,key,value,kv_cache,slot_mapping)
sparse_kv vllm.distributed.parallel_state get_tp_group()
sparse_kv vllm.distributed.parallel_state:GroupCoordinator world_size cpu_group
sparse_kv vllm.v1.core.sched.scheduler:Scheduler schedule(self,throttle_prefills)
    _preempt_request(self,request,timestamp,drop_stale_output) _free_request_blocks(self,request) vllm_config
    kv_cache_config kv_cache_manager defer_block_free running waiting max_num_active_reqs
sparse_kv vllm.v1.core.sched.async_scheduler:AsyncScheduler schedule
sparse_kv vllm.config:VllmConfig additional_config scheduler_config
sparse_kv vllm.config.scheduler:SchedulerConfig async_scheduling
sparse_kv vllm.v1.core.kv_cache_manager:KVCacheManager coordinator block_pool
sparse_kv vllm.v1.core.kv_cache_coordinator:KVCacheCoordinatorNoPrefixCache single_type_managers
    get_num_blocks_to_allocate(self,request_id,num_tokens,new_computed_blocks,num_encoder_tokens,total_computed_tokens,
    num_local_computed_tokens,num_tokens_main_model,apply_admission_cap,prefill_end)
    allocate_new_blocks(self,request_id,num_tokens,num_tokens_main_model,num_encoder_tokens)
    remove_skipped_blocks(self,request_id,processed_computed_tokens,num_prompt_tokens)
    cache_blocks(self,request,num_computed_tokens)
sparse_kv vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager block_size req_to_blocks
sparse_kv vllm.v1.core.block_pool:BlockPool free_blocks(self,ordered_blocks) num_gpu_blocks get_num_free_blocks
sparse_kv vllm.v1.request:Request request_id num_computed_tokens num_prompt_tokens num_tokens sampling_params
    is_finished
sparse_kv vllm.v1.core.sched.output:SchedulerOutput <{RIDER}> num_scheduled_tokens finished_req_ids
    scheduled_cached_reqs
sparse_kv vllm.v1.core.sched.output:CachedRequestData resumed_req_ids
cpu_moe_reload vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod moe_kernel
    _setup_kernel(self,layer,w13,w2)
cpu_seeded_chunks {RUNNER} input_batch
    _bookkeeping_sync(self,scheduler_output,sampler_output,logits,hidden_states,num_scheduled_tokens)
cpu_seeded_chunks vllm.v1.worker.gpu_input_batch:InputBatch generators
registry_session vllm.model_executor.models.registry _run_in_subprocess(fn) _SUBPROCESS_COMMAND
cpu_rotary vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding forward_cpu(self,positions,query,key)
    forward_native(self,positions,query,key)
in_flight vllm.v1.core.sched.scheduler:Scheduler requests reset_prefix_cache(self,reset_running_requests)
in_flight vllm.v1.request:Request request_id num_output_tokens
mla vllm.v1.engine.llm_engine:LLMEngine model_config
mla vllm.config.model:ModelConfig use_mla
mla vllm.model_executor.layers.attention is_deferred_attention_layer(layer)
mla vllm.model_executor.layers.attention.mla_attention:MLAAttention process_weights_after_loading(self,act_dtype)
sparse_kv_mla vllm.model_executor.layers.attention.mla_attention:MLAAttention num_heads scale kv_lora_rank
    qk_nope_head_dim qk_rope_head_dim kv_cache layer_name impl
    forward_impl(self,q,k_c_normed,k_pe,kv_cache,attn_metadata,output)
sparse_kv_mla vllm.v1.attention.backends.mla.cpu_mla:CPUMLAImpl
    do_kv_cache_update(self,kv_c_normed,k_pe,kv_cache,slot_mapping,kv_cache_dtype,k_scale)
"""


def _parse(table: str) -> tuple[Need, ...]:
    rows = re.sub(r"\n\s+", " ", table.strip())  # join continuation lines
    needs = []
    for row in re.sub(r",\s+", ",", rows).splitlines():
        feature, owner, *items = row.split()
        for item in items:
            name, call, params = item.partition("(")
            kind = "rider" if name.startswith("<") else "method" if call else "attribute"
            needs.append(Need(feature, owner, name.strip("<>"), kind, tuple(filter(None, params[:-1].split(",")))))
    return tuple(needs)


NEEDS: tuple[Need, ...] = _parse(_TABLE)


# ---- the check ---------------------------------------------------------------------------------------------
def check(llm: Any = None, *, features: Iterable[str] = ("engine",)) -> None:
    """Raise VLLMInternalsError unless every `NEEDS` entry of `features` holds. With `llm` (an in-process vLLM
    `LLM`) also check the live engine core, scheduler and the worker's model runner."""
    features = tuple(features)
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        raise ValueError(f"vllm_access.check: unknown features {unknown} (known: {list(FEATURES)})")
    for need in NEEDS:
        if need.feature in features:
            _check_need(need)
    if llm is not None:
        _walk(llm, "LLM", "llm_engine", "engine_core", "shutdown")
        check_instance(scheduler(llm), features)
        llm.collective_rpc(check_worker, args=(features,))


def check_worker(worker, features: Iterable[str]) -> None:
    """The live half of `check` on a worker (runs in the worker's process): its model runner's attributes."""
    runner = _walk(worker, "Worker", "model_runner")
    if "sparse_kv" in features and not isinstance(runner, _resolve(RUNNER)):
        _fail(f"the model runner ({type(runner).__name__})", f"is not the V1 {RUNNER} that the sparse-KV hooks patch "
              "(on GPU set VLLM_USE_V2_MODEL_RUNNER=0)", "sparse_kv")
    check_instance(runner, features)


def check_instance(obj, features: Iterable[str]) -> None:
    """Every attribute and method of `features` listed for the class of live object `obj` (or a base) exists on it."""
    for need in NEEDS:
        if need.feature in features and need.kind != "rider" and ":" in need.owner:
            if isinstance(obj, _resolve(need.owner)) and not hasattr(obj, need.name):
                _fail(f"{need.owner}.{need.name} (on the live {type(obj).__name__})", "is missing", need.feature)


def _check_need(need: Need) -> None:
    piece = f"{need.owner}.{need.name}"
    try:
        owner = _resolve(need.owner)
    except (ImportError, AttributeError) as e:
        _fail(need.owner, f"cannot be imported ({e})", need.feature)
    if need.kind == "rider":
        if not any("__dict__" in vars(k) for k in owner.__mro__):
            _fail(need.owner, f"instances take no extra attribute (the {need.name!r} rider)", need.feature)
    elif need.kind == "method":
        fn = getattr(owner, need.name, None)
        if not callable(fn):
            _fail(piece, "is missing", need.feature)
        got = tuple(inspect.signature(fn).parameters)  # follows functools.wraps to a patched method's original
        if got[:len(need.params)] != need.params:
            _fail(piece, f"has parameters {list(got)}, expected {list(need.params)} first", need.feature)
    elif not _defines(owner, need.name):
        _fail(piece, "is missing", need.feature)


def _walk(obj, label: str, *names: str):
    for i, name in enumerate(names):
        if not hasattr(obj, name):
            _fail(".".join((label, *names[:i + 1])), "is missing", "engine")
        obj = getattr(obj, name)
    return obj


def _defines(owner, name: str) -> bool:
    if hasattr(owner, name):
        return True
    return isinstance(owner, type) and (any(name in vars(k).get("__annotations__", {}) for k in owner.__mro__)
                                        or name in _assigned(owner))


@functools.cache
def _assigned(cls: type) -> frozenset[str]:
    """Attribute names that the methods of `cls` and its bases assign (`self.<name> = ...`)."""
    names = set()
    for k in cls.__mro__:
        for f in vars(k).values():
            f = getattr(f, "fget", None) or getattr(f, "__func__", f)  # property, classmethod, staticmethod
            if inspect.isfunction(f):
                names.update(i.argval for i in dis.get_instructions(inspect.unwrap(f)) if i.opname == "STORE_ATTR")
    return frozenset(names)
