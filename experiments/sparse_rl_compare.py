"""Dense RL vs naive sparse RL vs Sparse-RL over several seeds, with every final model evaluated under a dense and
two sparse engines ("Sparse-RL evidence that holds up", item 2). Small scale, CPU.

Per seed s (0 .. --seeds - 1) every run is a real `msrl train` (the trainer's `train(load_config(...))`, Megatron-Core
learner, vLLM engine) of --config (default configs/sparse_rl_compare.yaml):
  0. warm start: model.tiny built with seed s (or the config's model.path), then --sft-steps SFT steps (dense
     engine; with --sft-target A it stops once held-out accuracy reaches A), exported to
     OUT/seed<s>/warm_start/hf_final (--sft-steps 0: the model itself); shared by the seed's
     three arms;
  1. dense:        rollout.kv.policy=none (full KV cache), no correction;
  2. naive_sparse: the config's sparse rollout.kv engine, no correction (samples from the sparse sampler mu, ratio
                   pi_theta / pi_old with pi_old the learner's dense recompute; nothing corrects mu != pi_old);
  3. sparse_rl:    the same engine + algorithm.corrections.sparse_rl (rejection + reweighting).
Seed s adds s to model.tiny.seed, learner.seed, rollout.seed (sampling, evaluation) and data.seed (prompt order)
of the config; data.arithmetic.seed (data.chain.seed) stays, so the held-out problems are the same for every seed.
Then each final model is evaluated on the held-out prompts, in this process, by three vLLM engines, each started
once and given every model's weights in turn (`RolloutEngine.load_weights` from its hf_final): "dense"
(rollout.kv.policy=none: the dense arm's engine), "sparse" (the config's rollout.kv: the sparse arms' engine),
"tight" (the same at --tight-budget, default half the budget, raised to the config's minimum). Each evaluation
calls training/rollout.py `accuracy` with the arguments `msrl train`'s evaluation uses; the run's own in-run final
evaluation must match the engine-only one of its own engine exactly (summary "checks").
Collapse (per run): the trailing mean of rollout/reward over --window steps falls more than --collapse-drop
below its best, or a step's train/grad_norm exceeds --grad-blowup x the run's median, or a reward, grad norm or
loss is NaN/inf (sparse_rl_compare_stats.py).

The runs share this process (one Python, vLLM and Megatron start-up for all of them: a later run starts in
seconds instead of ~40 s; a run's metrics are identical to a fresh `msrl train` of the same config). Each run's
console goes to OUT/logs/seed<s>_<arm>.log, its full log to its run directory. Writes OUT/compare.png,
OUT/summary.json and OUT/summary.md (mean ± standard error over seeds per arm, paired per-seed differences,
per-run rows, collapse flags, runtime), atomically.

    .venv/bin/python experiments/sparse_rl_compare.py --seeds 3 --out runs/sparse_rl_compare     (documented run)
    .venv/bin/python experiments/sparse_rl_compare.py --quick --out /tmp/x          (smoke: 2 seeds x 3 arms x 2 steps)
    .venv/bin/python experiments/sparse_rl_compare.py --config configs/sparse_rl_scratchpad.yaml --seeds 3 ...
Extra `--set a.b=v ...` overrides go to every run (the arms' own settings win over them).
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import sparse_rl_compare_stats as S  # noqa: E402  (this directory is on sys.path: script or tests)

CONFIG = REPO / "configs" / "sparse_rl_compare.yaml"
OFF = "algorithm.corrections.sparse_rl.enabled=false"
# (name, label, overrides); the sparse arms keep the config's rollout.kv section
ARMS = (
    ("dense", "dense RL (full KV)", ("rollout.kv.policy=none", OFF)),
    ("naive_sparse", "naive sparse RL (no correction)", (OFF,)),
    ("sparse_rl", "Sparse-RL (rejection + reweighting)", ("algorithm.corrections.sparse_rl.enabled=true",)),
)
LABELS = {name: label for name, label, _ in ARMS}
PAIRS = [("sparse_rl", "naive_sparse"), ("sparse_rl", "dense"), ("naive_sparse", "dense")]
PAIRED_KEYS = ["eval_dense", "eval_sparse", "eval_tight", "drop_sparse", "drop_tight", "reward_last"]
# defaults of the documented run and of --quick (explicit flags win over both)
FULL = {"seeds": 3, "steps": 100, "sft_steps": 300, "prompts_per_step": None, "eval_prompts": None}
QUICK = {"seeds": 2, "steps": 2, "sft_steps": 0, "prompts_per_step": 4, "eval_prompts": 4}
QUICK_SETS = ("rollout.sampling.n=4",)


@dataclasses.dataclass(frozen=True)
class Job:
    """One `msrl train` run: its name (seed<s>/<arm>), run directory and overrides."""

    name: str
    seed: int
    arm: str
    run_dir: Path
    sets: tuple[str, ...]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=CONFIG, help="base config (default configs/sparse_rl_compare.yaml)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "sparse_rl_compare", help="output directory")
    p.add_argument("--seeds", type=int, help=f"seeds per arm (default {FULL['seeds']}; --quick {QUICK['seeds']})")
    p.add_argument("--steps", type=int, help=f"RL steps per run (default {FULL['steps']})")
    p.add_argument("--sft-steps", type=int,
                   help=f"SFT warm-start steps per seed (default {FULL['sft_steps']}; 0: the tiny random model)")
    p.add_argument("--sft-target", type=float, default=0.0,
                   help="stop a seed's SFT warm start once its held-out accuracy (dense engine, checked every "
                        "trainer.sft.eval_every steps) reaches this, so that seeds start RL from comparable models "
                        "(default 0: run all --sft-steps)")
    p.add_argument("--prompts-per-step", type=int, help="override trainer.prompts_per_step")
    p.add_argument("--eval-prompts", type=int, help="override trainer.eval_prompts (in-run and engine-only evaluation)")
    p.add_argument("--tight-budget", type=int, help="KV budget of the tight sparse evaluation (default: half the "
                   "config's rollout.kv.budget, at least what the config's rules allow)")
    p.add_argument("--window", type=int, default=10, help="steps of the reward means and the collapse rule")
    p.add_argument("--collapse-drop", type=float, default=0.15, help="reward fall below the best that flags collapse")
    p.add_argument("--grad-blowup", type=float, default=10.0, help="grad norm / its median that flags collapse")
    p.add_argument("--reuse-warm-start", action="store_true", help="reuse OUT/seed<s>/warm_start (or model) if present")
    p.add_argument("--quick", action="store_true", help="smoke: 2 seeds x 3 arms x 2 steps, no SFT, 4 eval prompts")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="A.B=V")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for flag, value, low in (("--seeds", args.seeds, 1), ("--steps", args.steps, 1), ("--sft-steps", args.sft_steps, 0),
                             ("--window", args.window, 1)):
        if value < low:
            p.error(f"{flag} must be >= {low} (got {value})")
    if not 0.0 <= args.sft_target <= 1.0:
        p.error(f"--sft-target must be in [0, 1] (got {args.sft_target})")
    args.error = p.error
    return args


def tight_budget(kv, requested: int | None) -> int:
    """The tight evaluation budget: `requested`, or half of kv.budget raised to the least the config's rules allow
    (budget >= window; >= sinks + window for streamingllm). ValueError when it is not below kv.budget or breaks those
    rules."""
    if requested is None:
        least = kv.window + (kv.sinks if kv.policy == "streamingllm" else 0)
        requested = max(kv.budget // 2, least)
        if requested >= kv.budget:
            raise ValueError(f"no budget below rollout.kv.budget={kv.budget} is valid for {kv.policy} with window "
                             f"{kv.window}: pass --tight-budget or lower rollout.kv.window")
    if requested >= kv.budget:
        raise ValueError(f"--tight-budget {requested} must be below the training budget rollout.kv.budget={kv.budget}")
    try:
        dataclasses.replace(kv, budget=requested)  # KVConfig.__post_init__: the config's own rules
    except ValueError as e:
        raise ValueError(f"--tight-budget {requested}: {e}") from None
    return requested


def plan(args, base) -> dict[int, list[Job]]:
    """Per seed: [warm start (when --sft-steps > 0), dense, naive_sparse, sparse_rl]."""
    common = list(QUICK_SETS if args.quick else ())
    common += [f"trainer.prompts_per_step={args.prompts_per_step}"] if args.prompts_per_step else []
    common += [f"trainer.eval_prompts={args.eval_prompts}"] if args.eval_prompts else []
    common = ["trainer.eval_every=0", *common, *args.overrides]  # in-run: only before and after RL
    tiny = base.model.tiny is not None
    jobs = {}
    for s in range(args.seeds):
        seed_dir = args.out / f"seed{s}"
        seeds = [f"rollout.seed={base.rollout.seed + s}", f"data.seed={base.data.seed + s}",
                 f"learner.seed={base.learner.seed + s}", *([f"model.tiny.seed={base.model.tiny.seed + s}"] * tiny)]
        model = seed_dir / "model" if tiny else Path(base.model.path)
        warm, jobs[s] = model, []
        if args.sft_steps:
            warm = seed_dir / "warm_start" / "hf_final"
            jobs[s].append(Job(f"seed{s}/warm_start", s, "warm_start", seed_dir / "warm_start", (
                *common, *seeds, f"model.path={model}", "trainer.steps=0", f"trainer.sft.max_steps={args.sft_steps}",
                f"trainer.sft.target_accuracy={args.sft_target}", "rollout.kv.policy=none", OFF)))
        for name, _, sets in ARMS:
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
    if args.reuse_warm_start:
        if args.sft_steps and (jobs[0].run_dir / "hf_final" / "config.json").is_file():
            return jobs[1:]
        if not args.sft_steps and (Path(model.path) / "config.json").is_file():
            return jobs
    if model.tiny is not None:  # OUT/seed<s>/model: rebuilt from model.tiny with this seed by the first run
        shutil.rmtree(model.path, ignore_errors=True)
    return jobs


def train_all(args, jobs: dict[int, list[Job]], configs: dict, say) -> tuple[list[dict], dict, dict]:
    """Run every job; (per-run rows, {arm: [metrics records per seed]}, seconds of warm starts and RL runs)."""
    from megatron_sparse_rl.observability.metrics import read_metrics

    rows, records, timing = [], {a: [] for a in LABELS}, {"warm_start": 0.0, "rl": 0.0}
    for s in jobs:
        todo = seed_jobs_to_run(args, jobs[s], configs)
        if todo[0] is not jobs[s][0]:
            say(f"{jobs[s][0].name}: reusing {jobs[s][0].run_dir / 'hf_final'}")
        for job in todo:
            warm = job.arm == "warm_start"
            say(f"{job.name}: " + (f"{args.sft_steps} SFT steps" if warm else f"{args.steps} RL steps"))
            seconds = run_job(args.config, job, args.out / "logs" / f"{job.name.replace('/', '_')}.log")
            timing["warm_start" if warm else "rl"] += seconds
            if warm:
                say(f"    done in {seconds:.0f} s")
                continue
            recs = read_metrics(job.run_dir / "metrics.jsonl")
            row = {"seed": s, "arm": job.arm, "run_dir": str(job.run_dir), "train_seconds": round(seconds, 1),
                   **S.run_metrics(recs, window=args.window, drop=args.collapse_drop, blowup=args.grad_blowup)}
            records[job.arm].append(recs)
            rows.append(row)
            say(f"    done in {seconds:.0f} s: reward last {S.fmt(row['reward_last'])}, k1 {S.fmt(row['mismatch_k1'])}"
                f", rejected {S.fmt(row['rejected_seq_frac'])}" + (" COLLAPSED" if row["collapsed"] else ""))
    return rows, records, timing


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_sparse_rl.config import load_config

    t_start = time.perf_counter()
    args.out, args.config = args.out.resolve(), args.config.resolve()
    try:  # every config error before anything runs
        base = load_config(args.config, args.overrides)
        if base.rollout.kv.policy == "none":
            raise ValueError("the sparse arms need a sparse rollout.kv.policy (the config has none)")
        tight = tight_budget(base.rollout.kv, args.tight_budget)
        jobs = plan(args, base)
        configs = {j.name: load_config(args.config, j.sets) for js in jobs.values() for j in js}
        rollouts = {"dense": configs["seed0/dense"].rollout, "sparse": configs["seed0/sparse_rl"].rollout,
                    "tight": load_config(args.config, [*jobs[0][-1].sets, f"rollout.kv.budget={tight}"]).rollout}
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        args.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    kv, say = base.rollout.kv, Console()
    say(f"{args.seeds} seed(s) x {len(ARMS)} arms x {args.steps} RL steps ({args.sft_steps} SFT steps per seed) of "
        f"{args.config}; sparse engine {kv.policy} budget {kv.budget}, tight budget {tight}; out {args.out}")
    try:
        rows, records, timing = train_all(args, jobs, configs, say)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    from sparse_rl_compare_eval import Target, evaluate

    targets = [Target(r["seed"], r["arm"], Path(r["run_dir"]) / "hf_final", configs[f"seed{r['seed']}/{r['arm']}"])
               for r in rows]
    t_eval = time.perf_counter()
    with console_to(args.out / "logs" / "eval.log"):
        evals, starts = evaluate(targets, rollouts, args.out / "eval" / "vllm_cache", say)
    timing["eval"] = time.perf_counter() - t_eval
    write_outputs(args, base, tight, rows, records, evals, starts, timing, t_start)
    return 0


def write_outputs(args, base, tight, rows, records, evals, starts, timing, t_start) -> None:
    """compare.png, summary.json and summary.md (atomically); summary.md also to the console."""
    import json

    from sparse_rl_compare_plot import plot

    accuracy = {}
    for e in evals:
        accuracy.setdefault((e["seed"], e["arm"]), {})[e["mode"]] = e["accuracy"]
    rows = [S.add_eval(r, accuracy.get((r["seed"], r["arm"]), {})) for r in rows]
    summary = summarize(args, base, tight, rows, evals, starts, timing)
    summary["plot"] = str(plot(summary, records, LABELS, args.window, args.out / "compare.png"))
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    diff = summary["checks"]["own_engine_final_vs_engine_only_max_abs_diff"]
    if diff:
        print(f"warning: an in-run final evaluation differs from the engine-only one of its engine by {diff:.4f} "
              "(summary.json checks)", file=sys.stderr)
    S.write_atomic(args.out / "summary.json", json.dumps(summary, indent=2))
    S.write_atomic(args.out / "summary.md", S.render_markdown(summary))
    print(S.render_markdown(summary), flush=True)


def _avg(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize(args, base, tight: int, rows: list[dict], evals: list[dict], starts: dict, timing: dict) -> dict:
    """summary.json (without the plot path and the total time)."""
    kv, arms = base.rollout.kv, list(LABELS)
    own = {"dense": "eval_dense", "naive_sparse": "eval_sparse", "sparse_rl": "eval_sparse"}
    diffs = [abs(r["eval_own_final"] - r[own[r["arm"]]]) for r in rows
             if r["eval_own_final"] is not None and r[own[r["arm"]]] is not None]
    per_eval = [e["seconds"] for e in evals]
    setup = (f"{args.config.name}: {args.seeds} seed(s) per arm, {args.steps} RL steps per run after a "
             f"{args.sft_steps}-step SFT warm start per seed"
             + (f" (stopped once held-out accuracy reached {args.sft_target})" if args.sft_target else "")
             + f" (shared by its three arms); sparse arms: rollout.kv "
             f"policy={kv.policy} budget={kv.budget} window={kv.window} interval={kv.interval}; evaluation engines: "
             f"dense, sparse at budget {kv.budget}, tight at budget {tight}; "
             f"extra overrides: {' '.join(args.overrides) or 'none'}")
    return {
        "title": f"dense vs naive sparse vs Sparse-RL ({args.config.name}, {kv.policy} budget {kv.budget}, "
                 f"{args.seeds} seed(s))",
        "setup": setup, "config": str(args.config), "seeds": args.seeds, "steps": args.steps,
        "sft_steps": args.sft_steps, "sft_target": args.sft_target, "window": args.window, "overrides": args.overrides,
        "kv": {"policy": kv.policy, "budget": kv.budget, "tight_budget": tight, "window": kv.window,
               "interval": kv.interval},
        "arms": arms, "labels": LABELS, "eval_modes": list(S.EVAL_MODES),
        "eval_mode_labels": {"dense": "dense engine", "sparse": f"{kv.policy} budget {kv.budget}",
                             "tight": f"{kv.policy} budget {tight}"},
        "collapse_rule": (f"A run collapsed when the mean of rollout/reward over {args.window} steps fell more than "
                          f"{args.collapse_drop} below its best earlier value, a step's train/grad_norm exceeded "
                          f"{args.grad_blowup}x the run's median, or a reward, grad norm or loss was NaN/inf."),
        "per_arm": S.aggregate(rows, arms),
        "paired": S.paired(rows, PAIRS, PAIRED_KEYS),
        "runs": rows,
        "evals": evals,
        "checks": {"own_engine_final_vs_engine_only_max_abs_diff": max(diffs) if diffs else None,
                   "note": "in-run final evaluation (own engine, synced weights) vs the engine-only evaluation of "
                           "the same engine kind from hf_final: equal when the evaluation is reproduced exactly"},
        "timing": {"warm_start_s": round(timing["warm_start"], 1), "rl_s": round(timing["rl"], 1),
                   "eval_s": round(timing["eval"], 1), "eval_engine_start_s": starts,
                   "eval_mean_s": round(_avg(per_eval), 2)},
        "runtime": (f"warm starts {timing['warm_start']:.0f} s, RL runs {timing['rl']:.0f} s, evaluation "
                    f"{timing['eval']:.0f} s: {len(evals)} evaluations of {_avg(per_eval):.1f} s on average after "
                    f"{len(starts)} engine starts of {_avg(list(starts.values())):.1f} s"),
    }


if __name__ == "__main__":
    sys.exit(main())
