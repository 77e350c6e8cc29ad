"""Asynchronous RL against the synchronous loop: the same run with trainer.max_staleness 0 and each k of
--staleness (default 0, 1, 2 and 4).

    msrl bench async [--config configs/async_tiny_moe.yaml --steps 16 --staleness 0,1,2,4 --set KEY=VALUE ...]
    .venv/bin/python benchmarks/async_rl.py [same options]

Each run is `msrl launch local CONFIG --nproc 2` on one learner rank + one rollout rank (launch.rollout_ranks 1),
the same model, seeds, SFT warm-start and prompts; only trainer.max_staleness differs. From each run's
metrics.jsonl, over the RL steps after the first (the first step of a run cannot overlap anything) and before the
last (which also evaluates):
- steps/s from the records' wall-clock times, and `async/sync steps/s = X`;
- per-phase seconds per role: the learner rank trains, syncs and waits for its batch (synchronous: the whole
  rollout; asynchronous: what the rollout rank had not finished when training and sync were done); the rollout rank
  generates, loads weights and idles (synchronous: while the learner trains and syncs; asynchronous: waiting for
  the weights after it finished sampling);
- how the runs learn: mean reward over the last five RL steps and held-out accuracy at the end (a fixed short run:
  they should agree within the run-to-run noise; a batch sampled k versions behind is an off-policy batch);
- one table, a row per k: s/step, steps/s over k = 0's, the phases, the staleness of the trained tokens, learning.
The config should make generation and training take comparable time (the overlap can at best hide the shorter
of the two); `configs/async_tiny_moe.yaml` is sized for that on a 2-core CPU machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_sparse_rl.config.checks import positive

REPO = Path(__file__).resolve().parents[1]
LAST = 5  # RL steps whose mean reward is printed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(REPO / "configs" / "async_tiny_moe.yaml"))
    p.add_argument("--steps", type=positive(), default=16, help="RL steps per run (>= 4)")
    p.add_argument("--staleness", type=_ks, default=(0, 1, 2, 4),
                   help="comma-separated trainer.max_staleness values to run; 0 (the baseline) is always run")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    p.add_argument("--timeout", type=positive(), default=1800, help="seconds before a run is killed")


def _ks(text: str) -> tuple[int, ...]:
    """--staleness: 0 first, then the others in order, each in [0, MAX_STALENESS]."""
    from megatron_sparse_rl.config.trainer import MAX_STALENESS

    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--staleness takes comma-separated integers (got {text!r})") from None
    if any(not 0 <= k <= MAX_STALENESS for k in ks):
        raise argparse.ArgumentTypeError(f"--staleness values must be in [0, {MAX_STALENESS}] (got {text!r})")
    return (0, *sorted(set(ks) - {0}))


def _launch(args, tmp: Path, staleness: int) -> list[dict]:
    run_dir = tmp / f"max_staleness_{staleness}"
    sets = [f"logging.dir={run_dir}", f"model.path={tmp / 'model'}", "launch.rollout_ranks=1",
            f"trainer.max_staleness={staleness}", f"trainer.steps={args.steps}", "trainer.eval_every=0",
            "checkpoint.save_every=0", "logging.tensorboard=false", *args.set]
    cmd = [sys.executable, "-m", "megatron_sparse_rl.tools.cli", "launch", "local", args.config, "--nproc", "2",
           "--set", *sets]
    print(f"running trainer.max_staleness={staleness} ({args.steps} RL steps) ...", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"error: the max_staleness={staleness} run failed (exit {proc.returncode}); its log: "
                         f"{run_dir / 'logs'}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarise(records: list[dict]) -> dict[str, float]:
    """Steps/s and mean per-phase seconds over the RL steps after the first and before the last; the learning
    numbers of the whole run."""
    rl = sorted((r for r in records if r["phase"] == "rl"), key=lambda r: r["step"])
    middle = rl[1:-1]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in middle)  # noqa: E731
    train, sync, generate = mean("time/train_s"), mean("time/sync_s"), mean("time/rollout_s")
    asynchronous = "async/learner_wait_s" in middle[-1]
    return {
        "steps_per_s": (len(middle) - 1) / (middle[-1]["time"] - middle[0]["time"]),
        "train_s": train, "sync_s": sync, "generate_s": generate,
        "learner_wait_s": mean("async/learner_wait_s") if asynchronous else generate,
        "load_s": mean("async/engine_load_s"),
        "rollout_idle_s": mean("async/engine_wait_s") if asynchronous else train + sync,
        "in_flight": mean("async/in_flight_update"), "stale_frac": mean("async/stale_frac"),
        "staleness_mean": mean("async/staleness_mean"),
        "staleness_max": max((r.get("async/staleness_max", 0.0) for r in middle), default=0.0),
        "reward_last": statistics.fmean(r["rollout/reward"] for r in rl[-LAST:]),
        "accuracy": rl[-1].get("eval/accuracy", float("nan")),
    }


HEADER = ("k", "s/step", "x k=0", "train", "sync", "learner wait", "generate", "load", "rollout idle", "in flight",
          "stale mean", "stale max", f"reward last {LAST}", "accuracy")


def _row(k: int, s: dict[str, float], base: dict[str, float]) -> tuple:
    return (k, f"{1 / s['steps_per_s']:.3f}", f"{s['steps_per_s'] / base['steps_per_s']:.2f}", *(
        f"{s[key]:.3f}" for key in ("train_s", "sync_s", "learner_wait_s", "generate_s", "load_s", "rollout_idle_s")),
        f"{s['in_flight']:.0%}", f"{s['staleness_mean']:.2f}", f"{s['staleness_max']:.0f}",
        f"{s['reward_last']:.3f}", f"{s['accuracy']:.3f}")


def run(args: argparse.Namespace) -> int:
    if args.steps < 4:
        raise SystemExit(f"error: --steps must be >= 4 (the first and last steps are not timed; got {args.steps})")
    tmp = Path(tempfile.mkdtemp(prefix="msrl_bench_async_"))  # kept when a run fails: its logs are there
    runs = {k: summarise(_launch(args, tmp, k)) for k in args.staleness}
    shutil.rmtree(tmp, ignore_errors=True)
    rows = [HEADER, *(_row(k, s, runs[0]) for k, s in runs.items())]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(HEADER))]
    for r in rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(r, widths)))
    print(f"(seconds per step, mean over RL steps 2..{args.steps - 1}; learner: train, sync, waiting for its batch; "
          f"rollout rank: generate, load weights, idle; stale: versions behind the training version per trained "
          f"token; learning: mean reward of the last {LAST} steps, held-out accuracy at the end)")
    best = max((k for k in runs if k), key=lambda k: runs[k]["steps_per_s"], default=None)
    if best is not None:
        print(f"async/sync steps/s = {runs[best]['steps_per_s'] / runs[0]['steps_per_s']:.2f} "
              f"(best k = {best})")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
