"""Every command README.md and docs/*.md show is run by a test: each command's key (`msrl bench kv`, `make demo`,
`python -m megatron_sparse_rl.demo`, ...) names the tests that run it in SMOKES, and those tests exist; every
concrete `msrl` line the docs show parses with today's CLI (a renamed flag or subcommand fails here, naming the
doc line); the cheap ones (`msrl plan`, `msrl validate`, `msrl launch ... --dry-run`) run here; the files the
commands name exist; every make target they show exists (`make -n`).

    .venv/bin/python -m pytest -q tests/unit/test_doc_commands.py

A new command in the docs without a test fails `test_every_documented_command_has_a_smoke_test`: write the smoke
(tests/e2e/test_doc_command_smokes.py holds the ones no feature test already runs) and add it to SMOKES.
"""
from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

from tests.doc_commands import REPO, command_keys, documented_commands, words

SMOKE = "tests/e2e/test_doc_command_smokes.py"
SMOKES: dict[str, tuple[str, ...]] = {
    "make demo": ("tests/unit/test_doc_commands.py::test_make_targets_exist",
                  "tests/e2e/test_trainer.py::test_rl_raises_held_out_accuracy_above_the_warm_start"),
    "make setup": ("tests/unit/test_doc_commands.py::test_make_targets_exist",
                   "tests/unit/test_setup_venv.py::test_pypi_route_requirements_skip_the_torch_pin"),
    "make test": ("tests/unit/test_doc_commands.py::test_make_targets_exist",),  # CI runs it (.ci/run)
    "make test-all": ("tests/unit/test_doc_commands.py::test_make_targets_exist",),
    "make test-fast": ("tests/unit/test_doc_commands.py::test_make_targets_exist",),
    "msrl": ("tests/unit/test_cli.py::test_top_level_help_lists_the_commands",),
    "msrl validate": ("tests/unit/test_cli.py::test_validate_prints_the_summary",
                      "tests/unit/test_doc_commands.py::test_documented_cheap_command_runs"),
    "msrl train": ("tests/e2e/test_trainer.py::test_short_run_logs_finite_metrics_and_artifacts",
                   "tests/e2e/test_lora_train.py::test_the_demo_config_trains"),
    "msrl plan": ("tests/unit/test_plan.py::test_cli", "tests/unit/test_doc_commands.py::test_documented_cheap_command_runs",
                  "tests/unit/test_plan_lora.py::test_kimi_k2_lora_fits_on_far_fewer_gpus_than_full_rl"),
    "msrl launch local": ("tests/e2e/test_trainer_disaggregated.py::test_two_ranks_on_a_users_jsonl_prompts",),
    "msrl launch slurm": ("tests/e2e/test_slurm.py::test_job_runs_to_completion",
                          "tests/unit/test_doc_commands.py::test_documented_cheap_command_runs"),
    "msrl convert hf-to-mcore": (f"{SMOKE}::test_msrl_convert_both_ways_with_verify",),
    "msrl convert mcore-to-hf": (f"{SMOKE}::test_msrl_convert_both_ways_with_verify",
                                 "tests/e2e/test_trainer.py::test_training_checkpoint_converts_without_hf_config"),
    "msrl convert merge-lora": (f"{SMOKE}::test_msrl_convert_merge_lora",),
    "msrl routing inspect": ("tests/unit/test_moe.py::test_cli_inspect_compare",),
    "msrl routing compare": ("tests/unit/test_moe.py::test_cli_inspect_compare",),
    "msrl bench kv": (f"{SMOKE}::test_msrl_bench_kv",),
    "msrl bench sync": (f"{SMOKE}::test_msrl_bench_sync",),
    "msrl bench learner": ("tests/e2e/test_bench_learner.py::test_bench_learner_prints_its_ratios",),
    "msrl bench routing": (f"{SMOKE}::test_msrl_bench_routing",),
    "msrl bench convert": (f"{SMOKE}::test_bench_convert_as_msrl_and_as_a_script",),
    "msrl bench async": (f"{SMOKE}::test_msrl_bench_async",),
    "msrl compare": ("tests/unit/test_run_views.py::test_msrl_compare_cli",),
    "python benchmarks/convert.py": (f"{SMOKE}::test_bench_convert_as_msrl_and_as_a_script",),
    "python -m megatron_sparse_rl.demo": ("tests/unit/test_demo_entry.py::test_previous_run_is_replaced_but_nothing_else",),
    "python -m megatron_sparse_rl.data.calc_task": (
        "tests/unit/test_envs.py::test_calc_task_cli_writes_the_digit_range_asked_and_refuses_a_bad_one",),
    "python -m megatron_sparse_rl.launch.local_slurm": (f"{SMOKE}::test_local_slurm_usage",
                                                        "tests/e2e/test_slurm.py::test_job_runs_to_completion"),
    "python -m megatron_sparse_rl.launch.torchrun": (
        "tests/e2e/test_trainer_disaggregated.py::test_two_ranks_on_a_users_jsonl_prompts",),
    "python -m megatron_sparse_rl.observability.plot": (f"{SMOKE}::test_plot_module_writes_a_png",),
    "python -m megatron_sparse_rl.tools.gen_config_docs": (
        "tests/unit/test_config_docs.py::test_generated_reference_has_a_row_for_every_field_it_lists",),
    # experiment-scale: their --quick smokes are marked slow (make test-all)
    "python experiments/routing_stability.py": ("tests/e2e/test_routing_stability.py::test_files_rows_and_time",),
    "python experiments/sparse_rl_compare.py": ("tests/e2e/test_sparse_rl_compare.py::test_files_rows_and_progress_lines",),
    "python experiments/sparse_rl_fixed_memory.py": ("tests/e2e/test_sparse_rl_fixed_memory.py::test_files_rows_and_statistics",),
    "python experiments/tool_calc_control.py": (f"{SMOKE}::test_tool_calc_control_runs_both_arms",),
    "pytest": ("tests/unit/test_doc_commands.py::test_documented_files_exist",),
}
"""Command key -> the tests that run it ("path::function")."""

COMMANDS = documented_commands()
CHEAP = ("msrl plan", "msrl validate", "msrl launch slurm")
"""Keys whose concrete doc lines run here in-process (seconds each); `launch slurm` only with --dry-run."""


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_the_docs_show_commands():
    keys = {k for c in COMMANDS for k in command_keys(c.text)}
    assert {"make demo", "make test", "msrl train", "msrl bench kv", "msrl plan"} <= keys, sorted(keys)


def test_every_documented_command_has_a_smoke_test():
    missing = sorted({f"{k!r} ({c.where()}: {c.text})" for c in COMMANDS for k in command_keys(c.text)
                      if k not in SMOKES})
    assert not missing, "documented commands no test runs (add one to SMOKES):\n" + "\n".join(missing)
    documented = {k for c in COMMANDS for k in command_keys(c.text)}
    assert not set(SMOKES) - documented, f"SMOKES lists commands the docs no longer show: {set(SMOKES) - documented}"


@pytest.mark.parametrize("test_id", sorted({t for tests in SMOKES.values() for t in tests}))
def test_each_named_smoke_test_exists(test_id):
    path, function = test_id.split("::")
    assert (REPO / path).is_file(), test_id
    assert function in _functions(REPO / path), f"{path} has no test {function}"


def _msrl_lines() -> list:
    """Concrete `msrl` doc lines with arguments beyond their command words."""
    out = []
    for c in COMMANDS:
        w = [x.removeprefix(".venv/bin/") for x in words(c.text)]
        keys = command_keys(c.text)
        if w[:1] == ["msrl"] and c.concrete and keys and len(w) > len(keys[0].split()):
            out.append(pytest.param(c, id=f"{c.where()}"))
    return out


@pytest.mark.parametrize("command", _msrl_lines())
def test_documented_msrl_line_parses(command, capsys):
    """An unknown flag, subcommand or choice fails; a line that shows a few flags without the required arguments
    (`msrl train --verbose`) is a mention, not a command, and passes."""
    from megatron_sparse_rl.tools.cli import build_parser

    argv = words(command.text)[1:]
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as e:
        err = capsys.readouterr().err
        if e.code != 0 and "the following arguments are required" not in err:
            pytest.fail(f"{command.where()}: `{command.text}` does not parse (exit {e.code}): {err}")


def _cheap_lines() -> list:
    out = []
    for c in COMMANDS:
        keys = command_keys(c.text)
        if not (c.concrete and keys and keys[0] in CHEAP):
            continue
        if all(w.startswith("-") for w in words(c.text)[len(keys[0].split()):][:1] or ["-"]):
            continue  # a mention of flags (`msrl validate --no-files`), not a command to run
        if keys[0] == "msrl launch slurm" and "--dry-run" not in c.text:
            continue
        out.append(pytest.param(c, id=c.where()))
    return out


@pytest.mark.parametrize("command", _cheap_lines())
def test_documented_cheap_command_runs(command, capsys, monkeypatch, tmp_path):
    """Runs as shown, from the repository root; `msrl plan` may exit 1 (no layout fits is an answer, printed)."""
    from megatron_sparse_rl.tools.cli import main

    monkeypatch.chdir(REPO)
    code = main(words(command.text)[1:])
    out, err = capsys.readouterr()
    allowed = (0, 1) if command.text.split()[1] == "plan" else (0,)
    assert code in allowed, f"{command.where()}: `{command.text}` exited {code}: {err[-2000:]}"
    assert out.strip(), f"{command.where()}: printed nothing"
    assert "Traceback" not in out + err


def test_documented_files_exist():
    """Paths a documented command names: pytest files, scripts, configs."""
    missing = []
    for c in COMMANDS:
        for w in words(c.text):
            w = w.split("::")[0]
            if w.endswith((".py", ".yaml")) and "/" in w and not w.startswith(("runs/", "/tmp/")) and "*" not in w:
                if not (REPO / w).exists():
                    missing.append(f"{c.where()}: {w}")
    assert not missing, "\n".join(missing)


def test_make_targets_exist():
    targets = sorted({k.split()[1] for c in COMMANDS for k in command_keys(c.text) if k.startswith("make ")})
    for target in targets:
        done = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "MAKEFLAGS": ""})
        assert done.returncode == 0, f"make -n {target}: {done.stderr}"
