"""The MoE routing-stability study: MiniRL's arms, routing replay R2/R3 and GRPO vs GSPO, arms x seeds in one process.

Issue 32, item 4; docs/routing_stability.md. MiniRL's arms on and off policy, routing replay R2 / R3, and GRPO vs
GSPO with and without R3, over several seeds, on a tiny fine-grained MoE sampled from a bf16 engine
(configs/routing_stability.yaml). Small scale, CPU.

Per seed s, a shared SFT warm start (the config's trainer.sft, or --sft-steps / --sft-target), then every selected
arm (ARMS: name, label, group, overrides of the config) as a real `msrl train` from it, all in this process
(experiments/study_runs.py: seeds, warm start, logs in OUT/logs/seed<s>_<arm>.log). Each run's metrics.jsonl gives
its numbers and per-step curves (routing_stability_stats.py, where the collapse rule is written); the script writes
OUT/summary.json, OUT/summary.md (per arm mean ± standard error over seeds of final and peak held-out accuracy, the
fraction of seeds that collapsed and their collapse step, paired per-seed differences of each arm against its
reference, per-run rows), OUT/plots/<group>.png (bands over seeds) and OUT/plots/runs.png (`msrl compare`'s picture
of every run: study_plot.py `runs_png`), atomically.

    .venv/bin/python experiments/routing_stability.py --out runs/routing_stability               (the study)
    .venv/bin/python experiments/routing_stability.py --arms on_policy gspo_vs_grpo --seeds 5 --out ...
    .venv/bin/python experiments/routing_stability.py --quick --out /tmp/rs      (smoke: 2 seeds x 4 arms x 2 steps)
--arms takes arm names and group names (on_policy, off_policy_N2, off_policy_N4, off_policy_N8, gspo_vs_grpo);
extra `--set a.b=v ...` overrides go to every run (the arms' own settings win over them).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import routing_stability_stats as S  # noqa: E402  (this directory is on sys.path: script or tests)
import study_plot as P  # noqa: E402
import study_runs as R  # noqa: E402
import study_stats as T  # noqa: E402

CONFIG = REPO / "configs" / "routing_stability.yaml"


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: overrides of the config, and the arms its paired differences are taken against (reference)."""

    name: str
    label: str
    group: str
    sets: tuple[str, ...]
    reference: tuple[str, ...] = ()


R2, R3 = "routing.mode=R2", "routing.mode=R3"
NO_IS = "algorithm.corrections.tis.enabled=false"
LENGTH_NORM = "algorithm.loss.aggregation=seq_mean_token_mean"
NO_CLIP = ("algorithm.loss.clip_low=1.0", "algorithm.loss.clip_high=1.0e9")
GSPO_N = 4  # the GSPO paper's four mini-batches per rollout batch
# GRPO vs GSPO: both per-response means (the GSPO paper's objectives) and both with the token TIS weight
# min(pi_old/mu, 5) fixed at rollout time (GSPO's gradient carries no token ratio, so tis.ratio=pi_theta is refused)
GSPO_COMMON = (f"trainer.updates_per_rollout={GSPO_N}", LENGTH_NORM, "algorithm.corrections.tis.ratio=pi_old")
GSPO = ("algorithm.loss.name=gspo", "algorithm.loss.clip_low=3.0e-4", "algorithm.loss.clip_high=4.0e-4")


def _off_policy(n: int) -> tuple[Arm, ...]:
    g, upd, base = f"off_policy_N{n}", f"trainer.updates_per_rollout={n}", f"n{n}_noclip"
    return (Arm(base, f"N={n}, no clipping, no replay", g, (upd, *NO_CLIP)),
            Arm(f"n{n}_r2_noclip", f"N={n}, R2 without clipping", g, (upd, *NO_CLIP, R2), (base,)),
            Arm(f"n{n}_r2", f"N={n}, R2", g, (upd, R2), (base,)),
            Arm(f"n{n}_r3", f"N={n}, R3", g, (upd, R3), (base, f"n{n}_r2")))


ARMS: tuple[Arm, ...] = (
    Arm("minirl", "MiniRL", "on_policy", ()),
    Arm("minirl_r3", "MiniRL + R3", "on_policy", (R3,), ("minirl",)),
    Arm("no_is", "MiniRL without the IS weight", "on_policy", (NO_IS,), ("minirl",)),
    Arm("no_is_r3", "MiniRL without the IS weight + R3", "on_policy", (NO_IS, R3), ("no_is",)),
    Arm("length_norm", "MiniRL with length normalisation", "on_policy", (LENGTH_NORM,), ("minirl",)),
    Arm("length_norm_r3", "MiniRL with length normalisation + R3", "on_policy", (LENGTH_NORM, R3), ("length_norm",)),
    *_off_policy(2), *_off_policy(4), *_off_policy(8),
    Arm("grpo", f"GRPO (token ratio), N={GSPO_N}", "gspo_vs_grpo", (*GSPO_COMMON,)),
    Arm("grpo_r3", f"GRPO (token ratio), N={GSPO_N}, R3", "gspo_vs_grpo", (*GSPO_COMMON, R3), ("grpo",)),
    Arm("gspo", f"GSPO, N={GSPO_N}", "gspo_vs_grpo", (*GSPO_COMMON, *GSPO), ("grpo",)),
    Arm("gspo_r3", f"GSPO, N={GSPO_N}, R3", "gspo_vs_grpo", (*GSPO_COMMON, *GSPO, R3), ("gspo", "grpo_r3")),
)
BY_NAME = {a.name: a for a in ARMS}
GROUPS = {g: [a.name for a in ARMS if a.group == g] for g in dict.fromkeys(a.group for a in ARMS)}
QUICK_ARMS = ("minirl", "minirl_r3", "n2_r2_noclip", "gspo")  # on-policy, R3, R2 off-policy unclipped, GSPO
# defaults of the documented run and of --quick (explicit flags win over both); None: the config's value
FULL = {"seeds": 3, "steps": 40, "sft_steps": None, "sft_target": None, "prompts_per_step": None, "eval_prompts": None}
QUICK = {"seeds": 2, "steps": 2, "sft_steps": 0, "sft_target": None, "prompts_per_step": 4, "eval_prompts": 4}
QUICK_SETS = ("rollout.sampling.n=4",)


def select(names: list[str]) -> list[Arm]:
    """The arms named or in the groups named, in ARMS order. ValueError naming the unknown ones and the choices."""
    words = [w for n in names for w in n.split(",") if w]
    unknown = [w for w in words if w not in BY_NAME and w not in GROUPS]
    if unknown:
        raise ValueError(f"--arms: unknown {unknown}; arms: {list(BY_NAME)}; groups: {list(GROUPS)}")
    chosen = {n for w in words for n in GROUPS.get(w, [w])}
    return [a for a in ARMS if a.name in chosen]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=CONFIG, help="base config (default configs/routing_stability.yaml)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "routing_stability", help="output directory")
    p.add_argument("--arms", nargs="+", help=f"arms or groups to run (default all; --quick {' '.join(QUICK_ARMS)}); "
                   f"groups: {', '.join(GROUPS)}")
    R.add_run_args(p, FULL, QUICK)
    p.add_argument("--quick", action="store_true", help=f"smoke: {QUICK['seeds']} seeds x the arms "
                   f"{', '.join(QUICK_ARMS)} x {QUICK['steps']} steps, no SFT, 4 prompts x 4 samples per step")
    args = p.parse_args(argv)
    R.finish_args(p, args, FULL, QUICK)
    try:
        args.arms = select(args.arms or list(QUICK_ARMS if args.quick else BY_NAME))
    except ValueError as e:
        p.error(str(e))
    return args


def pairs(arms: list[Arm]) -> list[tuple[str, str]]:
    """(arm, reference) of every selected arm whose reference is selected too."""
    names = {a.name for a in arms}
    return [(a.name, ref) for a in arms for ref in a.reference if ref in names]


def check_configs(args) -> dict:
    """Every run's config, loaded and validated for one rank before anything runs ({job name: RunConfig})."""
    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.validation import validate

    base = load_config(args.config, args.overrides)
    jobs = R.plan(args, base, [(a.name, a.sets) for a in args.arms], R.common_sets(args, QUICK_SETS))
    configs = {j.name: load_config(args.config, j.sets) for js in jobs.values() for j in js}
    for name, run in configs.items():
        if name.startswith("seed0/"):  # the other seeds differ in seeds only
            validate(run, 1)
    return {"base": base, "jobs": jobs, "configs": configs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    args.out, args.config = args.out.resolve(), args.config.resolve()
    try:  # every config error before anything runs
        plan = check_configs(args)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        args.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    say = R.Console()
    say(f"{args.seeds} seed(s) x {len(args.arms)} arms x {args.steps} RL steps of {args.config}; out {args.out}")
    try:
        rows, records, timing = R.train_all(args, plan["jobs"], plan["configs"], say, S.run_metrics, _describe)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    summary = summarize(args, plan["base"], rows, records, timing)
    from routing_stability_plot import plot_all

    summary["plots"] = plot_all(summary, args.out / "plots")
    summary["plots"]["runs"] = str(P.runs_png(rows, args.out / "plots" / "runs.png"))  # msrl compare's picture
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    T.write_atomic(args.out / "summary.json", json.dumps(summary, indent=2))
    T.write_atomic(args.out / "summary.md", S.render_markdown(summary))
    print(S.render_markdown(summary), flush=True)
    return 0


def _describe(row: dict) -> str:
    return (f"held-out {T.fmt(row['eval_final'])} (peak {T.fmt(row['eval_peak'])}), k3 {T.fmt(row['k3_mean'], 5)}, "
            f"flip rate {T.fmt(row['flip_rate_mean'])}")


def summarize(args, base, rows: list[dict], records: dict, timing: dict) -> dict:
    """summary.json (without the plot paths and the total time)."""
    from megatron_sparse_rl.config.rollout import engine_precision

    arms, tiny = [a.name for a in args.arms], base.model.tiny
    groups = {g: [a for a in names if a in arms] for g, names in GROUPS.items()}
    sft = "no SFT warm start" if args.sft_steps == 0 else "an SFT warm start per seed shared by its arms"
    model = (f"tiny {tiny.arch}: hidden {tiny.hidden}, {tiny.layers} layers, {tiny.experts} experts, top-{tiny.topk}, "
             f"expert ffn {tiny.moe_ffn}" if tiny else base.model.path)
    setup = (f"{args.config.name}: {args.seeds} seed(s) per arm, {args.steps} RL steps per run after {sft}; {model}; "
             f"{engine_precision(base.rollout)} against the learner's fp32; "
             f"{base.trainer.prompts_per_step} prompts x {base.rollout.sampling.n} samples per rollout batch; "
             f"extra overrides: {' '.join(args.overrides) or 'none'}")
    return {
        "title": f"MoE routing stability ({args.config.name}, {args.seeds} seed(s))",
        "setup": setup, "config": str(args.config), "seeds": args.seeds, "steps": args.steps,
        "sft_steps": args.sft_steps, "sft_target": args.sft_target, "overrides": args.overrides,
        "arms": arms, "labels": {a.name: a.label for a in args.arms},
        "arm_overrides": {a.name: list(a.sets) for a in args.arms},
        "groups": {g: names for g, names in groups.items() if names},
        "collapse_rule": S.COLLAPSE_RULE,
        "per_arm": S.per_arm(rows, arms),
        "paired": T.paired(rows, pairs(args.arms), S.PAIRED_KEYS),
        "curves": {arm: S.arm_curves(records.get(arm, [])) for arm in arms},
        "runs": rows,
        "timing": {"warm_start_s": round(timing["warm_start"], 1), "rl_s": round(timing["rl"], 1)},
        "runtime": f"warm starts {timing['warm_start']:.0f} s, RL runs {timing['rl']:.0f} s",
    }


if __name__ == "__main__":
    sys.exit(main())
