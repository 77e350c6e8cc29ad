"""The named steps of the RL loop, each one function over the `RunContext`.

Colocated, each data-parallel leader samples its share with its own engine; an engine spanning several
ranks (rollout.tensor_parallel_size > 1) samples the shares of all its ranks, every rank of it taking part.
Disaggregated, learner rank 0
samples every share through the rollout ranks (`ctx.engine` is a `RemoteEngine`) and hands each learner
rank its own, seeded as the colocated leaders would be."""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from megatron_sparse_rl.learner.sft import make_sft_loss
from megatron_sparse_rl.training import rollout as R
from megatron_sparse_rl.training import update as U
from megatron_sparse_rl.training.context import RunContext

log = logging.getLogger(__name__)


def _dp_share(ctx: RunContext, items: list) -> list:
    return items[ctx.groups.dp_rank::ctx.layout.dp]


def _is_leader(ctx: RunContext) -> bool:
    """The rank that generates for its model-parallel group (its TP/PP peers must train on the same rows)."""
    return ctx.groups.tp_rank == 0 and ctx.groups.pp_rank == 0


def _share_from_leader(ctx: RunContext, obj):
    if ctx.layout.tp * ctx.layout.pp == 1:
        return obj
    holder = [obj]
    src = dist.get_process_group_ranks(ctx.groups.model_parallel)[0]
    dist.broadcast_object_list(holder, src=src, group=ctx.groups.model_parallel)
    return holder[0]


def _from_main(ctx: RunContext, per_dp_rank):
    """Disaggregated: learner rank 0 runs `per_dp_rank(d)` for every data-parallel rank d (it alone drives the
    rollout ranks) and each learner rank gets the result for its own d."""
    out = [per_dp_rank(d) for d in range(ctx.layout.dp)] if ctx.is_main else None
    if ctx.layout.world_size > 1:
        holder = [out]
        dist.broadcast_object_list(holder, src=0, group=ctx.groups.learner)
        out = holder[0]
    return out[ctx.groups.dp_rank]


def _from_engine(ctx: RunContext, per_dp_rank):
    """Colocated engine TP > 1: the ranks of one engine run `per_dp_rank(d)` for every data-parallel rank d
    among them, the same calls in the same order (vLLM's external_launcher needs every rank of an engine in
    each call), and each keeps the result for its own d; seeds depend on d only, as with TP-1 engines."""
    out = {d: per_dp_rank(d) for d in ctx.engine_shares}
    return out[ctx.groups.dp_rank]


def _global_sum(ctx: RunContext, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if ctx.layout.dp > 1:
        dist.all_reduce(t, group=ctx.dp_group)
    return t.tolist()


def rollout_step(ctx: RunContext, step: int, score, correct) -> tuple:
    """This data-parallel rank's rollout batch with rewards, and rollout metrics (global)."""
    t0 = time.perf_counter()
    examples = ctx.task.next_train(ctx.run.trainer.prompts_per_step)

    def collect(dp_rank: int):
        seed = ctx.run.rollout.seed + 1_000_003 * step + 10_007 * dp_rank
        return R.collect(ctx.engine, ctx.tokenizer, examples[dp_rank::ctx.layout.dp], ctx.run.rollout.sampling,
                         seed=seed, score=score, correct=correct)

    if ctx.layout.rollout_ranks:
        batch, is_correct = _from_main(ctx, collect)
    elif ctx.engine_shares is not None:
        batch, is_correct = _share_from_leader(ctx, _from_engine(ctx, collect))
    else:
        batch, is_correct = _share_from_leader(ctx, collect(ctx.groups.dp_rank) if _is_leader(ctx) else None)
    seconds = time.perf_counter() - t0
    n_tok = float(batch.response_mask.sum())
    reward, right, count, length = _global_sum(ctx, [float(batch.reward.sum()), float(is_correct.sum()),
                                                     float(len(batch)), n_tok])
    metrics = {"rollout/reward": reward / count, "rollout/accuracy": right / count,
               "rollout/response_len": length / count, "time/rollout_s": seconds,
               "rollout/tokens_per_s": length / max(seconds, 1e-9),
               "rollout/truncated_frac": sum(r == "length" for r in batch.finish_reasons) / len(batch)}
    return batch, metrics


def train_step(ctx: RunContext, batch) -> dict[str, float]:
    """Dense old-logprob recompute, advantages, corrections and the policy updates."""
    t0 = time.perf_counter()
    algo = ctx.run.algorithm
    prep = U.prepare(ctx.learner, batch, algo, pad_id=ctx.engine.pad_id, dp_group=ctx.dp_group,
                     routing=ctx.routing, reference=ctx.reference)
    metrics = dict(prep.metrics)
    if ctx.run.rollout.kv.policy != "none":
        from megatron_sparse_rl.training.sparse_kv import kv_metrics, sparse_logprobs

        kv = ctx.run.rollout.kv
        sparse = sparse_logprobs(ctx.learner, batch, prep.tokens, keep=prep.keep) if kv.record_keep else None
        metrics.update(kv_metrics(batch, prep.old_logprobs, prep.rollout_logprobs, prep.response_mask, kv.budget,
                                  sparse=sparse))
    if prep.metrics.get("batch_skip/skipped", 0.0) > 0:
        log.warning("skipping the update: the batch's k1 mismatch is over algorithm.corrections.batch_skip.max_k1")
    else:
        metrics.update(U.update(ctx.learner, prep, algo, updates=ctx.run.trainer.updates_per_rollout,
                                dp_group=ctx.dp_group, routing=ctx.routing))
    seconds = time.perf_counter() - t0
    metrics["time/train_s"] = seconds
    metrics["train/tokens_per_s"] = metrics.get("train/tokens", 0.0) / max(seconds, 1e-9)
    return metrics


def sync_step(ctx: RunContext, n_syncs: int, probe: torch.Tensor | None) -> dict[str, float]:
    """Learner -> engine weights, checksummed; logprob parity on a probe after the first sync and every N."""
    from megatron_sparse_rl.training.disaggregated import verify_engines
    from megatron_sparse_rl.weight_sync import sync_to_engine, verify_logprobs

    cfg = ctx.run.trainer
    remote = bool(ctx.layout.rollout_ranks)  # disaggregated: the engines are on the rollout ranks
    if remote:
        stats = ctx.engine.sync_weights(ctx.learner, bucket_mb=cfg.sync_bucket_mb)
    else:
        stats = sync_to_engine(ctx.learner, ctx.engine, bucket_mb=cfg.sync_bucket_mb)
    metrics = {"time/sync_s": stats.seconds, "sync/bytes_per_s": stats.bytes_per_s}
    every = cfg.verify_sync_every
    if probe is not None and every and (n_syncs == 0 or (n_syncs + 1) % every == 0):
        verify = verify_engines if remote else verify_logprobs
        diff = verify(ctx.learner, ctx.engine, probe, cfg.verify_sync_tol)
        if diff is not None:  # None on learner ranks that compare nothing (disaggregated, rank > 0)
            metrics["sync/probe_max_abs_diff"] = diff
    return metrics


def evaluate(ctx: RunContext, correct, n: int) -> float:
    """Held-out accuracy (global over data-parallel ranks): mean correctness of `trainer.eval_samples`
    samples per prompt at `trainer.eval_temperature` (greedy when 0), with a fixed seed."""
    cfg = ctx.run.trainer
    examples = ctx.task.eval_examples(n)

    def score(dp_rank: int) -> tuple[float, int]:
        return R.accuracy(ctx.engine, ctx.tokenizer, examples[dp_rank::ctx.layout.dp],
                          max_tokens=ctx.run.rollout.sampling.max_tokens, score=correct,
                          temperature=cfg.eval_temperature, samples=cfg.eval_samples,
                          seed=ctx.run.rollout.seed + 7919 * dp_rank)

    if ctx.layout.rollout_ranks:
        total, count = _from_main(ctx, score)
    elif ctx.engine_shares is not None:
        total, count = _share_from_leader(ctx, _from_engine(ctx, score))
    else:
        total, count = score(ctx.groups.dp_rank) if _is_leader(ctx) else (0.0, 0)
        if ctx.layout.tp * ctx.layout.pp > 1:
            total, count = _share_from_leader(ctx, (total, count))
    total, count = _global_sum(ctx, [total, count])
    return total / max(count, 1.0)


def sft_step(ctx: RunContext) -> dict[str, float]:
    """One supervised step on reference answers (prompt tokens masked out of the loss)."""
    from megatron_sparse_rl.data import encode_sft

    cfg = ctx.run.trainer.sft
    rows = [encode_sft(ctx.tokenizer, e) for e in _dp_share(ctx, ctx.task.next_sft(cfg.batch_size))]
    width = max(len(r.input_ids) for r in rows)
    tokens = torch.full((len(rows), width), ctx.engine.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        tokens[i, :len(r.input_ids)] = torch.tensor(r.input_ids)
        mask[i, :len(r.loss_mask)] = torch.tensor(r.loss_mask, dtype=torch.float32)
    mask = mask[:, 1:]  # learner column t scores token t + 1
    n_global = _global_sum(ctx, [float(mask.sum())])[0]
    with ctx.learner.scoring_temperature(1.0):  # supervised: the model itself, not the sampling temperature
        out = ctx.learner.train_step(tokens, make_sft_loss(mask, n_global), lr=cfg.lr,
                                     lengths=[len(r.input_ids) for r in rows])
    return {"sft/loss": _global_sum(ctx, [out["loss"]])[0]}
