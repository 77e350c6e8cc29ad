"""Dense RL vs naive sparse RL vs Sparse-RL on the synthetic addition task (issue 8, item 6), small scale, CPU.

Every arm is a real `msrl train` run (Megatron-Core learner, vLLM engine) of configs/sparse_rl_compare.yaml:
  0. warm start: one SFT stage (dense engine), exported to OUT/warm_start/hf_final;
  1. dense:        rollout.kv.policy=none (full KV cache), plain GRPO;
  2. naive_sparse: the config's R-KV engine (tiny budget, blocks freed), plain GRPO, no correction: the
                   samples come from the sparse sampler mu, the ratio is pi_theta / pi_old with pi_old the
                   learner's dense recompute, and nothing corrects mu != pi_old (the trainer has no switch to
                   use mu itself as pi_old);
  3. sparse_rl:    the same R-KV engine + algorithm.corrections.sparse_rl (reject sequences with any
                   xi_t = pi_old / mu < 1e-4, reweight the rest by min(xi_t, 1.5) normalised to mean 1).
All arms start from the same warm-start weights with the same seeds, prompts and step count. In-run held-out
accuracy is measured with each arm's own engine (sparse for the sparse arms); afterwards each sparse arm's
final weights are also evaluated with a dense engine (a `msrl train` with 0 steps), so the three policies
are compared on equal terms. Writes OUT/compare.png (reward, held-out accuracy, mismatch, rejection and
compression curves), OUT/summary.json and OUT/summary.md; per-run logs in OUT/logs/.

    .venv/bin/python experiments/sparse_rl_compare.py --out runs/sparse_rl_compare
        (100 steps per arm: 31 min measured on the shared 2-core machine at load average ~10)
    .venv/bin/python experiments/sparse_rl_compare.py --out /tmp/x --steps 2 --sft-steps 0 \\
        --prompts-per-step 4 --eval-prompts 4 --no-dense-eval          (smoke: random model, ~100 s)
Extra `--set a.b=v ...` overrides go to every run (e.g. --set rollout.kv.budget=8 rollout.kv.policy=snapkv).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "sparse_rl_compare.yaml"

OFF = "algorithm.corrections.sparse_rl.enabled=false"
# (name, label, overrides); the sparse arms keep the config's rollout.kv section
ARMS = (
    ("dense", "dense RL (full KV)", ("rollout.kv.policy=none", OFF)),
    ("naive_sparse", "naive sparse RL (R-KV, no correction)", (OFF,)),
    ("sparse_rl", "Sparse-RL (R-KV + rejection/reweighting)", ("algorithm.corrections.sparse_rl.enabled=true",)),
)
TAIL = 10  # "final" reward = mean over the last TAIL steps (single-step rewards are noisy)


def msrl_train(out: Path, name: str, sets: list[str]) -> list[dict]:
    """One `msrl train` subprocess; its log goes to OUT/logs/NAME.log; returns its metrics records."""
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a stale checkpoint there would be resumed
    log_path = out / "logs" / f"{name.replace('/', '_')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tools.cli", "train", str(CONFIG), "--set", f"logging.dir={run_dir}", *sets]
    t0 = time.perf_counter()
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(sets)}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{name} failed (exit {proc.returncode}); see {log_path}:\n{log_path.read_text()[-3000:]}")
    print(f"    done in {time.perf_counter() - t0:.0f} s", flush=True)
    from megatron_sparse_rl.observability.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _values(records: list[dict], key: str, phase: str = "rl") -> list[float]:
    from megatron_sparse_rl.observability.plot import series

    return series(records, (key,), phase)[1]


def _eval(records: list[dict], phase: str) -> float | None:
    vals = _values(records, "eval/accuracy", phase)
    return vals[-1] if vals else None


def arm_summary(records: list[dict], dense_eval: float | None) -> dict:
    """Final reward, accuracies, mismatch, rejection and compression of one arm."""
    reward = _values(records, "rollout/reward")
    rejected = _values(records, "sparse_rl/rejected_seq_frac")
    return {
        "steps": len(reward),
        "reward_first": reward[0] if reward else None,
        "reward_last": reward[-1] if reward else None,
        f"reward_last{TAIL}_mean": _mean(reward[-TAIL:]),
        f"reward_first{TAIL}_mean": _mean(reward[:TAIL]),
        "eval_acc_warm_start_own_engine": _eval(records, "warm_start"),
        "eval_acc_final_own_engine": _eval(records, "rl"),
        "eval_acc_final_dense_engine": dense_eval,
        "rejected_seq_frac_mean": _mean(rejected),
        "rejected_token_frac_mean": _mean(_values(records, "sparse_rl/rejected_token_frac")),
        "kv_compressed_frac_mean": _mean(_values(records, "kv/compressed_frac")),
        "kv_compactions_per_sample_mean": _mean(_values(records, "kv/compactions_per_sample")),
        "kv_retention_mean": _mean(_values(records, "kv/retention")),
        "kv_tokens_after_compression_frac_mean": _mean(_values(records, "kv/tokens_after_compression_frac")),
        "kv_k1_after_compression_mean": _mean(_values(records, "kv/k1_after_compression")),
        "kv_k1_before_compression_mean": _mean(_values(records, "kv/k1_before_compression")),
        "mismatch_k1_mean": _mean(_values(records, "mismatch/k1")),
    }


def _smooth(ys: list[float], k: int = 5) -> list[float]:
    return [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]


def plot(records: dict[str, list[dict]], summary: dict, out_png: Path, title: str) -> Path:
    """One PNG: reward, held-out accuracy, k1 mismatch, rejection + compression, one line per arm."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from megatron_sparse_rl.observability.plot import series

    fig = Figure(figsize=(12, 8), dpi=72)
    FigureCanvasAgg(fig)
    ax_r, ax_a, ax_k, ax_c = fig.subplots(2, 2).ravel()
    colors = {"dense": "tab:blue", "naive_sparse": "tab:red", "sparse_rl": "tab:green"}
    for name, label, _ in ARMS:
        recs, c = records[name], colors[name]
        xs, ys = series(recs, ("rollout/reward",))
        ax_r.plot(xs, ys, color=c, alpha=0.25, linewidth=0.8)
        ax_r.plot(xs, _smooth(ys), color=c, label=label)
        xs, ys = series(recs, ("eval/accuracy",), "warm_start")
        xe, ye = series(recs, ("eval/accuracy",))
        ax_a.plot(xs + xe, ys + ye, color=c, marker="o", markersize=3, label=f"{label}, own engine")
        dense = summary["arms"][name]["eval_acc_final_dense_engine"]
        if dense is not None and xe:
            ax_a.plot([xe[-1]], [dense], color=c, marker="*", markersize=14, linestyle="none",
                      label=f"{label}, final, dense engine")
        xs, ys = series(recs, ("mismatch/k1",))
        ax_k.plot(xs, _smooth(ys), color=c, label=label)
        xs, ys = series(recs, ("sparse_rl/rejected_seq_frac",))
        if xs:
            ax_c.plot(xs, ys, color=c, label=f"{label}: rejected seq frac")
        xs, ys = series(recs, ("kv/compressed_frac",))
        if xs:
            ax_c.plot(xs, ys, color=c, linestyle="--", label=f"{label}: compressed frac")
    for ax, t in ((ax_r, f"rollout reward (own engine; faint: per step, bold: mean of 5)"),
                  (ax_a, "held-out accuracy (warm start at step 0)"),
                  (ax_k, "mismatch k1 = mean(log mu - log pi_old) (mean of 5)"),
                  (ax_c, "Sparse-RL rejection, compressed fraction of samples")):
        ax.set_title(t, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    tmp = out_png.with_name(out_png.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out_png)
    return out_png


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def write_summary(out: Path, summary: dict) -> None:
    """OUT/summary.json and OUT/summary.md (one row per metric, one column per arm)."""
    arms = summary["arms"]
    keys = list(next(iter(arms.values())))
    rows = ["| metric | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    rows += [f"| {k} | " + " | ".join(_fmt(arms[a][k]) for a in arms) + " |" for k in keys]
    text = (f"# Dense vs naive sparse vs Sparse-RL\n\n{summary['setup']}\n\n" + "\n".join(rows) +
            f"\n\nwall time {summary['seconds']:.0f} s; plot {summary['plot']}\n")
    for path, body in ((out / "summary.json", json.dumps(summary, indent=2)), (out / "summary.md", text)):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(body)
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "sparse_rl_compare", help="output directory")
    p.add_argument("--steps", type=int, default=100, help="RL steps per arm")
    p.add_argument("--sft-steps", type=int, default=300, help="SFT warm-start steps (shared by the arms; 0: none, arms start from the random model)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="override trainer.prompts_per_step")
    p.add_argument("--eval-prompts", type=int, default=None, help="override trainer.eval_prompts")
    p.add_argument("--no-dense-eval", action="store_true", help="skip the dense re-evaluation of sparse arms")
    p.add_argument("--reuse-warm-start", action="store_true", help="reuse OUT/warm_start/hf_final if present")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="A.B=V")
    args = p.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    common = list(args.overrides)
    if args.prompts_per_step:
        common.append(f"trainer.prompts_per_step={args.prompts_per_step}")
    if args.eval_prompts:
        common.append(f"trainer.eval_prompts={args.eval_prompts}")
    warm = out / "warm_start" / "hf_final"
    if args.sft_steps == 0:  # no warm start: every arm starts from the same tiny random model (built once)
        warm = out / "model"
    elif not (args.reuse_warm_start and (warm / "config.json").is_file()):
        msrl_train(out, "warm_start", [f"model.path={out / 'model'}", "trainer.steps=0", "rollout.kv.policy=none",
                                       OFF, f"trainer.sft.max_steps={args.sft_steps}", "trainer.sft.target_accuracy=0",
                                       *common])
    records, arms = {}, {}
    for name, _, sets in ARMS:
        records[name] = msrl_train(out, name, [f"model.path={warm}", "trainer.sft.max_steps=0",
                                               f"trainer.steps={args.steps}", *sets, *common])
    for name, _, sets in ARMS:
        dense_eval = _eval(records[name], "rl") if name == "dense" else None
        if name != "dense" and not args.no_dense_eval:
            ev = msrl_train(out, f"{name}/dense_eval", [f"model.path={out / name / 'hf_final'}", "trainer.steps=0",
                                                        "trainer.sft.max_steps=0", "rollout.kv.policy=none", OFF,
                                                        *common])
            dense_eval = _eval(ev, "warm_start")
        arms[name] = arm_summary(records[name], dense_eval)
    from megatron_sparse_rl.config import load_config

    kv = load_config(CONFIG, common).rollout.kv
    setup = (f"configs/sparse_rl_compare.yaml, {args.steps} RL steps per arm after a shared {args.sft_steps}-step "
             f"SFT warm start; sparse arms: rollout.kv policy={kv.policy} budget={kv.budget} window={kv.window} "
             f"interval={kv.interval}; extra overrides: {common or 'none'}")
    summary = {"setup": setup, "seconds": round(time.perf_counter() - t0, 1), "arms": arms,
               "runs": {name: str(out / name) for name, _, _ in ARMS}}
    summary["plot"] = str(plot(records, summary, out / "compare.png",
                               f"dense vs naive sparse vs Sparse-RL (tiny MoE, 1-2 digit addition, "
                               f"{kv.policy} budget {kv.budget})"))
    write_summary(out, summary)
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
