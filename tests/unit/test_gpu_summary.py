"""tests/gpu/summary.py, the results file of scripts/gpu_check.sh: a test's outcome from its setup/call/teardown
reports (setup failure = error, setup skip = skipped, a teardown failure after a pass = error), its summed time,
its first failure's message and its figures; both files rewritten after every report and marked finished at the
end; the markdown table escapes '|'."""
import json
from types import SimpleNamespace

from tests.gpu.summary import JSON_NAME, MD_NAME, Summary


def _report(nodeid, when, outcome, duration=1.0, props=(), longrepr=None):
    return SimpleNamespace(nodeid=nodeid, when=when, outcome=outcome, passed=outcome == "passed",
                           failed=outcome == "failed", skipped=outcome == "skipped", duration=duration,
                           user_properties=list(props), longrepr=longrepr, longreprtext=str(longrepr or ""))


def test_outcomes_times_messages_and_figures(tmp_path):
    s = Summary(tmp_path, {"gpu": "H100 | 80GB"})
    fig = ("step_ms", {"value": 12.5, "unit": "ms"})
    s.add(_report("a", "setup", "passed", 0.5))
    s.add(_report("a", "call", "passed", 2.0, [fig]))
    assert json.loads((tmp_path / JSON_NAME).read_text())["tests"][0]["outcome"] == "passed"  # written per report
    s.add(_report("a", "teardown", "passed", 0.25, [fig]))
    s.add(_report("b", "setup", "skipped", 0.0, longrepr=("f.py", 3, "Skipped: needs CUDA")))
    s.add(_report("c", "setup", "failed", 0.1, longrepr=SimpleNamespace(reprcrash=SimpleNamespace(message="boom"))))
    s.add(_report("d", "call", "failed", 1.0, longrepr="x" * 700 + "END"))
    s.add(_report("e", "call", "passed"))
    s.add(_report("e", "teardown", "failed", longrepr="teardown broke"))
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert not data["finished"]
    tests = {t["test"]: t for t in data["tests"]}
    assert [tests[k]["outcome"] for k in "abcde"] == ["passed", "skipped", "error", "failed", "error"]
    assert tests["a"]["seconds"] == 2.75 and tests["a"]["figures"] == {"step_ms": {"value": 12.5, "unit": "ms"}}
    assert tests["b"]["message"] == "Skipped: needs CUDA" and tests["c"]["message"] == "boom"
    assert len(tests["d"]["message"]) == 600 and tests["d"]["message"].endswith("END")
    assert tests["e"]["message"] == "teardown broke"
    assert data["counts"] == {"passed": 1, "skipped": 1, "error": 2, "failed": 1}
    s.finish(1)
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert data["finished"] and data["exitstatus"] == 1
    md = (tmp_path / MD_NAME).read_text()
    assert "finished, pytest exit status 1; 2 error, 1 failed, 1 passed, 1 skipped." in md
    assert "- gpu: H100 \\| 80GB" in md
    assert "| a | passed | 2.8 | step_ms = 12.5 ms |  |" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == [JSON_NAME, MD_NAME]  # no temporary file left
