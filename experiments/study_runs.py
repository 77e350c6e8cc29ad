"""The harness shared by the experiments that train arms x seeds in one process (experiments/sparse_rl_compare.py,
experiments/routing_stability.py): their common command-line flags, the plan of runs (per seed a shared SFT warm
start, then every arm from it), and running each as a real `msrl train` (the trainer's `train(load_config(...))`)
in this process with its console in a log file.

Seed s adds s to model.tiny.seed, learner.seed, rollout.seed (sampling, evaluation) and data.seed (prompt order) of
the config; the task's own seed (data.arithmetic.seed, data.chain.seed) stays, so the held-out problems are the same
for every seed. The runs share this process (one Python, vLLM and Megatron start-up for all of them: a later run
starts in seconds instead of ~40 s; a run's metrics are identical to a fresh `msrl train` of the same config).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

WARM_START = "warm_start"


@dataclasses.dataclass(frozen=True)
class Job:
    """One `msrl train` run: its name (seed<s>/<arm>), run directory and overrides."""

    name: str
    seed: int
    arm: str
    run_dir: Path
    sets: tuple[str, ...]


def add_run_args(p: argparse.ArgumentParser, full: dict, quick: dict) -> None:
    """The flags every study has; `full` and `quick` hold the defaults of the documented run and of --quick (None:
    the config's own value)."""
    p.add_argument("--seeds", type=int, help=f"seeds per arm (default {full['seeds']}; --quick {quick['seeds']})")
    p.add_argument("--steps", type=int, help=f"RL steps per run (default {full['steps']}; --quick {quick['steps']})")
    def default(key: str, field: str) -> str:
        return f"default {full[key]}" if full[key] is not None else f"default: the config's {field}"

    sft_steps = default("sft_steps", "trainer.sft.max_steps")
    p.add_argument("--sft-steps", type=int, help=f"SFT warm-start steps per seed ({sft_steps}; 0: no warm start, the "
                   "tiny random model)")
    p.add_argument("--sft-target", type=float, help="stop a seed's SFT warm start once its held-out accuracy (checked "
                   "every trainer.sft.eval_every steps) reaches this, so that seeds start RL from comparable models "
                   f"({default('sft_target', 'trainer.sft.target_accuracy')}; 0: run all the SFT steps)")
    p.add_argument("--sft-kv-keep", action="store_true", help="sparsity-aware warm start: the SFT trains under the "
                   "keep sets the config's own rollout.kv engine would make (trainer.sft.kv_keep.enabled, "
                   "docs/sparse_kv.md), so the warm start runs with that engine, not a dense one, and --sft-target "
                   "reads its held-out accuracy under it")
    p.add_argument("--prompts-per-step", type=int, help="override trainer.prompts_per_step")
    p.add_argument("--eval-prompts", type=int, help="override trainer.eval_prompts")
    p.add_argument("--reuse-warm-start", action="store_true", help="reuse OUT/seed<s>/warm_start (or model) if present")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="A.B=V",
                   help="overrides of every run (the arms' own settings win over them)")


def finish_args(p: argparse.ArgumentParser, args: argparse.Namespace, full: dict, quick: dict) -> None:
    """Fill the flags left unset from --quick's or the documented run's defaults and check them (p.error)."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for flag, value, low in (("--seeds", args.seeds, 1), ("--steps", args.steps, 1), ("--sft-steps", args.sft_steps, 0)):
        if value is not None and value < low:
            p.error(f"{flag} must be >= {low} (got {value})")
    if args.sft_target is not None and not 0.0 <= args.sft_target <= 1.0:
        p.error(f"--sft-target must be in [0, 1] (got {args.sft_target})")
    args.error = p.error


def common_sets(args, quick_sets: tuple[str, ...] = ()) -> list[str]:
    """Overrides of every run: --quick's, the flags', then --set."""
    sets = list(quick_sets if args.quick else ())
    sets += [f"trainer.prompts_per_step={args.prompts_per_step}"] if args.prompts_per_step else []
    sets += [f"trainer.eval_prompts={args.eval_prompts}"] if args.eval_prompts else []
    return [*sets, *args.overrides]


def plan(args, base, arms: list[tuple[str, tuple[str, ...]]], common: list[str],
         warm_sets: tuple[str, ...] = ()) -> dict[int, list[Job]]:
    """Per seed: [warm start (unless it has no SFT step), then every (arm, overrides) of `arms` from it]. With
    --sft-kv-keep the warm start keeps the config's rollout.kv (`warm_sets`' rollout.kv.policy dropped) and trains
    under its keep sets."""
    if getattr(args, "sft_kv_keep", False):
        warm_sets = (*(s for s in warm_sets if not s.startswith("rollout.kv.policy=")),
                     "trainer.sft.kv_keep.enabled=true")
    tiny = base.model.tiny is not None
    sft_steps = base.trainer.sft.max_steps if args.sft_steps is None else args.sft_steps
    sft = [f"trainer.sft.max_steps={args.sft_steps}"] * (args.sft_steps is not None)
    sft += [f"trainer.sft.target_accuracy={args.sft_target}"] * (args.sft_target is not None)
    jobs = {}
    for s in range(args.seeds):
        seed_dir = args.out / f"seed{s}"
        seeds = [f"rollout.seed={base.rollout.seed + s}", f"data.seed={base.data.seed + s}",
                 f"learner.seed={base.learner.seed + s}", *([f"model.tiny.seed={base.model.tiny.seed + s}"] * tiny)]
        model = seed_dir / "model" if tiny else Path(base.model.path)
        warm, jobs[s] = model, []
        if sft_steps:
            warm = seed_dir / WARM_START / "hf_final"
            jobs[s].append(Job(f"seed{s}/{WARM_START}", s, WARM_START, seed_dir / WARM_START, (
                *common, *seeds, f"model.path={model}", "trainer.steps=0", *sft, *warm_sets)))
        for name, sets in arms:
            jobs[s].append(Job(f"seed{s}/{name}", s, name, seed_dir / name, (
                *common, *seeds, f"model.path={warm}", "trainer.sft.max_steps=0", f"trainer.steps={args.steps}",
                *sets)))
    return jobs


@contextlib.contextmanager
def console_to(path: Path):
    """Send this process's stdout and stderr (file descriptors 1 and 2: vLLM's C++ lines too) to `path` meanwhile;
    afterwards detach the run's log files from the root logger (each run attaches its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(path, "a") as log:
            for fd in (1, 2):
                os.dup2(log.fileno(), fd)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        root = logging.getLogger()
        for h in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
            root.removeHandler(h)
            h.close()


def run_job(config: Path, job: Job, log: Path) -> float:
    """One training run in this process; its wall time. Raises with the log's tail when it fails."""
    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.trainer import train

    shutil.rmtree(job.run_dir, ignore_errors=True)  # a stale checkpoint there would be resumed
    t0 = time.perf_counter()
    try:
        with console_to(log):
            train(load_config(config, [f"logging.dir={job.run_dir}", *job.sets]))
    except Exception as e:
        raise RuntimeError(f"{job.name} failed ({e!r}); see {log}:\n{log.read_text()[-3000:]}") from e
    return time.perf_counter() - t0


class Console:
    """Progress lines on the terminal this process started with, also while `console_to` redirects fds 1 and 2."""

    def __init__(self):
        self._out = os.fdopen(os.dup(1), "w", buffering=1)

    def __call__(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=self._out, flush=True)


def seed_jobs_to_run(args, jobs: list[Job], configs: dict) -> list[Job]:
    """A seed's jobs, less a warm start --reuse-warm-start keeps; removes a tiny model a fresh start rebuilds."""
    model = configs[jobs[0].name].model  # the seed's base model: the warm start's (or, without SFT, the arms')
    warm = jobs[0].arm == WARM_START
    if args.reuse_warm_start:
        if warm and (jobs[0].run_dir / "hf_final" / "config.json").is_file():
            return jobs[1:]
        if not warm and (Path(model.path) / "config.json").is_file():
            return jobs
    if model.tiny is not None:  # OUT/seed<s>/model: rebuilt from model.tiny with this seed by the first run
        shutil.rmtree(model.path, ignore_errors=True)
    return jobs


RunRow = Callable[[list[dict]], dict]
"""A study's per-run numbers from one run's metrics records."""


def train_all(args, jobs: dict[int, list[Job]], configs: dict, say, run_row: RunRow,
              describe: Callable[[dict], str]) -> tuple[list[dict], dict, dict]:
    """Run every job; (per-run rows: seed, arm, run_dir, train_seconds and `run_row`'s numbers; {arm: [metrics records
    per seed]}; seconds of warm starts and RL runs). `describe(row)` ends a run's progress line."""
    from megatron_sparse_rl.observability.metrics import read_metrics

    rows, records, timing = [], {}, {"warm_start": 0.0, "rl": 0.0}
    for s in jobs:
        todo = seed_jobs_to_run(args, jobs[s], configs)
        if todo[0] is not jobs[s][0]:
            say(f"{jobs[s][0].name}: reusing {jobs[s][0].run_dir / 'hf_final'}")
        for job in todo:
            warm = job.arm == WARM_START
            sft_steps = configs[job.name].trainer.sft.max_steps
            say(f"{job.name}: " + (f"{sft_steps} SFT steps" if warm else f"{args.steps} RL steps"))
            seconds = run_job(args.config, job, args.out / "logs" / f"{job.name.replace('/', '_')}.log")
            timing["warm_start" if warm else "rl"] += seconds
            if warm:
                say(f"    done in {seconds:.0f} s")
                continue
            recs = read_metrics(job.run_dir / "metrics.jsonl")
            row = {"seed": s, "arm": job.arm, "run_dir": str(job.run_dir), "train_seconds": round(seconds, 1),
                   **run_row(recs)}
            records.setdefault(job.arm, []).append(recs)
            rows.append(row)
            say(f"    done in {seconds:.0f} s: {describe(row)}" + (" COLLAPSED" if row["collapsed"] else ""))
    return rows, records, timing


def train_and_evaluate(args, jobs: dict[int, list[Job]], configs: dict, rollouts: dict, say, run_metrics,
                       describe: Callable[[dict], str]):
    """`train_all` (each run's row from `run_metrics(records, window=, drop=, blowup=)` of the command line's
    --window, --collapse-drop, --grad-blowup), then every run's final model evaluated under each engine of `rollouts`
    (experiments/sparse_rl_compare_eval.py): (rows, records, evals, starts, timing), or None when a run failed (its
    error printed)."""
    try:
        rows, records, timing = train_all(args, jobs, configs, say, lambda recs: run_metrics(
            recs, window=args.window, drop=args.collapse_drop, blowup=args.grad_blowup), describe)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return None
    from sparse_rl_compare_eval import Target, evaluate

    targets = [Target(r["seed"], r["arm"], Path(r["run_dir"]) / "hf_final", configs[f"seed{r['seed']}/{r['arm']}"])
               for r in rows]
    t_eval = time.perf_counter()
    with console_to(args.out / "logs" / "eval.log"):
        evals, starts = evaluate(targets, rollouts, args.out / "eval" / "vllm_cache", say)
    timing["eval"] = time.perf_counter() - t_eval
    return rows, records, evals, starts, timing
