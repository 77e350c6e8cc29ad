"""No code from a checkpoint file runs on resume or on `msrl convert` (formats/safe_load.py,
patches/torch_dist_safe_load.py, learner/checkpoint.py's JSON/safetensors state), and a conversion never writes
into, over or around its own input.

Every file a load unpickles gets a payload: a pickle whose rebuild would call `_make_marker`, which creates a marker
file. Each is refused with an UnsafeFileError naming the file and the payload's function; the marker never exists
and the checkpoint's listing and checksums are unchanged. The legit files still load: the metadata equals what a
plain unpickling gives, the RNG states resume the same random streams, the common state reads back as saved."""
import io
import json
import pickle
import random
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_sparse_rl.checkpoint import convert
from megatron_sparse_rl.checkpoint.checks import check_torch_dist_files
from megatron_sparse_rl.formats.safe_load import UnsafeFileError, load_torch_file, read_dcp_metadata
from megatron_sparse_rl.learner import checkpoint as C
from tests.msrl import MSRL
from tests.snapshot import snapshot
from tests.unit.test_convert_checks import no_layout, outs, torch_dist  # noqa: F401 - fixtures reused

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = f"{__name__}._make_marker"


def _make_marker(path):
    Path(path).write_text("code from a checkpoint file ran\n")
    return None


class Payload:
    """Pickles as a call of `_make_marker(marker)`: unpickling it unrestricted creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (_make_marker, (self.marker,))


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "a checkpoint file's payload ran"


def _refused(call, path: Path, root: Path) -> str:
    """`call()` raises UnsafeFileError naming `path` and the payload, and leaves `root` as it was."""
    before = snapshot(root)
    with pytest.raises(UnsafeFileError) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(f"{path}") and PAYLOAD in msg and "refused to load" in msg, msg
    assert snapshot(root) == before
    return msg


def _poison_metadata(root: Path, marker: Path) -> Path:
    """The checkpoint's real metadata with its storage_meta replaced by a payload."""
    path = root / ".metadata"
    meta = pickle.loads(path.read_bytes())
    meta.storage_meta = Payload(marker)
    path.write_bytes(pickle.dumps(meta))
    return path


# ---- torch_dist metadata -------------------------------------------------------------------------------------
def test_legit_metadata_reads_as_a_plain_unpickling_would(torch_dist):
    reference = pickle.loads((torch_dist / ".metadata").read_bytes())
    meta = read_dcp_metadata(torch_dist / ".metadata")
    assert meta.state_dict_metadata == reference.state_dict_metadata
    assert meta.storage_data == reference.storage_data


def test_metadata_payload_is_refused_by_the_convert_checks_and_convert(torch_dist, outs, no_layout, marker):
    path = _poison_metadata(torch_dist, marker)
    _refused(lambda: check_torch_dist_files(torch_dist), path, torch_dist)
    _refused(lambda: convert.mcore_to_hf(torch_dist, outs / "existing", overwrite=True), path, outs.parent)


def test_metadata_payload_is_refused_by_resume_before_anything_loads(torch_dist, marker):
    path = _poison_metadata(torch_dist, marker)
    _refused(lambda: C.load_learner(None, torch_dist), path, torch_dist)  # refused before the learner is touched


def test_patched_torch_reader_refuses_the_metadata_payload(torch_dist, marker):
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_sparse_rl.patches import torch_dist_safe_load

    torch_dist_safe_load.apply()
    torch_dist_safe_load.apply()  # idempotent
    assert FileSystemReader(str(torch_dist)).read_metadata().storage_data  # legit metadata reads
    path = _poison_metadata(torch_dist, marker)
    _refused(lambda: FileSystemReader(str(torch_dist)).read_metadata(), path, torch_dist)


@pytest.mark.parametrize("version,ok", [("2.13.0", True), ("2.11.0+cu130", True), ("2.12.0", False)])
def test_patch_version_check(monkeypatch, version, ok):
    """torch 2.11.0 (the GPU machine's) and 2.13.0 have the same patched functions; others are refused by name."""
    from megatron_sparse_rl.patches import torch_dist_safe_load

    monkeypatch.setattr(torch, "__version__", version)
    if ok:
        torch_dist_safe_load._check_versions()
        return
    with pytest.raises(RuntimeError, match="'torch': 2.12.0|'torch': '2.12.0'"):
        torch_dist_safe_load._check_versions()


def test_metadata_placing_data_outside_the_checkpoint_is_refused(torch_dist):
    path = torch_dist / ".metadata"
    meta = pickle.loads(path.read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    path.write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeFileError) as err:
        check_torch_dist_files(torch_dist)
    assert str(err.value).startswith(f"{path}: refused to load: it places data in '../elsewhere.distcp'")


# ---- Megatron's common.pt and the byte items inside *.distcp -------------------------------------------------
def test_megatron_common_payload_is_refused(torch_dist, marker):
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    from megatron_sparse_rl.patches import torch_dist_safe_load

    path = torch_dist / "common.pt"
    torch.save({"optimizer": {"param_groups": [Payload(marker)]}}, path)
    _refused(lambda: check_torch_dist_files(torch_dist), path, torch_dist)
    _refused(lambda: C.load_learner(None, torch_dist), path, torch_dist)
    torch_dist_safe_load.apply()
    _refused(lambda: TorchCommonLoadStrategy().load_common(torch_dist), path, torch_dist)


def _dcp_with_byte_item(root: Path, item) -> Path:
    """A torch_dist checkpoint with a tensor and a byte item holding the torch.save bytes of `item`, as Megatron
    stores a ShardedObject (torch's planner torch.saves a non-tensor leaf into the shard file)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process without a process group is the intent here
        warnings.simplefilter("ignore")
        dcp.save({"decoder.w": torch.ones(4, 2), "decoder.x._extra_state/shard_0_1": item},
                 checkpoint_id=str(root))
    return root / "__0_0.distcp"


def test_byte_item_payload_is_refused_naming_the_shard_file_and_item(torch_dist, marker):
    for stale in torch_dist.glob("__*.distcp"):
        stale.unlink()
    shard = _dcp_with_byte_item(torch_dist, Payload(marker))
    msg = _refused(lambda: check_torch_dist_files(torch_dist), shard, torch_dist)
    assert "item 'decoder.x._extra_state/shard_0_1'" in msg
    _refused(lambda: C.load_learner(None, torch_dist), shard, torch_dist)


def test_patched_load_planner_refuses_a_byte_item_payload_and_loads_a_legit_one(tmp_path, marker):
    import torch.distributed.checkpoint as dcp

    from megatron_sparse_rl.patches import torch_dist_safe_load

    torch_dist_safe_load.apply()
    _dcp_with_byte_item(tmp_path / "ok", "legit extra state")
    state = {"decoder.w": torch.zeros(4, 2), "decoder.x._extra_state/shard_0_1": io.BytesIO()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path / "ok"))
        assert torch.equal(state["decoder.w"], torch.ones(4, 2))
        assert state["decoder.x._extra_state/shard_0_1"] == "legit extra state"
        _dcp_with_byte_item(tmp_path / "bad", Payload(marker))
        with pytest.raises(BaseException) as err:  # CheckpointException (a BaseException) wrapping ours
            dcp.load(state, checkpoint_id=str(tmp_path / "bad"))
    assert PAYLOAD in str(err.value) and "torch_dist item 'decoder.x._extra_state/shard_0_1'" in str(err.value)


# ---- our own state: common_state.json / rng_rank*.safetensors, and the legacy .pt files ----------------------
def test_common_state_reads_back_as_saved_and_refuses_what_json_would_change(tmp_path):
    state = {"step": 3, "scheduler": {"max_lr": 0.1, "lr_decay_style": "cosine", "num_steps": 3},
             "extra": {"counters": {"rl_step": 3, "sft_done": True}, "task": {"train": {"index": 7}}},
             "world_size": 2}
    C.write_common_state(tmp_path, state)
    assert C.read_common_state(tmp_path) == {"format": C.COMMON_FORMAT, **state}
    assert json.loads((tmp_path / C.COMMON).read_text())["step"] == 3  # plain JSON, nothing to unpickle
    (tmp_path / C.COMMON).unlink()
    with pytest.raises(TypeError) as err:
        C.write_common_state(tmp_path, {**state, "extra": {"layout": (1, 2)}})
    assert str(err.value).startswith(f"{tmp_path / C.COMMON}: the common state would not read back as saved")
    assert not (tmp_path / C.COMMON).exists()


def test_legacy_common_state_loads_and_its_payload_is_refused(torch_dist, marker):
    (torch_dist / C.COMMON).unlink()
    legacy = torch_dist / C.LEGACY_COMMON
    torch.save({"step": 2, "scheduler": {"num_steps": 2}, "extra": {"a": 1}, "world_size": 1}, legacy)
    assert C.read_common_state(torch_dist) == {"step": 2, "scheduler": {"num_steps": 2}, "extra": {"a": 1},
                                               "world_size": 1}
    torch.save({"step": 2, "extra": Payload(marker)}, legacy)
    _refused(lambda: C.read_common_state(torch_dist), legacy, torch_dist)
    _refused(lambda: C.load_learner(None, torch_dist), legacy, torch_dist)


def _draws() -> list:
    return [random.random(), random.gauss(0, 1), *np.random.rand(3).tolist(), np.random.standard_normal(),
            *torch.rand(3).tolist()]


@pytest.mark.parametrize("legacy", [False, True])
def test_rng_states_resume_the_same_streams(tmp_path, legacy):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # a cached gaussian in both generators' states
    if legacy:  # the torch.save form of checkpoints written before rng_rank*.safetensors
        torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                    "tracker": {}}, C.rng_file(tmp_path, 0, legacy=True))
    else:
        C._save_rng(C.rng_file(tmp_path, 0))
    expected = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert C._load_rng(tmp_path, 0)
    assert _draws() == expected
    assert not C._load_rng(tmp_path, 1)  # no file for that rank: nothing restored


def test_legacy_rng_payload_is_refused(tmp_path, marker):
    file = C.rng_file(tmp_path, 0, legacy=True)
    torch.save({"python": random.getstate(), "numpy": Payload(marker)}, file)
    _refused(lambda: C._load_rng(tmp_path, 0), file, tmp_path)


def test_load_torch_file_names_a_blocked_module(tmp_path):
    import os

    class System:
        def __reduce__(self):
            return (os.system, ("true",))

    path = tmp_path / "x.pt"
    torch.save({"x": System()}, path)
    with pytest.raises(UnsafeFileError) as err:
        load_torch_file(path)
    assert str(err.value).startswith(f"{path}: refused to load: it needs posix.system")


def test_cli_convert_prints_the_refusal_without_a_traceback(torch_dist, tmp_path, marker):
    path = _poison_metadata(torch_dist, marker)
    before = snapshot(tmp_path)
    proc = subprocess.run([*MSRL, "convert", "mcore-to-hf", "--mcore", str(torch_dist),
                           "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"UnsafeFileError: {path}: refused to load: it needs {PAYLOAD}" in proc.stderr
    assert proc.stderr.lstrip().startswith("error:") or "\nerror:" in proc.stderr
    assert snapshot(tmp_path) == before


# ---- a conversion never replaces its own input ------------------------------------------------------------------
def _own_input_refused(call, out: Path, given: Path, relation: str, root: Path) -> None:
    before = snapshot(root)
    with pytest.raises(ValueError) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(f"output {str(out.absolute())!r}") and f"{relation} the input {str(given)!r}" in msg, msg
    assert snapshot(root) == before


def test_convert_refuses_an_output_that_is_in_on_or_around_its_input(torch_dist, tmp_path, no_layout):
    m2h = convert.mcore_to_hf
    _own_input_refused(lambda: m2h(torch_dist, torch_dist, overwrite=True), torch_dist, torch_dist, "is", tmp_path)
    inside = torch_dist / "hf_out"
    _own_input_refused(lambda: m2h(torch_dist, inside), inside, torch_dist, "is inside", tmp_path)
    _own_input_refused(lambda: m2h(torch_dist, tmp_path, overwrite=True), tmp_path, torch_dist, "contains", tmp_path)
    link = tmp_path / "link"
    link.symlink_to(torch_dist, target_is_directory=True)
    _own_input_refused(lambda: m2h(link, torch_dist, overwrite=True), torch_dist, link, "is", tmp_path)
    _own_input_refused(lambda: m2h(torch_dist, link / "x"), link / "x", torch_dist, "is inside", tmp_path)
    side = tmp_path / "side"
    side.mkdir()
    _own_input_refused(lambda: m2h(torch_dist, side, hf_config_dir=side, overwrite=True), side, side, "is", tmp_path)


def test_hf_to_mcore_refuses_its_own_input(tmp_path, no_layout):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    hf = build_tiny_hf_model(tmp_path / "hf", seed=1)
    h2m = convert.hf_to_mcore
    _own_input_refused(lambda: h2m(hf, hf / "mc", tp=1, ep=1), hf / "mc", hf, "is inside", tmp_path)
    _own_input_refused(lambda: h2m(hf, tmp_path, tp=1, ep=1, overwrite=True), tmp_path, hf, "contains", tmp_path)
    convert._check_out((tmp_path / "hf_sibling").absolute(), False, [hf])  # beside the input: allowed


def test_convert_refuses_an_input_named_like_its_temporary_output(torch_dist, tmp_path, no_layout):
    staged = tmp_path / ".out.partial"  # the staging directory of --out tmp_path/out, removed by a conversion
    torch_dist.rename(staged)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as err:
        convert.mcore_to_hf(staged, tmp_path / "out")
    assert str(err.value).startswith(f"output {str(tmp_path / 'out')!r} (through the conversion's temporary path "
                                     f"{str(staged)!r}) is the input {str(staged)!r}")
    assert snapshot(tmp_path) == before
