"""The main job (`make demo`): a tiny MoE learns a verifiable task (2-digit arithmetic) with RL on CPU.

Builds a tiny Qwen3-MoE and a character tokenizer locally, warm-starts it with a short SFT stage, then
trains it with GRPO through real Megatron-Core (learner) and real vLLM (rollouts), printing one line per
step. Leaves in runs/demo_tiny_moe/: metrics.jsonl, TensorBoard events, metrics.png, checkpoints/ and
hf_final/ (a Hugging Face model directory). Each run starts fresh: a previous demo run in that directory is
removed first (announced), unless --resume asks to continue it from its newest checkpoint.

    python -m megatron_sparse_rl.demo [--resume] [--verbose] [--set a.b=v ...]
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_tiny_moe.yaml"
# Besides what every run writes (run/run_dir.py ARTIFACTS): its checkpoints, and the demo's own tiny model, rebuilt
# each time so that a changed demo config never meets a stale model (and the vLLM cache runs kept in their directory
# before they shared one).
DEMO_EXTRAS = ("checkpoints", "model", "vllm_cache")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="A.B=V")
    parser.add_argument("--resume", action="store_true", help="continue the previous demo run instead of replacing it")
    parser.add_argument("--verbose", action="store_true", help="also show vLLM / Megatron-Core INFO lines")
    args = parser.parse_args(argv)
    if not args.verbose:
        from megatron_sparse_rl.observability.logging import quiet_native_logs

        quiet_native_logs()  # as `msrl train`: torch's and vLLM's C++ warnings off the console, set before torch loads
    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.trainer import train
    from megatron_sparse_rl.run.run_dir import ARTIFACTS

    run = load_config(CONFIG, [*args.overrides, *(["logging.verbose=true"] if args.verbose else [])])
    run_dir = Path(run.logging.dir)
    previous = [run_dir / n for n in (*ARTIFACTS, *DEMO_EXTRAS) if (run_dir / n).exists()]
    if previous and not args.resume:
        print(f"replacing the previous demo run in {run_dir} (--resume continues it instead)", flush=True)
        for path in previous:  # only what a run writes, never anything else in that directory
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return report(train(run))


def report(summary: dict) -> int:
    """Print the run's summary; 0 when RL improved the held-out accuracy over the warm start, 1 when it did not or
    either accuracy is unknown, EXIT_STOPPED (75) when the run was stopped (Ctrl-C, SIGTERM, preemption) and
    checkpointed: --resume continues it."""
    if summary.get("stopped"):
        from megatron_sparse_rl.run.stops import EXIT_STOPPED

        print(f"\nstopped ({summary['stopped']}) at {summary.get('at')}; checkpoint {summary.get('checkpoint')} "
              "(`python -m megatron_sparse_rl.demo --resume` continues from it)")
        return EXIT_STOPPED
    before, after = summary.get("warm_start_accuracy"), summary.get("final_accuracy")
    print(f"\nheld-out accuracy: {_acc(before)} after the SFT warm-start -> {_acc(after)} after "
          f"{summary['rl_steps']} RL steps ({summary['seconds']:.0f} s)")
    for key in ("metrics", "plot", "hf_checkpoint", "checkpoint"):
        print(f"{key:>14}: {summary.get(key)}")
    if before is None or after is None:
        missing = "warm-start" if before is None else "final"
        print(f"cannot tell whether RL improved held-out accuracy: the {missing} accuracy is not in this run's "
              f"metrics ({summary.get('metrics')})", file=sys.stderr)
        return 1
    if after <= before:
        print(f"RL did not improve held-out accuracy in this run ({before:.3f} -> {after:.3f})", file=sys.stderr)
        return 1
    return 0


def _acc(value: float | None) -> str:
    """An accuracy for the summary line ("unknown" when the run has none)."""
    return "unknown" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
