"""The results file of a tests/gpu run: each test's outcome, time, message and the figures it recorded, as JSON
and as a markdown table, rewritten after every test phase so that a run stopped from outside (scripts/gpu_check.sh's
total time limit) still leaves what it had done.

    summary = Summary(out_dir, environment={"torch": "2.11.0", ...})
    summary.add(report)          # every setup/call/teardown TestReport (tests/gpu/conftest.py does it)
    summary.finish(exitstatus)   # at the end of the session

Files: `<out_dir>/gpu_summary.json` and `<out_dir>/gpu_summary.md` (the same content, the table for people).
A figure is one user property of the test's report (conftest.py's `figure` fixture records them):
name -> {"value": float, "unit": str}.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

JSON_NAME = "gpu_summary.json"
MD_NAME = "gpu_summary.md"
MESSAGE_CHARS = 600
"""A failure's message is cut to its last this many characters (the traceback stays in pytest's log)."""


def _message(report) -> str:
    if report.skipped:
        longrepr = report.longrepr
        return str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    return text[-MESSAGE_CHARS:]


def _figure(value) -> dict:
    if isinstance(value, dict) and "value" in value:
        return {"value": value["value"], "unit": str(value.get("unit", ""))}
    return {"value": value, "unit": ""}


class Summary:
    """Collects test reports and rewrites the two files after each (see the module docstring)."""

    def __init__(self, out_dir, environment: dict):
        self.out_dir = Path(out_dir)
        self.data = {"finished": False, "exitstatus": None, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "seconds": 0.0, "environment": dict(environment), "counts": {}, "tests": []}
        self._by_id: dict[str, dict] = {}
        self._t0 = time.monotonic()

    def add(self, report) -> None:
        """Fold one phase's TestReport into its test's entry and rewrite the files."""
        test = self._by_id.get(report.nodeid)
        if test is None:
            test = {"test": report.nodeid, "outcome": "running", "seconds": 0.0, "message": "", "figures": {}}
            self._by_id[report.nodeid] = test
            self.data["tests"].append(test)
        test["seconds"] = round(test["seconds"] + report.duration, 3)
        test["figures"].update({name: _figure(v) for name, v in report.user_properties})
        if report.when == "setup" and not report.passed:
            test["outcome"] = "skipped" if report.skipped else "error"
        elif report.when == "call":
            test["outcome"] = report.outcome
        elif report.when == "teardown" and report.failed and test["outcome"] in ("passed", "running"):
            test["outcome"] = "error"
        if not report.passed and not test["message"]:
            test["message"] = _message(report)
        self._write()

    def finish(self, exitstatus: int) -> None:
        self.data.update(finished=True, exitstatus=int(exitstatus))
        self._write()

    def _write(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self._t0, 1)
        counts: dict[str, int] = {}
        for t in self.data["tests"]:
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        self.data["counts"] = counts
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in ((JSON_NAME, json.dumps(self.data, indent=1, sort_keys=False) + "\n"),
                           (MD_NAME, render_markdown(self.data))):
            tmp = self.out_dir / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out_dir / name)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _figures_cell(figures: dict) -> str:
    return "; ".join(f"{name} = {f['value']:.4g}{' ' + f['unit'] if f['unit'] else ''}"
                     if isinstance(f["value"], (int, float)) else f"{name} = {f['value']}"
                     for name, f in figures.items())


def render_markdown(data: dict) -> str:
    """The summary as markdown: the state of the run, the environment, one table row per test."""
    state = (f"finished, pytest exit status {data['exitstatus']}" if data["finished"]
             else "INCOMPLETE: pytest did not finish (stopped by the total time limit, or still running)")
    counts = ", ".join(f"{n} {k}" for k, n in sorted(data["counts"].items())) or "no test reported"
    lines = ["# tests/gpu results", "", f"Started {data['started']}; {data['seconds']} s; {state}; {counts}.", ""]
    lines += [f"- {k}: {_cell(v)}" for k, v in data["environment"].items()]
    lines += ["", "| test | outcome | s | figures | message |", "| --- | --- | --- | --- | --- |"]
    for t in data["tests"]:
        lines.append(f"| {_cell(t['test'])} | {t['outcome']} | {t['seconds']:.1f} "
                     f"| {_cell(_figures_cell(t['figures']))} | {_cell(t['message'])} |")
    return "\n".join(lines) + "\n"
