"""`msrl launch`: rendered sbatch scripts (bash -n, counts, requeue, the rendezvous address and interface), launch
config errors, local command."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from megatron_sparse_rl.config import ConfigError
from megatron_sparse_rl.launch.checks import check_launch
from megatron_sparse_rl.launch.load import job_overrides, load_run
from megatron_sparse_rl.launch.slurm import render_sbatch
from megatron_sparse_rl.tools import cli

REPO = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, **sections) -> Path:
    data = {"model": {"path": "/cluster/models/never-here"}, "logging": {"dir": "runs/x"}}
    data.update(sections)
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(data))
    return path


def _render(tmp_path, overrides=(), **sections) -> str:
    path = _cfg(tmp_path, **sections)
    run, launch = load_run(path, overrides)
    check_launch(run, launch, slurm=True)
    return render_sbatch(run, launch, path, job_overrides(overrides), workdir=str(tmp_path))


def _bash_n(script: str, tmp_path: Path) -> None:
    f = tmp_path / "job.sbatch"
    f.write_text(script)
    r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _sbatch(script: str) -> dict[str, str]:
    return dict(re.match(r"#SBATCH --([\w-]+)=?(.*)", line).groups()
                for line in script.splitlines() if line.startswith("#SBATCH"))


CASES = [  # (launch section, parallel section, expected nodes, tasks per node, gpus per node)
    ({"nodes": 1, "nproc_per_node": 8, "slurm": {"partition": "gpu"}}, {"tp": 2}, 1, 1, 8),
    ({"nodes": 32, "nproc_per_node": 8, "slurm": {"partition": "h100", "account": "rl", "time": "2-00:00:00"}},
     {"tp": 8, "pp": 8, "ep": 32, "sequence_parallel": True}, 32, 1, 8),
    ({"nodes": 5, "nproc_per_node": 4, "rollout_nodes": 1,
      "slurm": {"partition": "a100", "mode": "srun", "container_image": "nvcr.io/x:1", "container_mounts": ["/d:/d"]}},
     {"tp": 4, "ep": 2}, 5, 4, 4),
    ({"nodes": 2, "nproc_per_node": 2, "slurm": {"partition": "cpu", "gpus_per_node": 0, "requeue": False}},
     {}, 2, 1, None),
]


@pytest.mark.parametrize("launch,parallel,nodes,tasks,gpus", CASES)
def test_rendered_script_parses_and_counts(tmp_path, launch, parallel, nodes, tasks, gpus):
    script = _render(tmp_path, launch=launch, parallel=parallel)
    _bash_n(script, tmp_path)
    opts = _sbatch(script)
    assert opts["nodes"] == str(nodes) and opts["ntasks-per-node"] == str(tasks)
    assert opts.get("gpus-per-node") == (str(gpus) if gpus else None)
    assert opts["partition"] == launch["slurm"]["partition"]
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert f"--nodes={nodes}" in srun and f"--ntasks-per-node={tasks}" in srun
    if launch["slurm"].get("mode", "torchrun") == "torchrun":
        assert f"--nproc-per-node={launch['nproc_per_node']}" in script and '--node-rank="$SLURM_NODEID"' in script
        # node 0's agent serves the store on $MASTER_ADDR only (launch/torchrun.py), not stock torchrun's
        assert 'exec "$0" -m megatron_sparse_rl.launch.torchrun --nnodes="$SLURM_NNODES"' in script
        assert "torch.distributed.run" not in script
    else:
        assert 'RANK="$SLURM_PROCID"' in script and "--container-image=nvcr.io/x:1" in srun
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert f"--output={tmp_path}/runs/x/slurm/%x-%j.out" in script
    if launch["slurm"].get("requeue", True):
        assert "requeue" in opts and opts["signal"] == "B:USR1@120"
        assert "trap msrl_preempt USR1" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    else:
        assert "no-requeue" in opts and "trap msrl_preempt" not in script


def test_overrides_and_config_are_forwarded_quoted(tmp_path):
    script = _render(tmp_path, ["learner.seed=7", "logging.dir=runs/a b", "launch.slurm.time=01:00:00"],
                     launch={"nproc_per_node": 2, "slurm": {"partition": "p", "account": "acct"}})
    _bash_n(script, tmp_path)
    program = next(line for line in script.splitlines() if line.startswith("PROGRAM=("))
    assert program.startswith(f"PROGRAM=(megatron_sparse_rl.tools.cli train {tmp_path}/run.yaml "
                              "--set learner.seed=7 --set 'logging.dir=runs/a b'")
    assert "#SBATCH --account=acct" in script and "#SBATCH --time=01:00:00" in script


def test_layout_comment_names_learner_and_rollout_ranks(tmp_path):
    script = _render(tmp_path, launch={"nodes": 3, "nproc_per_node": 4, "rollout_nodes": 1,
                                       "slurm": {"partition": "p"}})
    assert "learner nodes 0-1 (ranks 0-7), rollout nodes 2-2 (ranks 8-11)" in script
    one_node = _render(tmp_path, launch={"nproc_per_node": 4, "rollout_ranks": 1, "slurm": {"partition": "p"}})
    assert "# layout: 1 node x 4 ranks; learner ranks 0-2, rollout ranks 3-3 (disaggregated)" in one_node


@pytest.mark.parametrize("launch,parallel,message", [
    ({"nodes": 3, "nproc_per_node": 8, "slurm": {"partition": "p"}}, {"tp": 8, "pp": 2},
     "learner ranks = (launch.nodes 3 - launch.rollout_nodes 0) * launch.nproc_per_node 8 = 24 is not divisible "
     "by parallel.tp * parallel.pp = 8 * 2 = 16"),
    ({"nodes": 2, "nproc_per_node": 8, "slurm": {"partition": "p"}}, {"tp": 2, "ep": 3},
     "not divisible by parallel.ep * parallel.etp = 3 * 1"),
    ({"nodes": 2, "nproc_per_node": 8}, {}, "launch.slurm.partition is empty"),
    ({"nodes": 1, "nproc_per_node": 8, "slurm": {"partition": "p", "gpus_per_node": 4}}, {},
     "launch.slurm.gpus_per_node = 4 must equal launch.nproc_per_node = 8"),
    ({"nodes": 2, "nproc_per_node": 4, "slurm": {"partition": "p"}}, {"tp": 8},
     "parallel.tp = 8 exceeds launch.nproc_per_node = 4"),
])
def test_bad_launch_configs_error_clearly(tmp_path, launch, parallel, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _render(tmp_path, launch=launch, parallel=parallel)


@pytest.mark.parametrize("launch,message", [
    ({"nodes": 2, "rollout_nodes": 2}, "launch.rollout_nodes must be in [0, launch.nodes - 1 = 1]"),
    ({"slurm": {"time": "forever"}}, "launch.slurm.time must look like"),
    ({"slurm": {"partiton": "p"}}, "unknown key launch.slurm.partiton (did you mean launch.slurm.partition?)"),
    ({"slurm": {"extra_sbatch": ["constraint=h100"]}}, "must be single options starting with '-'"),
    ({"slurm": {"interface": "ib0; rm -rf ~"}}, "launch.slurm.interface must be a network interface name"),
    ({"slurm": {"interface": "a-name-of-16-chr"}}, "launch.slurm.interface must be a network interface name"),
])
def test_launch_fields_check_themselves(tmp_path, launch, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_run(_cfg(tmp_path, launch=launch))


def test_cli_dry_run_prints_script_and_bad_config_exits_2(tmp_path, capsys):
    path = _cfg(tmp_path, launch={"nodes": 2, "nproc_per_node": 2, "rollout_nodes": 1})
    assert cli.main(["launch", "slurm", str(path), "--dry-run", "--set", "launch.slurm.partition=p"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash")
    assert cli.main(["launch", "slurm", str(path), "--dry-run"]) == 2
    assert "launch.slurm.partition is empty" in capsys.readouterr().err


def test_local_dry_run_command(tmp_path, capsys):
    path = _cfg(tmp_path, model={"path": str(tmp_path / "m"), "tiny": {}}, parallel={"tp": 2, "sequence_parallel": True})
    assert cli.main(["launch", "local", "--nproc", "2", str(path), "--dry-run", "--set", "learner.seed=3"]) == 0
    out = capsys.readouterr().out.split()
    # torchrun with its store on loopback only (launch/torchrun.py; stock --standalone serves every interface)
    assert out[:3] == [sys.executable, "-m", "megatron_sparse_rl.launch.torchrun"]
    assert out[3:8] == ["--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1", "--master-port=0",
                        "--nproc-per-node=2"]
    assert "--standalone" not in out and not any(o.startswith("--rdzv") for o in out)
    assert out[8] == "--shutdown-timeout=330"  # trainer.stop_timeout_s 300 for the ranks' checkpoint, + 30 s
    assert out[9:13] == ["-m", "megatron_sparse_rl.tools.cli", "train", str(path)]
    assert "learner.seed=3" in out and "launch.nproc_per_node=2" in out
    assert cli.main(["launch", "local", "--nproc", "3", str(path), "--dry-run"]) == 2  # tp=2 does not divide 3


def _python_line(script: str) -> str:
    return next(line for line in script.splitlines() if line.startswith("PYTHON="))


@pytest.mark.parametrize("launch, python, source", [
    ({}, sys.executable, "the interpreter that rendered this script"),  # never a bare `python` from PATH
    ({"python": "/opt/py/bin/python3"}, "/opt/py/bin/python3", "launch.python"),
    ({"python": "envs/a/bin/python"}, "{workdir}/envs/a/bin/python", "launch.python"),
    ({"python": "python3.11"}, "python3.11", "launch.python"),  # a command name: the nodes' PATH, as asked
    ({"slurm": {"venv": ".venv"}}, "{workdir}/.venv/bin/python", "launch.slurm.venv"),
    ({"slurm": {"mode": "srun", "container_image": "nvcr.io/x:1"}}, "python",
     "the container image's own python (launch.slurm.container_image)"),
])
def test_the_job_runs_the_rendering_interpreter_or_the_named_one(tmp_path, launch, python, source):
    slurm = {"partition": "p", **launch.pop("slurm", {})}
    script = _render(tmp_path, launch={**launch, "slurm": slurm})
    _bash_n(script, tmp_path)
    assert _python_line(script) == f"PYTHON={python.format(workdir=tmp_path)}  # {source}"
    assert 'exec "$0" -m' in script and '"$PYTHON" "${PROGRAM[@]}"' in script  # the ranks run $PYTHON


@pytest.mark.parametrize("launch, message", [
    ({"python": "/opt/py/bin/python", "slurm": {"partition": "p", "venv": ".venv"}},
     "set one of launch.python ('/opt/py/bin/python') and launch.slurm.venv ('.venv')"),
    ({"python": " python", "slurm": {"partition": "p"}}, "launch.python must be a path or a command name"),
])
def test_conflicting_interpreters_exit_2_and_write_nothing(tmp_path, monkeypatch, capsys, launch, message):
    monkeypatch.chdir(tmp_path)  # the job's workdir: its log dir would be created here
    path = _cfg(tmp_path, launch=launch)
    assert cli.main(["launch", "slurm", str(path)]) == 2  # not a dry run: it would write and submit
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # no log dir, no script


def _rendezvous_lines(script: str) -> str:
    """The script's lines from `PYTHON=` up to the MASTER_PORT line: where the rendezvous address comes from."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("PYTHON="))
    end = next(i for i, line in enumerate(lines) if line.startswith("MASTER_PORT="))
    return "\n".join(lines[start:end])


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_the_rendezvous_listens_on_the_named_interface(tmp_path, mode):
    lo = next(n for n, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs))
    script = _render(tmp_path, launch={"nodes": 2, "nproc_per_node": 2,
                                       "slurm": {"partition": "p", "mode": mode, "interface": lo}})
    _bash_n(script, tmp_path)
    assert 'MASTER_ADDR=$(scontrol show hostnames' not in script
    assert "export MASTER_ADDR MASTER_PORT" in script
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    shown = 'echo "$MASTER_ADDR $GLOO_SOCKET_IFNAME $NCCL_SOCKET_IFNAME"'
    r = subprocess.run(["bash", "-c", _rendezvous_lines(script) + "\n" + shown], capture_output=True, text=True,
                       env=env)
    assert (r.returncode, r.stdout.split()) == (0, ["127.0.0.1", lo, lo]), r.stderr  # the address psutil names
    kept = subprocess.run(["bash", "-c", _rendezvous_lines(script) + "\n" + shown], capture_output=True, text=True,
                          env={**env, "NCCL_SOCKET_IFNAME": "ib1"})
    assert kept.stdout.split() == ["127.0.0.1", lo, "ib1"]  # a value the job already has is kept


def test_an_interface_missing_on_the_first_node_stops_the_script(tmp_path):
    script = _render(tmp_path, launch={"nodes": 2, "slurm": {"partition": "p", "interface": "nosuchif0"}})
    marker = tmp_path / "ranks-started"
    r = subprocess.run(["bash", "-c", _rendezvous_lines(script) + f"\ntouch {marker}"], capture_output=True,
                       text=True)
    assert r.returncode == 2
    assert "msrl: launch.slurm.interface = nosuchif0: no IPv4 address on" in r.stderr
    assert not marker.exists()  # nothing after it ran


def test_without_an_interface_the_first_hostname_is_the_rendezvous(tmp_path):
    script = _render(tmp_path, launch={"nodes": 2, "slurm": {"partition": "p"}})
    assert "SOCKET_IFNAME" not in script  # gloo and NCCL pick their own, as before
