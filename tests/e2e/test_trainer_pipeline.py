"""The RL trainer at an uneven, interleaved pipeline: `msrl launch local --nproc 2` on a tiny Qwen3-MoE of 5 layers at
pp 2 x vpp 2 (virtual stages 2,1,1,1), colocated (each rank also an engine rank): an SFT warm-start step, then 2 RL
steps with a KL term to the frozen initial model (a second learner, also interleaved), weight sync into the engines and
its probe after every sync (the probe is one row: the learner pads it to pp micro-batches).

The fast test checks the run: finite metrics, the probe's agreement, and pi_theta = pi_old on the first update (a
training forward that mixed up micro-batches, as batched p2p at pp 2 did, shows there as ratio_max != 1). The slow one
runs the same at vpp 1 and compares step 1 (the same seed: the same SFT step, rollouts, losses)."""
import math
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_trainer import _records, _rl, model_dir  # noqa: F401  (the module's tiny model, built once)
from tests.msrl import MSRL

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _run(run_dir: Path, model_dir: Path, vpp: int) -> tuple[dict, str]:
    """A 2-step run at pp 2 x `vpp`: its RL records by step and its console."""
    sets = [f"logging.dir={run_dir}", f"model.path={model_dir}", "model.tiny.layers=5", "parallel.pp=2",
            f"parallel.vpp={vpp}", "trainer.steps=2", "trainer.prompts_per_step=4", "rollout.sampling.n=4",
            "learner.micro_batch_size=2", "trainer.eval_prompts=2", "trainer.sft.max_steps=1",
            "trainer.sft.batch_size=8", "rollout.sampling.max_tokens=6", "rollout.max_model_len=64",
            "checkpoint.save_every=0", "logging.tensorboard=false", "trainer.verify_sync_every=1",
            "algorithm.kl.coef=0.05"]
    cmd = [*MSRL, "launch", "local", str(REPO / "configs/tiny_moe.yaml"), "--nproc", "2", "--set", *sets]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _rl(_records(run_dir)), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory, model_dir):
    run_dir = tmp_path_factory.mktemp("vpp2")
    rl, console = _run(run_dir, model_dir, vpp=2)
    return run_dir, rl, console


def test_two_step_rl_run_at_uneven_interleaved_pipeline(interleaved):
    run_dir, rl, console = interleaved
    assert "pipeline virtual stages 2,1,1,1 (pp 2 x vpp 2; balanced, automatic)" in console
    assert sorted(rl) == [1, 2]
    for step, rec in rl.items():
        for key in ("rollout/reward", "mismatch/k3", "train/grad_norm", "loss/kl_ref", "sync/probe_max_abs_diff"):
            assert key in rec, f"step {step} lacks {key}"
        assert not rec.get("nonfinite"), f"step {step} has non-finite metrics {rec['nonfinite']}"
        assert all(math.isfinite(v) for v in rec.values() if isinstance(v, float))
        assert rec["train/grad_norm"] > 0 and rec["loss/kl_ref"] > 0  # the KL term trains on the last stage
        assert rec["sync/probe_max_abs_diff"] < 1e-4  # fp32 engine and learner on the probe (seen ~2e-6)
        assert abs(rec["mismatch/k1"]) < 1e-5  # pi_old (the step's whole batch, interleaved) vs the engine's mu
    # one update per step: its forward is pi_old's, so every ratio is 1 up to fp32 rounding
    assert abs(rl[1]["loss/ratio_max"] - 1) < 1e-5 and abs(rl[1]["loss/ratio_mean"] - 1) < 1e-5
    assert (run_dir / "hf_final" / "config.json").is_file()


@pytest.mark.slow
def test_interleaved_run_matches_the_same_run_at_vpp1(interleaved, model_dir, tmp_path):
    """Step 1 of the same run at pp 2 without interleaving: the same samples (seeded, weights equal to fp32
    rounding), and loss, KL to the reference, entropy and grad norm equal within fp32 reordering of the same sums
    (measured: |diff| <= 3e-7 on loss/value, loss/kl_ref, loss/entropy; grad norm 3e-6 relative)."""
    _, rl, _ = interleaved
    plain, _ = _run(tmp_path / "vpp1", model_dir, vpp=1)
    ours, theirs = rl[1], plain[1]
    assert ours["train/tokens"] == theirs["train/tokens"] and ours["rollout/reward"] == theirs["rollout/reward"]
    for key in ("loss/value", "loss/kl_ref", "loss/entropy", "loss/ratio_mean"):
        assert abs(ours[key] - theirs[key]) < 1e-5, (key, ours[key], theirs[key])
    assert abs(ours["train/grad_norm"] - theirs["train/grad_norm"]) < 1e-4 * theirs["train/grad_norm"]
