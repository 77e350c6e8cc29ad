"""The named steps of the RL loop, each one function over the `RunContext`.

Where the engines are is `ctx.placement`'s business (placement/placements.py): a step hands it the work for one
data-parallel share (`work(engine, dp_rank)`) and gets this rank's share back, and asks it to sync and verify
the engines; no step knows whether they are colocated, spread over several ranks or on rollout ranks."""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from megatron_sparse_rl.kv.engine_extension import set_sparse_kv_budget
from megatron_sparse_rl.learner.extras import NO_EXTRAS
from megatron_sparse_rl.learner.finite import require_finite
from megatron_sparse_rl.learner.sft import make_sft_loss
from megatron_sparse_rl.rollout.versions import too_stale
from megatron_sparse_rl.placement import rollout as R
from megatron_sparse_rl.training import update as U
from megatron_sparse_rl.training.context import RunContext
from megatron_sparse_rl.training.feature_metrics import StepView, feature_metrics
from megatron_sparse_rl.training.sft_kv import sft_kv_extras, sft_kv_metrics

log = logging.getLogger(__name__)


def _dp_share(ctx: RunContext, items: list) -> list:
    return items[ctx.groups.dp_rank::ctx.layout.dp]


def _global_sum(ctx: RunContext, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if ctx.layout.dp > 1:
        dist.all_reduce(t, group=ctx.dp_group)
    return t.tolist()


def _rescore(ctx: RunContext) -> int:
    """The engine re-scorings per sequence algorithm.old_logprobs' source needs (0: none)."""
    return U.old_logprob_source(ctx.run.algorithm).rescorings(ctx.run.algorithm)


def _seed(ctx: RunContext, step: int, dp_rank: int) -> int:
    return ctx.run.rollout.seed + 1_000_003 * step + 10_007 * dp_rank


def _requests(ctx: RunContext, step: int, examples, rollouts: R.Rollouts) -> list[R.RolloutRequest]:
    """Step `step`'s engine call for each data-parallel share d (prompts `examples[d::dp]`, seeds from d), of the
    run's kind (`rollouts`: single-turn, or multi-turn episodes whose environments and rewards run where the engines
    do)."""
    dp, run = ctx.layout.dp, ctx.run
    return [rollouts.request(examples[d::dp], run.rollout.sampling, seed=_seed(ctx, step, d), rescore=_rescore(ctx))
            for d in range(dp)]


def _finish(ctx: RunContext, examples, rollouts: R.Rollouts):
    """finish(batch, d): share d's batch with its rewards, and which of its samples are correct."""
    return lambda batch, d: rollouts.judged(batch, ctx.tokenizer, examples[d::ctx.layout.dp])


def rollout_step(ctx: RunContext, step: int, rollouts: R.Rollouts) -> tuple:
    """This data-parallel rank's rollout batch with rewards, and rollout metrics (global)."""
    t0 = time.perf_counter()
    examples = ctx.task.next_train(ctx.run.trainer.prompts_per_step)
    batch, is_correct = ctx.placement.sample(_requests(ctx, step, examples, rollouts),
                                             _finish(ctx, examples, rollouts))
    return batch, _rollout_metrics(ctx, batch, is_correct, time.perf_counter() - t0)


def sample_ahead(ctx: RunContext, step: int, rollouts: R.Rollouts) -> None:
    """Asynchronous RL: start step `step`'s rollout (the same prompts and seeds as `rollout_step`) on the engines and
    return at once. The placement queues it (up to trainer.max_staleness batches); the weight syncs reach the
    engines while they sample, and `next_batch` collects it."""
    examples = ctx.task.next_train(ctx.run.trainer.prompts_per_step)
    ctx.placement.sample_ahead(_requests(ctx, step, examples, rollouts), _finish(ctx, examples, rollouts))


def next_batch(ctx: RunContext, step: int, rollouts: R.Rollouts) -> tuple:
    """Step `step`'s batch with rewards and rollout metrics (global): the oldest one sampled ahead during earlier
    steps when the placement holds one (checked against trainer.stale_policy), else sampled now (`rollout_step`).
    For a batch sampled ahead time/rollout_s is the engines' sampling time and async/* add the learner's wait for
    the batch and the engines' wait and load times."""
    ahead = ctx.placement.take_ahead()
    if ahead is None:
        return rollout_step(ctx, step, rollouts)
    (batch, is_correct), engine = ahead.result, ahead.engine_s
    batch, is_correct, guard = _stale_guard(ctx, step, ahead, batch, is_correct)
    metrics = _rollout_metrics(ctx, batch, is_correct, engine["generate_s"])
    metrics.update(guard)
    metrics.update({"async/learner_wait_s": ahead.learner_wait_s,
                    "async/engine_wait_s": engine["wait_s"], "async/engine_load_s": engine["load_s"],
                    "async/in_flight_update": engine["in_flight"]})
    return batch, metrics


def _stale_guard(ctx: RunContext, step: int, ahead, batch, is_correct) -> tuple:
    """trainer.stale_policy for samples with a token more than trainer.max_staleness versions behind `step` (the
    pipeline holds at most that many batches, so none should be): "drop" them (a rank left without a sample:
    sample the step again), "recompute": sample the step's batch again now, with the same prompts and seeds, at
    the training version. Counted (global): async/dropped_samples, async/resampled."""
    cfg = ctx.run.trainer
    stale = (too_stale(batch.token_version, batch.response_mask, step, cfg.max_staleness)
             if batch.token_version is not None else torch.zeros(len(batch), dtype=torch.bool))
    n_stale, emptied = _global_sum(ctx, [float(stale.sum()), float(bool(stale.all()))])
    if n_stale and cfg.stale_policy == "drop" and not emptied:  # each rank keeps a sample
        keep = torch.nonzero(~stale).flatten()
        log.warning("RL step %d: dropping %d samples more than %d versions stale", step + 1, n_stale,
                    cfg.max_staleness)
        return batch.select(keep), is_correct[keep], {"async/dropped_samples": n_stale, "async/resampled": 0.0}
    if n_stale:
        log.warning("RL step %d: %d samples more than %d versions stale: sampling the step again", step + 1,
                    n_stale, cfg.max_staleness)
        batch, is_correct = ctx.placement.sample(ahead.requests, ahead.finish)
    return batch, is_correct, {"async/dropped_samples": 0.0, "async/resampled": float(n_stale > 0)}


def _rollout_metrics(ctx: RunContext, batch, is_correct, seconds: float) -> dict[str, float]:
    """Reward, accuracy, lengths, tokens/s over `seconds` of sampling and the KV pool's use (global)."""
    n_tok = float(batch.response_mask.sum())
    reward, right, count, length = _global_sum(ctx, [float(batch.reward.sum()), float(is_correct.sum()),
                                                     float(len(batch)), n_tok])
    metrics = {"rollout/reward": reward / count, "rollout/accuracy": right / count,
               "rollout/response_len": length / count, "time/rollout_s": seconds,
               "rollout/tokens_per_s": length / max(seconds, 1e-9),
               "rollout/truncated_frac": sum(r == "length" for r in batch.finish_reasons) / len(batch)}
    metrics.update(_kv_usage_metrics(ctx, batch.kv_usage))
    if batch.episode_stats is not None:
        metrics.update(_episode_metrics(ctx, batch.episode_stats))
    return metrics


def _episode_metrics(ctx: RunContext, sums: dict[str, float]) -> dict[str, float]:
    """Multi-turn episodes (global): per episode `episode/turns`, `episode/tool_calls`, `episode/tool_errors`,
    `episode/tool_timeouts` (of the errors, tool calls past env.tool_timeout_s), `episode/env_tokens`,
    `episode/reprefill_tokens` (history the engine prefilled again: rollout/multi_turn.py),
    `episode/prefix_cached_tokens`; per turn k over the episodes that reached it `turn{k}/tokens` (model tokens),
    `turn{k}/tool_calls`, `turn{k}/tool_errors`, and `turn{k}/episodes` (how many reached it)."""
    keys = sorted(sums)
    total = dict(zip(keys, _global_sum(ctx, [sums[k] for k in keys])))
    n = max(total["episodes"], 1.0)
    metrics = {f"episode/{k}": total[k] / n for k in ("turns", "tool_calls", "tool_errors", "tool_timeouts",
                                                      "env_tokens", "reprefill_tokens")}
    metrics["episode/prefix_cached_tokens"] = total["cached_tokens"] / n
    for k in keys:
        if k.startswith("turn") and "/" in k and not k.endswith("/episodes"):
            metrics[k] = total[k] / max(total[k.split("/")[0] + "/episodes"], 1.0)
        elif k.endswith("/episodes"):
            metrics[k] = total[k]
    return metrics


def _kv_usage_metrics(ctx: RunContext, usage: dict | None) -> dict[str, float]:
    """The KV pool while the step sampled, over every engine (blocks summed): `rollout/kv_peak_occupancy` = peak
    blocks in use / usable blocks, the peak and pool block counts, mean running requests, preemptions."""
    if usage is None:  # the engine core is not in this process (a multi-process vLLM engine)
        return {}
    peak, pool, running, preempted = _global_sum(ctx, [usage["peak_blocks"], usage["pool_blocks"],
                                                       usage["mean_running"], usage["preemptions"]])
    return {"rollout/kv_peak_occupancy": peak / max(pool, 1.0), "rollout/kv_peak_blocks": peak,
            "rollout/kv_pool_blocks": pool, "rollout/running_mean": running, "rollout/preemptions": preempted}


def apply_kv_budget(ctx: RunContext, budget: int) -> None:
    """The engines compact to `budget` from the next generate on (rollout.kv.budget_schedule; colocated placements:
    each engine's rank sets its own)."""
    ctx.placement.generate(lambda engine, dp_rank: set_sparse_kv_budget(engine, budget))


def train_step(ctx: RunContext, batch, version: int = 0, kv_budget: int | None = None) -> dict[str, float]:
    """Dense old-logprob recompute, advantages, corrections, the features' metrics and the policy updates, by the
    learner at weight version `version` (RL steps trained so far). `kv_budget`: the budget the batch was sampled at
    (None: rollout.kv.budget)."""
    t0 = time.perf_counter()
    prep = U.prepare(ctx.learner, batch, ctx.run.algorithm, pad_id=ctx.placement.pad_id, dp_group=ctx.dp_group,
                     reference=ctx.reference)
    view = StepView(batch, prep, version=version, kv_budget=kv_budget, dp_group=ctx.dp_group)
    metrics = {**prep.metrics, **feature_metrics(ctx.features, ctx.learner, view), **_updated(ctx, prep, version)}
    seconds = time.perf_counter() - t0
    return {**metrics, "time/train_s": seconds,
            "train/tokens_per_s": metrics.get("train/tokens", 0.0) / max(seconds, 1e-9)}


def _updated(ctx: RunContext, prep: U.PreparedBatch, version: int) -> dict[str, float]:
    """The policy updates' metrics, or none when algorithm.corrections.batch_skip skips the batch."""
    if prep.metrics.get("batch_skip/skipped", 0.0) > 0:
        log.warning("skipping the update: the batch's k1 mismatch is over algorithm.corrections.batch_skip.max_k1")
        return {}
    metrics = U.update(ctx.learner, prep, ctx.run.algorithm, updates=ctx.run.trainer.updates_per_rollout,
                       dp_group=ctx.dp_group)
    # host floats already (no extra sync); raised before this step's weights are synced, saved or exported
    require_finite({"loss": metrics["loss/value"], "grad norm": metrics["train/grad_norm"]}, f"RL step {version + 1}")
    return metrics


def sync_step(ctx: RunContext, n_syncs: int, probe: torch.Tensor | None, version: int = 0) -> dict[str, float]:
    """Learner -> engine weights (weight version `version`), checksummed; logprob parity on a probe after the first
    sync and every N (`verify_step`). While the engines sample ahead the placement's sync reaches them in flight,
    and they answer the probe between two batches (after the one they are sampling)."""
    cfg = ctx.run.trainer
    stats = ctx.placement.sync(ctx.learner, bucket_mb=cfg.sync_bucket_mb, version=version)
    # a LoRA learner's syncs after the engines hold a full set move the adapted tensors alone (weight_sync/scope.py)
    metrics = {"time/sync_s": stats.seconds, "sync/bytes_per_s": stats.bytes_per_s, "sync/bytes": stats.bytes,
               "sync/full_bytes": stats.full_bytes}
    metrics.update(verify_step(ctx, n_syncs, probe))
    return metrics


def verify_step(ctx: RunContext, n_syncs: int, probe: torch.Tensor | None) -> dict[str, float]:
    """The engines' probe logprobs against the learner's after sync number `n_syncs` when it is due."""
    cfg = ctx.run.trainer
    every = cfg.verify_sync_every
    if probe is None or not every or not (n_syncs == 0 or (n_syncs + 1) % every == 0):
        return {}
    return ctx.placement.verify(ctx.learner, probe, sync_tolerance(cfg.verify_sync_tol, ctx.learner,
                                                                   ctx.placement.weights.dtype))


BF16_ENGINE_MEAN_TOL = 0.3
"""Default bound of the probe's MEAN |engine - learner| logprob for a bf16 engine (weight_sync/verify.py bounds the
mean there: its MoE routers flip). Measured on tiny MoEs, correct weights 0.02-0.03 after a warm start and 0.09-0.22
at random init (near-uniform routers flip most: the worst case), wrong weights (two experts of one layer swapped, a
flipped o_proj, another seed's weights) 0.91-2.9 (docs/weight_sync.md, "Low-precision engines")."""


def sync_tolerance(configured: float | None, learner, engine_dtype: torch.dtype = torch.float32) -> float:
    """`trainer.verify_sync_tol`, or when it is null: for a bf16 engine `BF16_ENGINE_MEAN_TOL` (a bound of the mean),
    else by the learner's parameter dtype (a bound of the max: 1e-3 for float32, 1e-1 for bfloat16)."""
    from megatron_sparse_rl.checkpoint.verify import TOLERANCE

    if configured is not None:
        return configured
    if engine_dtype == torch.bfloat16:
        return BF16_ENGINE_MEAN_TOL
    return TOLERANCE.get(next(learner.model.parameters()).dtype, max(TOLERANCE.values()))


def evaluate(ctx: RunContext, correct, n: int) -> float:
    """Held-out accuracy (global over data-parallel ranks): mean correctness (`correct`, the reward too) of
    `trainer.eval_samples` samples per prompt at `trainer.eval_temperature` (greedy when 0), with a fixed seed; with
    an environment, episodes judged on their final answer."""
    cfg, dp = ctx.run.trainer, ctx.layout.dp
    examples = ctx.task.eval_examples(n)
    rollouts = R.rollouts_for(ctx.run.env, score=correct, correct=correct)
    sampling = R.eval_sampling(max_tokens=ctx.run.rollout.sampling.max_tokens, temperature=cfg.eval_temperature,
                               samples=cfg.eval_samples)
    requests = [rollouts.request(examples[d::dp], sampling, seed=ctx.run.rollout.seed + 7919 * d) for d in range(dp)]

    def judged(batch, d: int) -> tuple[float, int]:
        if batch is None:  # a share without prompts
            return 0.0, 0
        right = rollouts.judged(batch, ctx.tokenizer, examples[d::dp])[1]
        return float(right.sum()), len(right)

    total, count = ctx.placement.sample(requests, judged)
    total, count = _global_sum(ctx, [total, count])
    return total / max(count, 1.0)


def sft_step(ctx: RunContext, step: int | None = None) -> dict[str, float]:
    """One supervised step (number `step`, for messages) on reference answers (prompt tokens masked out of the
    loss). A non-finite loss or gradient norm stops the run (NonFiniteError naming the step)."""
    from megatron_sparse_rl.data import encode_sft

    cfg = ctx.run.trainer.sft
    rows = [encode_sft(ctx.tokenizer, e) for e in _dp_share(ctx, ctx.task.next_sft(cfg.batch_size))]
    width = max(len(r.input_ids) for r in rows)
    tokens = torch.full((len(rows), width), ctx.placement.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        tokens[i, :len(r.input_ids)] = torch.tensor(r.input_ids)
        mask[i, :len(r.loss_mask)] = torch.tensor(r.loss_mask, dtype=torch.float32)
    mask = mask[:, 1:]  # learner column t scores token t + 1
    lengths = [len(r.input_ids) for r in rows]
    extras, kv = NO_EXTRAS, []
    if cfg.kv_keep.enabled:  # sparsity-aware SFT: train under the keep sets the run's sparse cache would make
        prompt_lens = [r.loss_mask.index(1) if 1 in r.loss_mask else len(r.loss_mask) for r in rows]
        extras, kv = sft_kv_extras(ctx.learner, tokens, mask, prompt_lens, lengths, ctx.run.rollout.kv, cfg.kv_keep)
    n_global, n_rows, *kv = _global_sum(ctx, [float(mask.sum()), float(len(rows)), *kv])
    with ctx.learner.scoring_temperature(1.0):  # supervised: the model itself, not the sampling temperature
        out = ctx.learner.train_step(tokens, make_sft_loss(mask, n_global), lr=cfg.lr, lengths=lengths, extras=extras)
    loss = _global_sum(ctx, [out["loss"]])[0]
    require_finite({"loss": loss, "grad norm": out["grad_norm"]}, "SFT step" + (f" {step}" if step else ""))
    return {"sft/loss": loss, **(sft_kv_metrics(kv, n_global, n_rows) if kv else {})}
