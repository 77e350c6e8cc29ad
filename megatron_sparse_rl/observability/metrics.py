"""Per-step metrics sinks: `metrics.jsonl` (always), TensorBoard event files (when installed) and the trackers
`logging.trackers` names (W&B, MLflow: observability/trackers.py), which get the numbers under TensorBoard's names.
TensorBoard also gets metrics.png's panels as a custom-scalars layout when the writer is given one (`layout`:
training/context.py hands it observability/features.py `tensorboard_layout`; TensorBoard's "Custom Scalars" tab
then has one chart per panel of the RL steps, under the same metric names).

One JSON object per `log()` call, written with a single append `os.write` (a whole line or nothing
under concurrent readers; no user-space buffer to lose): {"step": 12, "phase": "rl", "time": <unix s>,
"rollout/reward": 0.41, ...}. Values are numbers, bools, strings or null; tensors and numpy scalars are
converted with `.item()`. NaN and +-inf are written as null and listed in "nonfinite"
({"loss/value": "nan"}), so the file stays strict JSON and `read_metrics` restores them.
Only one process (rank 0) should own a writer.

Resume: `MetricsWriter(run_dir, keep_records=n)` keeps the first n complete records (n saved in the
checkpoint as `writer.records`) and drops the rest, so the steps replayed after a restart are not
written twice. TensorBoard: one writer per phase, in its own directory (`tensorboard_dir`: the RL steps in
<run_dir>/tensorboard, SFT's in <run_dir>/tensorboard/sft, ...), so that a resume hides (purges) only the events
of each phase after its own last kept step.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from megatron_sparse_rl._optional import _has
from megatron_sparse_rl.config.loader import ConfigError

log = logging.getLogger(__name__)

FILENAME = "metrics.jsonl"
RESERVED = ("step", "phase", "time", "nonfinite")

# The metric names the progress line and the plot look for (the trainer logs them under these names).
REWARD = "rollout/reward"
TRAIN_ACCURACY = "rollout/accuracy"
EVAL_ACCURACY = "eval/accuracy"
MISMATCH_K1 = "mismatch/k1"
MISMATCH_K3 = "mismatch/k3"
MISMATCH_RHO_P5 = "mismatch/rho_p5"
"""5th percentile of rho_t = pi_old / mu (algorithms/metrics.py `tail_metrics`); on the line with sparse KV."""
CLIP_FRACTION = ("loss/clip_frac", "loss/clip_frac_low", "loss/clip_frac_high")
"""`loss/clip_frac` if logged, else the sum of the low and high clip fractions."""
REJECTION = ("corrections/rejected_seq_frac", "sparse_rl/rejected_seq_frac", "mis/rejected_seq_frac",
             "geo_rs/rejected_seq_frac", "opsm/masked_seq_frac", "veto/vetoed_seq_frac")
"""The first of these present is shown as the rejection rate."""


def _value(key: str, v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v
    if hasattr(v, "item"):  # torch / numpy scalars
        return _value(key, v.item())
    raise TypeError(f"metric {key!r}: expected a number, bool, str or None (got {type(v).__name__})")


def to_record(step: int, metrics: Mapping[str, Any], *, phase: str = "rl", now: float | None = None) -> dict:
    """The JSON-safe record of one step (non-finite floats -> null, listed under "nonfinite")."""
    record: dict[str, Any] = {"step": int(step), "phase": phase, "time": time.time() if now is None else now}
    nonfinite = {}
    for key, v in metrics.items():
        if not isinstance(key, str) or key in RESERVED:
            raise ValueError(f"metric name {key!r} is not allowed (names are strings other than {RESERVED})")
        v = _value(key, v)
        if isinstance(v, float) and not math.isfinite(v):
            nonfinite[key] = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
            v = None
        record[key] = v
    if nonfinite:
        record["nonfinite"] = nonfinite
    return record


def scalars(metrics: Mapping[str, Any], phase: str) -> dict[str, float]:
    """The numbers of a record as TensorBoard and the trackers get them: bools as 0/1 (strings and None are
    JSONL-only), named by the metric, prefixed with the phase when it is not "rl" ("sft/eval/accuracy")."""
    prefix = "" if phase == "rl" else f"{phase}/"
    values = {key: _value(key, v) for key, v in metrics.items()}
    return {prefix + key: float(v) for key, v in values.items() if isinstance(v, (int, float))}


def _restore(record: dict) -> dict:
    for key, kind in record.pop("nonfinite", {}).items():
        record[key] = float(kind)
    return record


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl, non-finite values restored. A torn last line (a run killed while
    writing) is ignored; a malformed line elsewhere raises ValueError naming the line number."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(_restore(json.loads(line)))
        except json.JSONDecodeError as e:
            if lineno == len(lines):  # no newline after it: the last write was cut short
                break
            raise ValueError(f"{path}:{lineno}: not a valid metrics record ({e.msg})") from None
    return records


class MetricsWriter:
    """Appends one record per step to `<run_dir>/metrics.jsonl`; mirrors numbers to TensorBoard and to `trackers`
    (objects with `log(step, scalars)` and `close(failed)`, observability/trackers.py open_trackers), closed with it;
    with a `layout`, a tracker that has `panels(layout)` gets the layout of the rl metrics it was given at the close."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, *, keep_records: int | None = None,
                 trackers: Sequence[Any] = (), layout: Callable[[set[str]], dict] | None = None):
        self.trackers = list(trackers)
        self.layout = layout  # metric names -> TensorBoard custom-scalars layout (features.py tensorboard_layout)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / FILENAME
        kept = self._keep(keep_records)
        self.records = len(kept)  # complete records in the file: save it in checkpoints (keep_records)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._tb: dict[str, Any] | None = None  # phase -> SummaryWriter, opened at the phase's first record
        self._purge: dict[str, int] = {}
        self._tags: set[str] = set()  # the rl metrics seen, and the custom-scalars layout written for them
        self._written_layout: dict | None = None
        if tensorboard:
            if _has("tensorboard"):
                self._tb = {}
                self._resume = keep_records is not None
                self._purge = self._purge_steps(kept, resuming=self._resume)
            else:
                log.warning("TensorBoard events are off: the 'tensorboard' package is not installed "
                            "(pip install tensorboard, or pip install -e .[plot]); metrics.jsonl is still written")

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def tensorboard_dir(self, phase: str) -> Path:
        """Where a phase's TensorBoard events go: <run_dir>/tensorboard for "rl", <run_dir>/tensorboard/<phase>
        for the others (TensorBoard shows each as a run). One writer per phase, so that a resume's purge (by step)
        of one phase leaves the others' events alone."""
        root = self.run_dir / "tensorboard"
        return root if phase == "rl" else root / phase

    @staticmethod
    def _purge_steps(kept: list[dict], *, resuming: bool) -> dict[str, int]:
        """Per phase, the step from which a resumed run's TensorBoard reader hides the events written before: the
        last kept record's step + 1 (0 for a phase with no kept record: all of its events are after the
        checkpoint). Nothing when not resuming."""
        if not resuming:
            return {}
        last: dict[str, int] = {}
        for record in kept:
            phase = record.get("phase", "rl")
            last[phase] = max(last.get(phase, -1), int(record["step"]))
        return {phase: step + 1 for phase, step in last.items()}

    def _writer(self, phase: str):
        writer = self._tb.get(phase)
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            purge = self._purge.get(phase, 0) if self._resuming(phase) else None
            writer = self._tb[phase] = SummaryWriter(log_dir=str(self.tensorboard_dir(phase)), purge_step=purge)
        return writer

    def _layout(self, writer) -> None:
        """TensorBoard's custom-scalars layout (`self.layout` of the rl metric names seen), written again when a
        record brings metrics that fill another chart (eval/accuracy at the first evaluation)."""
        if self.layout is None:
            return
        layout = self.layout(self._tags)
        if layout != self._written_layout:
            writer.add_custom_scalars(layout)
            self._written_layout = layout

    def _resuming(self, phase: str) -> bool:
        """Whether a phase's events from before may exist: this writer resumes and the phase's directory holds
        event files."""
        folder = self.tensorboard_dir(phase)
        return self._resume and folder.is_dir() and any(f.name.startswith("events.") for f in folder.iterdir())

    def _keep(self, keep_records: int | None) -> list[dict]:
        if not self.path.exists():
            return []
        lines = [ln for ln in self.path.read_text(encoding="utf-8").split("\n") if ln.strip()]
        complete = [ln for ln in lines if self._is_record(ln)]
        if keep_records is None:
            return [json.loads(ln) for ln in complete]
        if keep_records > len(complete):
            raise ValueError(f"{self.path} holds {len(complete)} records, fewer than the {keep_records} "
                             f"the checkpoint expects")
        kept = complete[:keep_records]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        return [json.loads(ln) for ln in kept]

    @staticmethod
    def _is_record(line: str) -> bool:
        try:
            return isinstance(json.loads(line), dict)
        except json.JSONDecodeError:
            return False

    def log(self, step: int, metrics: Mapping[str, Any], *, phase: str = "rl") -> dict:
        """Write one record; returns it. TensorBoard tags and tracker names are `scalars`' (the metric names,
        prefixed with the phase when it is not "rl", e.g. "sft/eval/accuracy")."""
        record = to_record(step, metrics, phase=phase)
        data = (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")
        self._append(data, step)
        self.records += 1
        values = scalars(metrics, phase)
        if phase == "rl":
            self._tags.update(values)
        if self._tb is not None:
            writer = self._writer(phase)
            for tag, v in values.items():
                writer.add_scalar(tag, v, global_step=int(step))
            if phase == "rl":
                self._layout(writer)
            writer.flush()
        for tracker in self.trackers:
            tracker.log(step, values)
        return record

    def _append(self, data: bytes, step: int) -> None:
        """Append one whole record: a write that fails part-way (a full disk) is cut back off, and the error names
        the file (the OSError of a full disk names none)."""
        start = os.lseek(self._fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise ConfigError(f"could not write the metrics record of step {step} to {str(self.path)!r}: "
                              f"{e.strerror or e}; the records before it are intact (free space there, then run "
                              "the same command again to resume)") from e

    def close(self, failed: bool = False) -> None:
        """Flush and close the files and end the trackers' runs, as failed when `failed` (a second call does
        nothing)."""
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        if self._tb is not None:
            for writer in self._tb.values():
                writer.close()
            self._tb = None
        trackers, self.trackers = self.trackers, []
        layout = self.layout(self._tags) if self.layout is not None and self._tags else None
        for tracker in trackers:
            try:
                if layout is not None:
                    tracker.panels(layout)  # metrics.png's panels over the names the tracker got (trackers.py)
            finally:
                tracker.close(failed=failed)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)
