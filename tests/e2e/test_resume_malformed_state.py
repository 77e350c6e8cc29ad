"""`msrl train` resuming a checkpoint whose own state files are of the wrong shape, with a manifest that matches them
(written so, not damaged afterwards), stops with one error naming the file and the field (a loop counter, the data
position, an RNG state), exit 2 and no traceback, before anything is loaded; the checkpoints and metrics.jsonl are as
they were. Before, `common_state.json` with `"step": "2"` ended in a TypeError traceback and an RNG file with a short
python state in random.setstate's "state vector is the wrong size", after the weights had loaded. About two and a half
minutes on two CPU cores.

    .venv/bin/python -m pytest -q tests/e2e/test_resume_malformed_state.py
"""
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.msrl import MSRL
from tests.snapshot import snapshot

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SETS = ["trainer.prompts_per_step=2", "rollout.sampling.n=2", "rollout.sampling.max_tokens=8", "trainer.eval_every=0",
        "trainer.eval_prompts=2", "checkpoint.save_every=1", "logging.tensorboard=false"]


def _train(run_dir: Path, model: Path, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run([*MSRL, "train", str(REPO / "configs/tiny_moe.yaml"), "--set", f"logging.dir={run_dir}",
                           f"model.path={model}", f"trainer.steps={steps}", *SETS],
                          cwd=REPO, capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    done = _train(root / "run", root / "model", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def _rewrite(checkpoint: Path, name: str, data: bytes) -> None:
    """Write `name` and record its size and sha256 in the manifest, as the writer of such a file would have."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))


def _common(checkpoint: Path, change) -> str:
    state = json.loads((checkpoint / "common_state.json").read_text())
    change(state)
    _rewrite(checkpoint, "common_state.json", json.dumps(state, indent=1).encode())
    return "common_state.json"


def _short_python_rng(checkpoint: Path) -> str:
    from safetensors import safe_open
    from safetensors.torch import save

    file = checkpoint / "rng_rank00000.safetensors"
    with safe_open(str(file), "pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    version, keys, gauss = json.loads(meta["python"])
    meta["python"] = json.dumps([version, keys[:3], gauss])
    _rewrite(checkpoint, file.name, save(tensors, metadata=meta))
    return file.name


CASES = {
    "rl_step": (lambda c: _common(c, lambda s: s["extra"]["counters"].update(rl_step=[2])),
                "field 'extra.counters.rl_step' must be an integer >= 0 (got [2])"),
    "task": (lambda c: _common(c, lambda s: s["extra"].update(task=[0, 4])),
             "field 'extra.task' is not a data position of this run's task (TypeError: "),
    "rng": (_short_python_rng, "field 'python' is not a python RNG state (ValueError: state vector is the wrong size)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resuming_a_malformed_state_names_the_file_and_field_and_changes_nothing(trained, tmp_path, case):
    run_dir = tmp_path / "run"
    shutil.copytree(trained / "run", run_dir)
    checkpoint = run_dir / "checkpoints" / "step_000002_sft_000000"
    break_it, detail = CASES[case]
    name = break_it(checkpoint)
    before, metrics = snapshot(run_dir / "checkpoints"), (run_dir / "metrics.jsonl").read_bytes()
    done = _train(run_dir, trained / "model", 3)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith(f"error: cannot resume from '{checkpoint}': {checkpoint / name}: {detail}"), errors[0]
    assert "move that checkpoint out of the directory to resume from the one before it" in errors[0]
    assert "Traceback" not in done.stderr
    assert snapshot(run_dir / "checkpoints") == before and (run_dir / "metrics.jsonl").read_bytes() == metrics

