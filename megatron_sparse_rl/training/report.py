"""What a run shows and leaves behind: a progress line per step, metrics.jsonl + TensorBoard, the
warm-start vs final accuracy summary, the final checkpoint, the HF export and the PNG plot. A resumed run
takes the warm-start and latest held-out accuracy back from its metrics.jsonl, so its summary has both."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from megatron_sparse_rl.observability.features import step_line_fields
from megatron_sparse_rl.observability.metrics import EVAL_ACCURACY, FILENAME, read_metrics
from megatron_sparse_rl.observability.plot import plot_metrics
from megatron_sparse_rl.observability.progress import ProgressPrinter, step_line_groups
from megatron_sparse_rl.training import state
from megatron_sparse_rl.training.context import RunContext

log = logging.getLogger(__name__)


def recorded_accuracies(path: Path) -> tuple[float | None, float | None]:
    """(warm-start, latest) held-out accuracy in a run's metrics.jsonl: the `warm_start` record's
    eval/accuracy and the last record's that has one; None for what is not there (or no file)."""
    if not path.is_file():
        return None, None
    evals = [r for r in read_metrics(path) if r.get(EVAL_ACCURACY) is not None]
    warm = [r[EVAL_ACCURACY] for r in evals if r.get("phase") == "warm_start"]
    return (warm[-1] if warm else None), (evals[-1][EVAL_ACCURACY] if evals else None)


class Reporter:
    def __init__(self, ctx: RunContext, total: int):
        self.ctx = ctx
        groups = step_line_groups(step_line_fields(ctx.run))  # the fields of the features the run has on
        self.progress = ProgressPrinter(total, groups=groups) if ctx.is_main else None
        self.start = time.perf_counter()
        # A resumed run past its warm start reports the accuracies its metrics.jsonl already holds (rank 0
        # owns that file; open_metrics has cut it back to the checkpoint's records).
        recorded = recorded_accuracies(ctx.run_dir / FILENAME) if ctx.is_main else (None, None)
        self.warm_start_accuracy: float | None = recorded[0]
        self.last_eval: float | None = recorded[1]

    def probe_tokens(self) -> torch.Tensor:
        """A fixed sequence for engine-vs-learner logprob checks: the first evaluation example and its answer
        (a held-out prompt, or the first train prompt when there is no held-out split: `Task.eval_examples`)."""
        example = self.ctx.task.eval_examples(1)[0]
        tok = self.ctx.tokenizer
        ids = list(example.ids) + tok.encode(example.answer, add_special_tokens=False)
        return torch.tensor([ids])

    def _write(self, step: int, metrics: dict, phase: str) -> None:
        if self.ctx.writer is not None:
            self.ctx.writer.log(step, metrics, phase=phase)

    def scalars(self, metrics: dict, *, step: int, phase: str) -> None:
        if "eval/accuracy" in metrics:
            self.last_eval = metrics["eval/accuracy"]
        self._write(step, metrics, phase)
        if self.ctx.is_main and phase == "sft":
            kv = metrics.get("sft/kv_compressed_target_frac")  # sparsity-aware SFT (trainer.sft.kv_keep)
            log.info("sft step %d: loss %.4f, held-out accuracy %.3f%s", step, metrics.get("sft/loss", float("nan")),
                     metrics.get("eval/accuracy", float("nan")),
                     "" if kv is None else f", targets from a compressed cache {kv:.2f}")

    def warm_start(self, accuracy: float) -> None:
        self.warm_start_accuracy = self.last_eval = accuracy
        self._write(0, {"eval/accuracy": accuracy}, "warm_start")
        if self.ctx.is_main:
            log.info("held-out accuracy before RL: %.3f", accuracy)

    def step(self, step: int, metrics: dict) -> None:
        if "eval/accuracy" in metrics:
            self.last_eval = metrics["eval/accuracy"]
        self._write(step, metrics, "rl")
        if self.progress is not None:
            self.progress.update(step, metrics)

    def finish(self, loop: state.LoopState) -> dict:
        """Final checkpoint, HF export and plot; returns the run summary."""
        ctx = self.ctx
        ckpt = state.save_run(ctx, loop) if ctx.run.checkpoint.save_every or ctx.run.trainer.steps else None
        hf_dir = state.export_hf(ctx, ctx.run_dir / "hf_final")
        summary = {"rank": ctx.rank, "rl_steps": loop.rl_step, "sft_steps": loop.sft_step,
                   "warm_start_accuracy": self.warm_start_accuracy, "final_accuracy": self.last_eval,
                   "seconds": round(time.perf_counter() - self.start, 1)}
        if ctx.is_main:
            ctx.writer.close()
            plot = plot_metrics(ctx.run_dir / "metrics.jsonl", ctx.run_dir / "metrics.png")
            summary.update(metrics=str(ctx.run_dir / "metrics.jsonl"), plot=str(plot), hf_checkpoint=str(hf_dir),
                           checkpoint=str(ckpt) if ckpt else None)
        ctx.placement.shutdown()
        return summary
