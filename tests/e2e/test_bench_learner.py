"""`msrl bench learner` runs end to end at a tiny size and prints its ratios (no timing is asserted: the
numbers are the benchmark's to report); every `msrl bench` kind parses its options and refuses bad ones."""
import re
import subprocess
from pathlib import Path

import pytest
from tests.msrl import MSRL

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_bench_learner_prints_its_ratios():
    cmd = [*MSRL, "bench", "learner", "--hidden", "64", "--layers", "2", "--experts", "4",
           "--topk", "2", "--seq", "48", "--batch", "8", "--pairs", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"learner.kernels fast: \d+ tokens/s, local: \d+ tokens/s \(medians\); fast / local speed-up per "
                     r"pair: median \d+\.\d\dx .* max \|logprob fast - local\| \d\.\d\de[-+]\d\d", out), out
    assert re.search(r"plain learner step .* median \d+ ms; \d+ response tokens/s, \d+ tokens/s", out), out
    for label in ("all corrections on", "keep-sampling-mask on", "every micro-batch at the batch's full width"):
        assert re.search(rf"{label} .* / plain: median \d+\.\d{{4}} \(overhead [+-]\d+\.\d\d%", out), out
    assert re.search(r"apply_corrections alone: \d+\.\d\d% of the corrected step", out), out


@pytest.mark.parametrize("kind", ["kv", "sync", "learner", "routing", "convert"])
def test_every_bench_kind_refuses_a_non_positive_size(kind):
    option = {"kv": "--budget", "sync": "--hidden", "learner": "--hidden", "routing": "--hidden", "convert": "--hidden"}
    proc = subprocess.run([*MSRL, "bench", kind, option[kind], "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"argument {option[kind]}" in proc.stderr
