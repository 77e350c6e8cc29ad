"""What a resolved run is, in a few lines: the model, the learner layout and the engines, rollout, algorithm and
every path as resolved. `msrl validate` prints it; `msrl train` logs it on rank 0 when the run starts.

    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.validation import validate
    from megatron_sparse_rl.validation.summary import run_summary
    run = load_config("configs/tiny_moe.yaml"); print("\n".join(run_summary(run, validate(run, 1), 1)))

Relative paths in a config resolve against the working directory of the process that reads them (configs/*.yaml
name `runs/...` and are run from the repository root), never against the config file's folder; the `paths` lines
show where each one lands.
"""
from __future__ import annotations

import os

from megatron_sparse_rl.config.degrees import ParallelDegrees
from megatron_sparse_rl.validation.resolve import describe_max_model_len
from megatron_sparse_rl.config.rollout import engine_precision
from megatron_sparse_rl.config.schema import RunConfig


def run_summary(run: RunConfig, spec, world_size: int) -> list[str]:
    """Human-readable lines describing `run` on `world_size` ranks (`spec`: the model's ModelSpec, None when its
    config.json is not reachable here). `run` is checked (`validate`); its rollout.max_model_len may still be unset
    (the summary says what it resolves to)."""
    rollout = run.launch.rollout_world_size
    layout = ParallelDegrees.from_config(run.parallel, world_size - rollout, rollout_ranks=rollout)
    lines = model_lines(run, spec) + lora_lines(run.model.lora, spec)
    who = "world" if not rollout else "learner ranks"
    cp = f" x cp {layout.cp}" if layout.cp > 1 else ""
    lines.append(f"layout: {who} {layout.world_size} = tp {layout.tp} x pp {layout.pp}{cp} x dp {layout.dp}; "
                 f"ep {layout.ep}, etp {layout.etp}, sequence_parallel {layout.sequence_parallel}, "
                 f"backend {layout.backend}" + _stage_note(layout, spec))
    engine_tp = run.rollout.tensor_parallel_size
    if rollout:
        lines.append(f"placement: disaggregated, learner ranks 0-{layout.world_size - 1}, rollout ranks "
                     f"{layout.world_size}-{world_size - 1} ({_engines(rollout, engine_tp)})")
    else:
        lines.append("placement: colocated, every rank a learner and an engine rank "
                     f"({_engines(world_size, engine_tp)})")
    s, kv, a = run.rollout.sampling, run.rollout.kv, run.algorithm
    lines.append(f"rollout: n {s.n}, temperature {s.temperature}, max_tokens {s.max_tokens}, kv policy {kv.policy}"
                 + (f" (budget {kv.budget}, window {kv.window})" if kv.policy != "none" else ""))
    if run.env.multi_turn:
        e = run.env
        lines.append(f"episodes: env {e.kind}, tools {', '.join(e.tools)}, at most {e.max_turns} turns and "
                     f"{e.max_total_tokens} tokens after the prompt; prefix caching "
                     f"{'on' if run.rollout.prefix_caching else 'off (every turn prefills the whole history again)'}")
    enabled = [n for n in ("tis", "mis", "geo_rs", "veto", "icepop", "opsm", "sparse_rl", "batch_skip")
               if getattr(a.corrections, n).enabled]
    lines.append(f"algorithm: advantage {a.advantage.estimator}, loss {a.loss.name} ({a.loss.aggregation}), "
                 f"corrections {', '.join(enabled) or 'none'}, kl coef {a.kl.coef}")
    return lines + path_lines(run)


def _stage_note(layout: ParallelDegrees, spec) -> str:
    """'; pipeline stages 3,2,2 (balanced, automatic) of 7 layers' with pp > 1 and the model known, else ''."""
    if layout.pp == 1 or spec is None:
        return "" if layout.pp == 1 else f"; pipeline layout {layout.pipeline_layout or 'balanced'} (model unknown here)"
    return f"; pipeline {layout.stages(spec.num_layers).describe()} of {spec.num_layers} layers"


def _engines(ranks: int, engine_tp: int) -> str:
    count = ranks // engine_tp
    return f"{count} engine{'s' if count != 1 else ''} of tp {engine_tp}"


def model_lines(run: RunConfig, spec) -> list[str]:
    """The model's architecture, size, dtypes and the engine's context (rollout.max_model_len as resolved)."""
    from megatron_sparse_rl.models.deepseek import DeepseekSpec  # lazy: the config package stays free of torch

    m = run.model
    tiny = f" (tiny {m.tiny.arch}, built at model.path on first use)" if m.tiny else ""
    if spec is None:
        return [f"model: unknown here (no config.json at model.path){tiny}; model checks skipped",
                f"  learner dtype {m.dtype}, {engine_precision(run.rollout)}, max_model_len "
                f"{describe_max_model_len(run.rollout, spec)}"]
    attention = (f"{spec.num_heads} heads, MLA latent {spec.latent_width} (kv_lora_rank {spec.kv_lora_rank} + "
                 f"qk_rope_head_dim {spec.qk_rope_head_dim})" if isinstance(spec, DeepseekSpec)
                 else f"{spec.num_heads} heads ({spec.num_kv_heads} KV) x {spec.head_dim}")
    arch = (f"model: {spec.architecture}{tiny}: {spec.num_layers} layers, hidden {spec.hidden_size}, {attention}, "
            f"vocab {spec.vocab_size}")
    if spec.is_moe:
        arch += f", {spec.num_experts} experts top-{spec.moe_topk} (ffn {spec.moe_ffn_hidden_size})"
    return [arch, f"  parameters: {spec.parameter_count():,}; learner dtype {m.dtype}, {engine_precision(run.rollout)}"
                  f", max_model_len {describe_max_model_len(run.rollout, spec)}"]


def lora_lines(lora, spec) -> list[str]:
    """With model.lora: the adapters (rank, alpha, scale, dropout, targets) and how many parameters train (the
    adapters, counted by lora/targets.py) against the frozen base; [] without."""
    if lora is None:
        return []
    from megatron_sparse_rl.lora.targets import adapter_params, resolve_targets

    head = (f"lora: rank {lora.rank}, alpha {lora.alpha:g} (scale {lora.scale:g}), dropout {lora.dropout:g} on "
            f"{', '.join(lora.target_modules)}")
    if spec is None:
        return [head + "; the base frozen (model unknown here: adapter count skipped)"]
    trainable = adapter_params(spec, lora.rank, resolve_targets(lora.target_modules, spec)).total
    base = spec.parameter_count()
    return [head, f"  trainable: {trainable:,} adapter parameters ({100 * trainable / base:.2f}% of the base's "
                  f"{base:,}, frozen)"]


def path_lines(run: RunConfig) -> list[str]:
    """Every path the run reads or writes, made absolute against the working directory (how they resolve)."""
    cwd = os.getcwd()
    entries = [("model.path", run.model.path, ""), ("data.path", run.data.path, ""),
               ("data.eval_path", run.data.eval_path, ""), ("logging.dir", run.logging.dir, ""),
               ("checkpoint.dir", run.checkpoint.dir or os.path.join(run.logging.dir, "checkpoints"),
                "" if run.checkpoint.dir else " (default <logging.dir>/checkpoints)")]
    return [f"paths (relative ones resolve against the working directory {cwd}):"] + [
        f"  {name}: {os.path.abspath(path)}{note}" for name, path, note in entries if path]
