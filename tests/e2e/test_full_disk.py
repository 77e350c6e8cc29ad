"""A run whose checkpoint directory fills up (a real tmpfs, mounted in a user and mount namespace of its own) stops
with one error naming the checkpoint and its directory, exit 2 and no traceback; the partial checkpoint is gone and
the older checkpoint is byte for byte as it was, and the run resumes from it once there is room. Before, Megatron's
writer raised a CheckpointException ("unexpected pos 704 vs 598") as a traceback and left the partial directory.
Skipped where `unshare -rm` cannot mount a tmpfs. About two minutes on two CPU cores (three tiny runs).

    .venv/bin/python -m pytest -q tests/e2e/test_full_disk.py
"""
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _can_mount_tmpfs(where: Path) -> bool:
    where.mkdir()
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"],
                          capture_output=True)
    return done.returncode == 0


def test_a_full_checkpoint_directory_names_it_and_keeps_the_older_checkpoint(tmp_path):
    if not _can_mount_tmpfs(tmp_path / "probe"):
        pytest.skip("unshare -rm cannot mount a tmpfs here")
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir(), out.mkdir()
    sets = [f"logging.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", f"checkpoint.dir={disk / 'ckpt'}",
            "trainer.prompts_per_step=2", "rollout.sampling.n=2", "rollout.sampling.max_tokens=8",
            "trainer.eval_every=0", "trainer.eval_prompts=2", "checkpoint.save_every=1", "logging.tensorboard=false"]
    train = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "megatron_sparse_rl.tools.cli", "train",
                                              str(REPO / "configs/tiny_moe.yaml"), "--set", *sets])
    listing = f"(cd {disk}/ckpt && find . -type f | sort | xargs sha256sum; find . | sort)"
    # Run 1 saves step 1 on a roomy tmpfs; the tmpfs then shrinks to what is used plus less than one more checkpoint,
    # so run 2's step-2 checkpoint cannot fit; run 3, after room is made, resumes from step 1.
    script = f"""set -u
mount -t tmpfs -o size=64m tmpfs {disk}
{train} trainer.steps=1 > {out}/run1.log 2>&1 || exit 11
used=$(du -sk {disk} | cut -f1)
mount -o remount,size=$((used + used / 2))k {disk}
{listing} > {out}/before.txt
{train} trainer.steps=2 > {out}/run2.out 2> {out}/run2.err; echo $? > {out}/run2.rc
{listing} > {out}/after.txt
mount -o remount,size=64m {disk}
{train} trainer.steps=2 > {out}/run3.log 2>&1; echo $? > {out}/run3.rc
ls {disk}/ckpt > {out}/final.txt
"""
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=800)
    assert done.returncode == 0, (done.stderr + (out / "run1.log").read_text())[-3000:]
    err = (out / "run2.err").read_text()
    assert (out / "run2.rc").read_text().strip() == "2", err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith(f"error: could not write the checkpoint '{disk / 'ckpt' / 'step_000002_sft_000000'}': "
                                f"No space left on device (") and f"on the filesystem of '{disk / 'ckpt'}'" in errors[0]
    assert "Traceback" not in err
    assert (out / "before.txt").read_text() == (out / "after.txt").read_text()  # no partial directory, step 1 as was
    assert "./step_000001_sft_000000/COMPLETE" in (out / "after.txt").read_text()
    assert (out / "run3.rc").read_text().strip() == "0", (out / "run3.log").read_text()[-3000:]
    resumed = f"at RL step 1 (SFT step 0) from {disk / 'ckpt' / 'step_000001_sft_000000'}"
    assert resumed in (out / "run3.log").read_text()
    assert (out / "final.txt").read_text().split() == ["step_000001_sft_000000", "step_000002_sft_000000"]
