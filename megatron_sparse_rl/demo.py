"""The main job (`make demo`): a tiny MoE learns a verifiable task (2-digit arithmetic) with RL on CPU.

Builds a tiny Qwen3-MoE and a character tokenizer locally, warm-starts it with a short SFT stage, then
trains it with GRPO through real Megatron-Core (learner) and real vLLM (rollouts), printing one line per
step. Leaves in runs/demo_tiny_moe/: metrics.jsonl, TensorBoard events, metrics.png, checkpoints/ and
hf_final/ (a Hugging Face model directory). Each run starts fresh: a previous demo run in that directory is
removed first (announced), unless --resume asks to continue it from its newest checkpoint.

    python -m megatron_sparse_rl.demo [--resume] [--set a.b=v ...]
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_tiny_moe.yaml"
RUN_ARTIFACTS = ("metrics.jsonl", "metrics.png", "checkpoints", "hf_final", "tensorboard", "model", "vllm_cache")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="A.B=V")
    parser.add_argument("--resume", action="store_true", help="continue the previous demo run instead of replacing it")
    args = parser.parse_args(argv)
    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.trainer import train

    run = load_config(CONFIG, args.overrides)
    run_dir = Path(run.logging.dir)
    previous = [run_dir / n for n in RUN_ARTIFACTS if (run_dir / n).exists()]
    if previous and not args.resume:
        print(f"replacing the previous demo run in {run_dir} (--resume continues it instead)", flush=True)
        for path in previous:  # only what a run writes, never anything else in that directory
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    summary = train(run)
    before, after = summary["warm_start_accuracy"], summary["final_accuracy"]
    print(f"\nheld-out accuracy: {before:.3f} after the SFT warm-start -> {after:.3f} after "
          f"{summary['rl_steps']} RL steps ({summary['seconds']:.0f} s)")
    for key in ("metrics", "plot", "hf_checkpoint", "checkpoint"):
        print(f"{key:>14}: {summary.get(key)}")
    if after is None or before is None or after <= before:
        print("RL did not improve held-out accuracy in this run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
