"""The conversion progress line (checkpoint/progress.py): counts, MB, MB/s and ETA from a fake clock, throttling
to one line per interval, silence on ranks that are not enabled."""
import io

import pytest

from megatron_sparse_rl.checkpoint.progress import TransferProgress, report_phase


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_line_fields_follow_the_counts_and_the_clock():
    clock, out = Clock(), io.StringIO()
    p = TransferProgress("x", total_tensors=10, total_bytes=8_000_000, stream=out, interval=1.0, clock=clock)
    clock.t += 2.0
    line = p.add(2_000_000, tensors=3)  # 2 MB in 2 s -> 1.0 MB/s, 6 MB left -> 6 s
    assert line == "x [#####...............]  3/10 tensors 2.00/8.00 MB 1.0 MB/s eta 6s"
    assert out.getvalue() == line + "\n"


def test_throttled_to_one_line_per_interval_and_final_line_always():
    clock, out = Clock(), io.StringIO()
    p = TransferProgress("x", total_tensors=100, total_bytes=100, stream=out, interval=5.0, clock=clock)
    for _ in range(100):
        clock.t += 0.125  # 12.5 s in all (exact in binary) -> lines at 5 s and 10 s
        p.add(1)
    p.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 == p.lines
    assert lines[-1].startswith("x [####################] 100/100 tensors 0.00/0.00 MB")


def test_disabled_rank_counts_but_prints_nothing():
    clock, out = Clock(), io.StringIO()
    p = TransferProgress("x", total_tensors=1, total_bytes=5, stream=out, interval=0.0, clock=clock, enabled=False)
    p.add(5)
    p.finish()
    assert out.getvalue() == "" and p.bytes == 5 and p.tensors == 1


def test_report_phase_and_bad_totals():
    out = io.StringIO()
    assert report_phase("save", 3_000_000, 2.0, stream=out) == "save: 3.00 MB in 2.00 s (1.5 MB/s)"
    with pytest.raises(ValueError, match="must be >= 0"):
        TransferProgress("x", total_tensors=-1, total_bytes=0)
