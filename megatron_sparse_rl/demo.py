"""The main job (`make demo`): a tiny MoE learning a verifiable task with RL on CPU.

The RL loop (trainer, data, rewards) is not built yet, so this entry point says so and exits non-zero
rather than pretending. Run `make test` to exercise what exists: the Megatron-Core learner at
TP/EP layouts, the vLLM rollout engine, the algorithms library and the config system.
"""
import sys


def main() -> int:
    print("make demo: not yet — the RL trainer (rollout -> reward -> update -> weight sync) is not built yet.\n"
          "What exists can be exercised with `make test` and `msrl validate configs/tiny_moe.yaml`.",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
