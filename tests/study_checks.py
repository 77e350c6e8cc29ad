"""What the experiment tests recompute independently of the scripts' own helpers (json and arithmetic): a run's
metrics.jsonl records, an RL metric's values, a mean and its standard error, and a script's `--quick` run."""
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def rl(recs: list[dict], key: str) -> list[float]:
    return [r[key] for r in recs if r["phase"] == "rl" and isinstance(r.get(key), (int, float))]


def mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def run_quick(script: str, out: Path, timeout: float) -> tuple[Path, dict, str]:
    """experiments/<script> --quick --out OUT: (OUT, its summary.json, its stdout); a failure shows its output."""
    cmd = [sys.executable, str(REPO / "experiments" / script), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text()), proc.stdout
