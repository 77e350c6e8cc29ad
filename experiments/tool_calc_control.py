"""The control of the calc tool task (docs/episodes.md): a trained model's held-out episodes with the `calc` tool,
and the same episodes with the tool answering an error, on the real rollout engine.

    python experiments/tool_calc_control.py configs/tool_calc.yaml runs/tool_calc/hf_final [--samples 4] [--set ...]

`--set` takes the run's overrides (e.g. `rollout.seed=1 data.seed=1`), so that the `calc` arm repeats the run's
final evaluation exactly when `--samples` is its trainer.eval_samples.

Both arms run placement/rollout.py `collect_episodes` (what the trainer's evaluation runs) on one vLLM engine with
the model's weights, over every held-out prompt of the config's data, `--samples` episodes each at
trainer.eval_temperature, sampling seed rollout.seed, correctness by the run's reward without shaping:
- `calc`: env.tools as configured;
- `tool error`: env.tools = [`unavailable`], a tool registered here that is never called, so the model's
  `calc(...)` turn is answered "error: no tool calc" (counted as a tool error) and its next turn is judged as ever.
If the model could multiply without the tool, the second arm would score; it prints accuracy, tool calls and
tool errors per episode for each arm, one line each.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("model_dir", type=Path)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--set", nargs="+", default=[], metavar="A.B=V", help="the run's config overrides")
    a = p.parse_args(argv)
    if a.samples < 1:
        raise SystemExit(f"--samples must be >= 1 (got {a.samples})")
    if not (a.model_dir / "config.json").is_file():
        raise SystemExit(f"model_dir {a.model_dir} has no config.json (pass a run's hf_final directory)")

    from transformers import AutoTokenizer

    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.config.rollout import SamplingConfig
    from megatron_sparse_rl.data import build_task
    from megatron_sparse_rl.envs import register_tool
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rewards import make_scorer
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.placement.rollout import collect_episodes

    run = load_config(a.config, a.set)
    register_tool("unavailable", _never_called)
    tokenizer = AutoTokenizer.from_pretrained(str(a.model_dir))
    examples = build_task(run.data, tokenizer).eval_examples()
    correct = make_scorer(run.reward, shaping=False, answer_marker=run.data.answer_marker)
    sampling = SamplingConfig(n=a.samples, temperature=run.trainer.eval_temperature,
                              max_tokens=run.rollout.sampling.max_tokens, seed=run.rollout.seed)
    vllm_cpu.apply()
    engine = RolloutEngine(a.model_dir, run.rollout, cache_dir=Path(run.logging.dir) / "vllm_cache")
    try:
        for arm, tools in (("calc", run.env.tools), ("tool error", ("unavailable",))):
            t0 = time.perf_counter()
            env = dataclasses.replace(run.env, tools=tools)
            batch, right = collect_episodes(engine, tokenizer, examples, sampling, env, seed=run.rollout.seed,
                                            score=correct, correct=correct)
            ep = batch.episode_stats
            calls, errors = ep["tool_calls"] / ep["episodes"], ep["tool_errors"] / ep["episodes"]
            print(f"{arm}: accuracy {float(right.mean()):.3f} over {len(right)} episodes "
                  f"({len(examples)} held-out prompts x {a.samples}), tool calls/episode {calls:.2f}, "
                  f"tool errors/episode {errors:.2f}, {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        engine.shutdown()


def _never_called(arguments: str) -> str:
    raise AssertionError("the control's placeholder tool is never offered by name to the model")


if __name__ == "__main__":
    main()
