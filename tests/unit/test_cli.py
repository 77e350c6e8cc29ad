"""The `msrl` command line: `validate` output and exit codes, the subcommand registry, --help everywhere.

    .venv/bin/python -m pytest -q tests/unit/test_cli.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_sparse_rl import tools
from megatron_sparse_rl.tools import cli

ROOT = Path(__file__).resolve().parents[2]
TINY_MOE = str(ROOT / "configs" / "tiny_moe.yaml")
TP2EP2 = str(ROOT / "configs" / "tiny_moe_tp2ep2.yaml")
# The tiny MoE of configs/tiny_moe.yaml, counted by hand: embeddings + lm head 2 * 64 * 64; per layer
# q,o 2 * 64 * 4 * 32, k,v 2 * 64 * 2 * 32, q/k norms 2 * 32, 2 layer norms 2 * 64,
# 4 experts * 3 * 64 * 64 + router 4 * 64; final norm 64.
TINY_MOE_PARAMS = 2 * 64 * 64 + 2 * (2 * 64 * 128 + 2 * 64 * 64 + 64 + 128 + 4 * 3 * 64 * 64 + 256) + 64


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_validate_prints_the_summary(capsys):
    assert cli.main(["validate", TINY_MOE]) == 0
    out = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM" in out
    assert f"parameters: {TINY_MOE_PARAMS:,}" in out
    assert "world 1 = tp 1 x pp 1 x dp 1; ep 1, etp 1" in out
    assert out.rstrip().endswith("ok")


def test_validate_tp2ep2_layout(capsys):
    assert cli.main(["validate", TP2EP2]) == 0
    assert "world 4 = tp 2 x pp 1 x dp 2; ep 2, etp 1" in capsys.readouterr().out
    assert cli.main(["validate", TP2EP2, "--world-size", "4"]) == 0


def test_validate_with_overrides_and_dump(capsys):
    argv = ["validate", TINY_MOE, "--set", "parallel.tp=2", "parallel.sequence_parallel=true",
            "--set", "launch.nproc_per_node=2", "--world-size", "2", "--dump"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "world 2 = tp 2 x pp 1 x dp 1" in out
    dumped = yaml.safe_load(out.split("---\n", 1)[1].rsplit("ok", 1)[0])
    assert dumped["parallel"]["tp"] == 2 and dumped["launch"]["nproc_per_node"] == 2


def test_validate_world_size_without_launch(capsys):
    """--world-size alone: configs/tiny_moe.yaml sets no launch.* (1 x 1), so 2 ranks are checked as given."""
    assert cli.main(["validate", TINY_MOE, "--world-size", "2", "--set", "parallel.ep=2"]) == 0
    out = capsys.readouterr().out
    assert "layout: world 2 = tp 1 x pp 1 x dp 2; ep 2, etp 1" in out
    assert "placement: colocated, every rank a learner and an engine rank (2 engines of tp 1)" in out
    assert cli.main(["validate", TINY_MOE, "--world-size", "3", "--set", "parallel.ep=2"]) == 2
    assert "not divisible by parallel.ep * parallel.etp = 2 * 1" in capsys.readouterr().err


def test_validate_prints_resolved_paths_and_max_model_len(capsys, tmp_path, monkeypatch):
    assert cli.main(["validate", TINY_MOE]) == 0
    out = capsys.readouterr().out
    assert f"paths (relative ones resolve against the working directory {ROOT}):\n" in out
    assert f"  model.path: {ROOT}/runs/tiny_moe/model\n  logging.dir: {ROOT}/runs/tiny_moe\n" in out
    assert f"  checkpoint.dir: {ROOT}/runs/tiny_moe/checkpoints (default <logging.dir>/checkpoints)\n" in out
    assert "max_model_len 2048 (the model's max_position_embeddings)" in out
    monkeypatch.chdir(tmp_path)  # the same config from elsewhere: its relative paths follow the working directory
    assert cli.main(["validate", TINY_MOE, "--set", f"data.eval_path={ROOT}/x.jsonl", "--no-files"]) == 0
    out = capsys.readouterr().out
    assert f"  model.path: {tmp_path}/runs/tiny_moe/model\n" in out and f"  data.eval_path: {ROOT}/x.jsonl\n" in out


@pytest.mark.parametrize("argv, message", [
    (["--set", "parallel.tpp=2"], "error: unknown key parallel.tpp (did you mean parallel.tp?)"),
    (["--set", "learner.micro_batch_size=four"], "error: learner.micro_batch_size: expected int, got 'four'"),
    (["--world-size", "2", "--set", "launch.nproc_per_node=4"],
     "error: world size 2 != launch.nodes * launch.nproc_per_node = 1 * 4 = 4"),
    (["--set", "parallel.ep=3", "launch.nproc_per_node=3"], "parallel.ep=3 must divide the expert count (4)"),
    (["--set", "algorithm.loss.name=gspoo"], "'gspoo' is not allowed; choose one of 'grpo'"),
    (["--set", "oops"], "error: override 'oops' must look like section.field=value"),
])
def test_validate_bad_config_exits_2(capsys, argv, message):
    assert cli.main(["validate", TINY_MOE, *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.err.startswith("error: ") and "ok" not in captured.out


def test_validate_missing_file_exits_2(capsys):
    assert cli.main(["validate", "configs/does_not_exist.yaml"]) == 2
    assert "error: config file 'configs/does_not_exist.yaml' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_design_command_has_help(capsys, name):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    assert f"usage: msrl {name}" in capsys.readouterr().out


def test_top_level_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("train", "validate", "convert", "launch", "plan", "routing", "bench"):
        assert name in out


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2


@pytest.mark.parametrize("name", [n for n in cli.COMMANDS if cli.load_command(n) is None])
def test_missing_command_says_not_implemented(capsys, name):
    assert cli.main([name, "x", "--anything"]) == 2
    assert f"error: not implemented yet: msrl {name}" in capsys.readouterr().err


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A folder searched for `megatron_sparse_rl.tools.<name>_cmd` modules, as if they had been added to tools/."""
    monkeypatch.setattr(tools, "__path__", [*tools.__path__, str(tmp_path)])
    yield tmp_path
    for name in ("megatron_sparse_rl.tools.hello_cmd", "megatron_sparse_rl.tools.broken_cmd"):
        sys.modules.pop(name, None)


def test_a_command_module_plugs_in(plugin_dir, monkeypatch, capsys):
    (plugin_dir / "hello_cmd.py").write_text(
        "def add_arguments(parser):\n    parser.add_argument('--name', required=True)\n\n"
        "def run(args):\n    print('hello', args.name)\n    return 3\n")
    monkeypatch.setitem(cli.COMMANDS, "hello", "say hello")
    assert cli.main(["hello", "--name", "moe"]) == 3
    assert capsys.readouterr().out == "hello moe\n"


def test_a_broken_command_module_is_not_reported_as_missing(plugin_dir, monkeypatch):
    (plugin_dir / "broken_cmd.py").write_text("import no_such_dependency_for_msrl_tests\n")
    monkeypatch.setitem(cli.COMMANDS, "broken", "needs a missing dependency")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_for_msrl_tests"):
        cli.main(["broken"])


def test_installed_console_script():
    script = Path(sys.executable).parent / "msrl"
    if not script.exists():
        pytest.skip(f"console script {script} not installed (run `pip install --no-deps -e .`)")
    ok = subprocess.run([str(script), "validate", "configs/tiny_moe.yaml"], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert f"parameters: {TINY_MOE_PARAMS:,}" in ok.stdout
    bad = subprocess.run([str(script), "validate", "configs/tiny_moe.yaml", "--set", "parallel.tp=3"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")
