"""HF <-> Megatron torch_dist conversion: bit-exact round trips at TP1, EP2 and TP2 (every tensor compared with
torch.equal against the original safetensors), cross-layout (saved at EP2, exported at TP1 and the reverse),
and bad inputs that must fail clearly and leave nothing behind."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed


def _load_dir(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_identical(original, converted):
    a, b = _load_dir(original), _load_dir(converted)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((Path(converted) / "config.json").read_text()) == \
        json.loads((Path(original) / "config.json").read_text())


# ---- workers (module level: pickled into spawned ranks) ---------------------------------------------
def roundtrip_tp1_worker(rank, world, hf, root):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf, f"{root}/mc_tp1", tp=1, ep=1)
    mcore_to_hf(f"{root}/mc_tp1", f"{root}/hf_tp1", max_shard_size="100KB")  # sharded, with an index


def two_rank_worker(rank, world, hf, root):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf, f"{root}/mc_ep2", tp=1, ep=2)
    mcore_to_hf(f"{root}/mc_ep2", f"{root}/hf_ep2", ep=2)
    mcore_to_hf(f"{root}/mc_tp1", f"{root}/hf_tp1_at_tp2", tp=2)  # saved at TP1, exported at TP2


def export_tp1_worker(rank, world, root):
    from megatron_sparse_rl.checkpoint.convert import mcore_to_hf

    mcore_to_hf(f"{root}/mc_ep2", f"{root}/hf_ep2_at_tp1")


def bad_inputs_worker(rank, world, hf, root, bad):
    """Each case: (name, exception type name, message). `bad` is an empty directory for the outputs."""
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    bad = Path(bad)
    results = []

    def case(name, fn):
        try:
            fn()
            results.append((name, None, ""))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results.append((name, type(e).__name__, str(e)))

    (bad / "exists").mkdir()
    (bad / "exists" / "keep.txt").write_text("mine")
    case("exists", lambda: hf_to_mcore(hf, bad / "exists", tp=1, ep=1))
    case("exists_m2h", lambda: mcore_to_hf(f"{root}/mc_tp1", bad / "exists"))

    sharded = Path(root) / "in_missing_shard"
    shutil.copytree(f"{root}/hf_tp1", sharded)
    (sharded / "model-00002-of-00007.safetensors").unlink()
    case("missing_hf_shard", lambda: hf_to_mcore(sharded, bad / "o1", tp=1, ep=1))

    arch = Path(root) / "in_arch"
    shutil.copytree(hf, arch)
    cfg = json.loads((arch / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    (arch / "config.json").write_text(json.dumps(cfg))
    case("unsupported_arch", lambda: hf_to_mcore(arch, bad / "o2", tp=1, ep=1))
    case("layout", lambda: hf_to_mcore(hf, bad / "o3", tp=1, ep=3))

    mc = Path(root) / "in_missing_distcp"
    shutil.copytree(f"{root}/mc_tp1", mc)
    next(mc.glob("*.distcp")).unlink()
    case("missing_distcp", lambda: mcore_to_hf(mc, bad / "o4"))

    tampered = Path(root) / "in_tampered"
    shutil.copytree(f"{root}/mc_tp1", tampered)
    man = json.loads((tampered / "conversion_manifest.json").read_text())
    man["tensors"]["model.layers.1.mlp.experts.2.up_proj.weight"]["sha256"] = "0" * 64
    (tampered / "conversion_manifest.json").write_text(json.dumps(man))
    case("tampered", lambda: mcore_to_hf(tampered, bad / "o5"))

    (bad / "replace").mkdir()
    case("overwrite", lambda: mcore_to_hf(f"{root}/mc_tp1", bad / "replace", overwrite=True))
    return results


# ---- tests ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    hf = str(build_tiny_hf_model(root / "hf", seed=5))
    run_distributed(roundtrip_tp1_worker, 1, args=(hf, str(root)), timeout=300)
    run_distributed(two_rank_worker, 2, args=(hf, str(root)), timeout=300)
    run_distributed(export_tp1_worker, 1, args=(str(root),), timeout=300)
    return hf, root


def test_tp1_roundtrip_is_bit_exact(converted):
    hf, root = converted
    _assert_identical(hf, root / "hf_tp1")
    assert len(list((root / "hf_tp1").glob("model-*.safetensors"))) > 1
    assert (root / "hf_tp1" / "model.safetensors.index.json").is_file()
    assert (root / "hf_tp1" / "tokenizer.json").is_file()


def test_ep2_roundtrip_is_bit_exact(converted):
    hf, root = converted
    _assert_identical(hf, root / "hf_ep2")


@pytest.mark.parametrize("name", ["hf_ep2_at_tp1", "hf_tp1_at_tp2"])
def test_cross_layout_export_is_identical(converted, name):
    hf, root = converted
    _assert_identical(hf, root / name)
    _assert_identical(root / "hf_tp1", root / name)


def test_bad_inputs_fail_clearly_and_leave_nothing(converted, tmp_path):
    hf, root = converted
    results = {n: (t, m) for n, t, m in run_distributed(bad_inputs_worker, 1, args=(
        hf, str(root), str(tmp_path)), timeout=300)[0]}
    assert results["exists"][0] == "FileExistsError" and "overwrite" in results["exists"][1]
    assert results["exists_m2h"][0] == "FileExistsError"
    assert results["missing_hf_shard"][0] == "FileNotFoundError" and "model-00002-of-00007" in \
        results["missing_hf_shard"][1]
    assert results["unsupported_arch"][0] == "ValueError" and "MixtralForCausalLM" in results["unsupported_arch"][1]
    assert results["layout"][0] == "ValueError" and "ep" in results["layout"][1]
    assert results["missing_distcp"][0] == "FileNotFoundError" and ".distcp" in results["missing_distcp"][1]
    assert results["tampered"][0] == "ConversionError"
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in results["tampered"][1]
    assert results["overwrite"][0] is None
    # nothing half-written: only the directories the test made itself, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "replace"]
    assert [p.name for p in (tmp_path / "exists").iterdir()] == ["keep.txt"]
    _assert_identical(hf, tmp_path / "replace")


def test_cli_mcore_to_hf_and_existing_out(converted, tmp_path, capsys):
    from tools.cli import main

    hf, root = converted
    out = tmp_path / "cli_out"
    assert main(["convert", "mcore-to-hf", "--mcore", str(root / "mc_ep2"), "--out", str(out), "--ep", "2"]) == 0
    _assert_identical(hf, out)
    assert main(["convert", "mcore-to-hf", "--mcore", str(root / "mc_ep2"), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
