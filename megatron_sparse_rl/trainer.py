"""The RL loop (`msrl train CONFIG`): optional SFT warm-start, then per step
rollout -> rewards -> dense old logprobs -> advantages -> corrections -> updates -> weight sync -> metrics.

    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.trainer import train
    summary = train(load_config("configs/demo_tiny_moe.yaml"))

Runs as one process or under torchrun/srun: colocated (every rank a learner with its own engine) or
disaggregated (`launch.rollout_ranks` / `launch.rollout_nodes`: learner ranks train, rollout ranks serve
their engines to learner rank 0; placement/disaggregated.py).
"""
from __future__ import annotations

import logging

from megatron_sparse_rl.config.schema import RunConfig
from megatron_sparse_rl.kv.budget_schedule import BudgetSchedule
from megatron_sparse_rl.lora.layers import adapter_count
from megatron_sparse_rl.training import state
from megatron_sparse_rl.training import steps as S
from megatron_sparse_rl.training.context import build_context, open_metrics
from megatron_sparse_rl.placement.disaggregated import RolloutRank, serve
from megatron_sparse_rl.placement.rollout import rollouts_for
from megatron_sparse_rl.training.report import Reporter
from megatron_sparse_rl.run.stops import StopSignals

log = logging.getLogger(__name__)


def train(run: RunConfig) -> dict:
    """Run the loop; a SIGTERM / SIGINT stops it at the next step boundary with a checkpoint (run/stops.py):
    the summary then has "stopped" (the reason) and "checkpoint"."""
    cfg = run.trainer
    stops = StopSignals(timeout_s=cfg.stop_timeout_s, role="starting").install()
    try:
        ctx = build_context(run, total_steps=max(cfg.steps * cfg.updates_per_rollout, 1))
        if isinstance(ctx, RolloutRank):  # disaggregated: serve learner rank 0 until it says stop
            stops.role = "rollout rank"
            return serve(ctx)
        stops.role = "trainer"
        try:
            return rl_loop(ctx, stops)
        except BaseException:
            _close_failed(ctx)
            raise
        finally:  # the engines (local, or the rollout ranks) stop on every way out, errors included
            ctx.placement.shutdown()
    finally:
        stops.uninstall()


def _close_failed(ctx) -> None:
    """Rank 0, the run raised: flush metrics.jsonl and end the tracker runs as failed (MLflow FAILED, W&B exit code
    1) instead of leaving them running; a resume reopens them. A failure here is logged, not raised over the
    run's own error."""
    if ctx.writer is None:
        return
    try:
        ctx.writer.close(failed=True)
    except Exception:  # noqa: BLE001 - the run's error is the one to raise
        log.exception("could not close the metrics writer and trackers after the run failed")


def rl_loop(ctx, stops: StopSignals) -> dict:
    cfg, run = ctx.run.trainer, ctx.run
    rollouts, correct = _rollouts(run)
    loop = state.resume_run(ctx)
    # The engine's first load in this process is always probed; the every-N schedule counts the run's syncs
    # across restarts (a resume's first sync is extra, so it does not count).
    resumed = loop is not None
    loop = loop or state.LoopState(sft_done=cfg.sft.max_steps == 0)
    # a signal during start-up stops before the first step; the preemption file is read after steps, as ever
    why = state.stop_requested(ctx, stops, preemption=False)
    if why:  # asked during start-up: nothing new to checkpoint
        return _stopped(ctx, why, loop, None)
    _announce(ctx, loop)
    open_metrics(ctx, loop.metrics_records)  # a fresh run starts a fresh metrics.jsonl
    report = Reporter(ctx, total=cfg.steps)
    probe = report.probe_tokens()
    # weight versions count the RL steps trained (RolloutBatch.token_version); the SFT stage's syncs are version 0
    report.scalars(S.sync_step(ctx, 0, probe, version=loop.rl_step), step=loop.rl_step, phase="sync")
    loop.syncs = loop.syncs if resumed else 1
    if not loop.sft_done:
        why = sft_stage(ctx, correct, loop, report, probe, stops)
        if why:
            return _stopped(ctx, why, loop, state.save_run(ctx, loop))
        if run.checkpoint.save_every:
            state.save_run(ctx, loop)
    if loop.rl_step == 0:
        report.warm_start(S.evaluate(ctx, correct, cfg.eval_prompts))
    task_states = {}  # the task's position before each step handed to the engines
    schedule = BudgetSchedule.start(run.rollout.kv, loop.kv_budget)  # None: rollout.kv.budget throughout
    for step in range(loop.rl_step, cfg.steps):
        if schedule is not None:  # synchronous, colocated (validate): this step's rollouts at the scheduled budget
            S.apply_kv_budget(ctx, schedule.budget)
        batch, metrics = S.next_batch(ctx, step, rollouts)  # sampled ahead during earlier steps, or now
        # a checkpoint after this step resumes with the next step's prompts: the task's position before them
        task_states.setdefault(step + 1, ctx.task.state_dict())
        for ahead in ctx.placement.steps_ahead(step, cfg.steps - 1):  # asynchronous: the placement's window (k)
            S.sample_ahead(ctx, ahead, rollouts)
            task_states[ahead + 1] = ctx.task.state_dict()
        task_state = task_states.pop(step + 1)
        metrics.update(S.train_step(ctx, batch, version=step, kv_budget=schedule and schedule.budget))
        if schedule is not None:  # the next step's budget from this step's tail (kv/budget_schedule.py)
            metrics.update(schedule.after_step(metrics["mismatch/rho_p5"]))
            loop.kv_budget = schedule.budget
        metrics.update(S.sync_step(ctx, loop.syncs, probe, version=step + 1))
        loop.syncs += 1
        if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.steps:
            metrics["eval/accuracy"] = S.evaluate(ctx, correct, cfg.eval_prompts)
        loop.rl_step = step + 1
        report.step(step + 1, metrics)
        # a checkpoint drops the batches sampled ahead: a resumed run samples those steps again, under its weights
        if run.checkpoint.save_every and (step + 1) % run.checkpoint.save_every == 0:
            state.save_run(ctx, loop, task_state)
        why = state.stop_requested(ctx, stops)
        if why:
            if ctx.is_main:
                log.warning("%s: checkpointing after RL step %d and exiting", why, step + 1)
            return _stopped(ctx, why, loop, state.save_run(ctx, loop, task_state))
    return report.finish(loop)


def _rollouts(run):
    """The run's kind of rollout (single-turn or episodes, chosen once, with the shaped reward) and the unshaped
    correctness scorer that accuracy counts with."""
    from megatron_sparse_rl.rewards import make_scorer

    marker = run.data.answer_marker  # the final answer follows it in a worked response ('' = the whole line)
    score = make_scorer(run.reward, answer_marker=marker)
    correct = make_scorer(run.reward, shaping=False, answer_marker=marker)
    return rollouts_for(run.env, score=score, correct=correct), correct


def _stopped(ctx, why: str, loop: state.LoopState, checkpoint) -> dict:
    """The summary of a run stopped on request (tools/train_cmd.py exits EXIT_STOPPED with it); rank 0 says where
    it stopped and records it for the launcher (logs/stop.json)."""
    where = loop.where()
    if ctx.is_main:
        state.record_stop(ctx, why, where, checkpoint)
        if ctx.writer is not None:  # flushes metrics.jsonl and ends the tracker runs (a resume reopens them)
            ctx.writer.close()
        log.warning("stopped (%s) at %s; %s; run the same command again to resume", why, where,
                    f"checkpoint {checkpoint}" if checkpoint else "no new checkpoint (stopped before the first step)")
    return {"rank": ctx.rank, "stopped": why, "preempted": why.startswith("preemption"), "at": where,
            "checkpoint": str(checkpoint) if checkpoint else None}


def _announce(ctx, loop: state.LoopState) -> None:
    """The start line: which run, where, from which step, on which layout, and where the full log is."""
    if not ctx.is_main:
        return
    lay = ctx.layout
    where = (f"continuing at RL step {loop.rl_step} (SFT step {loop.sft_step})"
             if loop.rl_step or loop.sft_step else "from the start")
    log.info("run %s in %s, %s: %s (%.1fM parameters), %d RL steps, learner TP%d PP%d%s EP%d DP%d%s; full log: %s",
             ctx.owner.run_id[:8], ctx.run_dir, where, ctx.spec.architecture, ctx.spec.parameter_count() / 1e6,
             ctx.run.trainer.steps, lay.tp, lay.pp, f" CP{lay.cp}" if lay.cp > 1 else "", lay.ep, lay.dp,
             (f" (pipeline {lay.stages(ctx.spec.num_layers).describe()})" if lay.pp > 1 else "")
             + (f" + {lay.rollout_ranks} rollout ranks" if lay.rollout_ranks else "")
             + (f", asynchronous (trainer.max_staleness {ctx.run.trainer.max_staleness}: up to that many batches "
                "sampled ahead while this one trains)" if ctx.run.trainer.max_staleness else "") + _lora_note(ctx),
             ctx.run_dir / "logs")


def _lora_note(ctx) -> str:
    """'; LoRA rank 4, 5,120 adapter parameters train (the base frozen), syncs after ...' for a LoRA learner (its own
    count), else ''."""
    adapters = ctx.learner.lora_params
    if not adapters:
        return ""
    count = adapter_count(adapters, ctx.learner.groups.tp)  # whole at any tp; this (first) stage's at pp > 1
    stage = " on pipeline stage 0" if ctx.layout.pp > 1 else ""
    return (f"; LoRA rank {ctx.learner.lora.rank}, {count:,} adapter parameters{stage} "
            "train (the base frozen), syncs after the first send the adapted tensors alone")


def sft_stage(ctx, correct, loop: state.LoopState, report, probe, stops: StopSignals) -> str | None:
    """Supervised warm-start until `trainer.sft.max_steps` or the target held-out accuracy; returns why it stopped
    early on request (a stop signal, checked after every step), else None."""
    cfg = ctx.run.trainer.sft
    while loop.sft_step < cfg.max_steps:
        metrics = S.sft_step(ctx, loop.sft_step + 1)
        loop.sft_step += 1
        if loop.sft_step % cfg.eval_every == 0 or loop.sft_step == cfg.max_steps:
            metrics.update(S.sync_step(ctx, loop.syncs, probe))
            loop.syncs += 1
            metrics["eval/accuracy"] = S.evaluate(ctx, correct, ctx.run.trainer.eval_prompts)
            report.scalars(metrics, step=loop.sft_step, phase="sft")
            if cfg.target_accuracy and metrics["eval/accuracy"] >= cfg.target_accuracy:
                break
        why = state.stop_requested(ctx, stops, preemption=False)  # the preemption file: after RL steps
        if why:
            return why
    loop.sft_done = True
    report.scalars(S.sync_step(ctx, loop.syncs, probe), step=loop.sft_step, phase="sync")
    loop.syncs += 1
    return None
