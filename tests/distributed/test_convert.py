"""HF <-> Megatron torch_dist conversion: bit-exact round trips at TP1, EP2 and TP2 (every tensor compared with
torch.equal against the original safetensors), cross-layout (saved at EP2, exported at TP1 and the reverse; saved
at TP2xEP2 on 4 ranks, exported at TP2xEP2 and at TP1), a converted checkpoint loaded into a Learner matching HF
transformers' logprobs, the progress lines' counts against the bytes on disk, and bad inputs that must fail
clearly and leave nothing behind (including damaged .distcp files named by `msrl convert` and torch_dist shapes
checked against the config; the HF header checks are unit-tested in tests/unit/test_convert_checks.py)."""
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests.snapshot import snapshot
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
    """Returns the progress output of both directions."""
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    to_mcore, to_hf = io.StringIO(), io.StringIO()
    hf_to_mcore(hf, f"{root}/mc_tp1", tp=1, ep=1, progress=to_mcore)
    mcore_to_hf(f"{root}/mc_tp1", f"{root}/hf_tp1", max_shard_size="100KB", progress=to_hf)  # sharded, with index
    return to_mcore.getvalue(), to_hf.getvalue()


def two_rank_worker(rank, world, hf, root):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf, f"{root}/mc_ep2", tp=1, ep=2)
    mcore_to_hf(f"{root}/mc_ep2", f"{root}/hf_ep2", ep=2)
    mcore_to_hf(f"{root}/mc_tp1", f"{root}/hf_tp1_at_tp2", tp=2)  # saved at TP1, exported at TP2


def tp2ep2_worker(rank, world, hf, root):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf, f"{root}/mc_tp2ep2", tp=2, ep=2)  # 4 ranks: TP2 x EP2 with 2 data-parallel replicas
    mcore_to_hf(f"{root}/mc_tp2ep2", f"{root}/hf_tp2ep2", tp=2, ep=2)


def export_tp1_worker(rank, world, root):
    from megatron_sparse_rl.checkpoint.convert import mcore_to_hf

    mcore_to_hf(f"{root}/mc_ep2", f"{root}/hf_ep2_at_tp1")
    mcore_to_hf(f"{root}/mc_tp2ep2", f"{root}/hf_tp2ep2_at_tp1")


def verify_worker(rank, world, hf, root):
    """--verify in both directions (the Learner path: forward parity against HF transformers)."""
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf, f"{root}/mc_verify", tp=1, ep=2, verify=True)
    mcore_to_hf(f"{root}/mc_verify", f"{root}/hf_verify", ep=2, verify=True)


def learner_load_worker(rank, world, hf, mcore, tokens):
    """A Learner (DDP + optimizer) loads the converted checkpoint with the training loader; its logprobs."""
    from megatron_sparse_rl.learner.checkpoint import load_learner
    from tests.learner_workers import make_learner

    learner = make_learner(world, hf, load=False)
    load_learner(learner, mcore, load_optimizer=False)
    return learner.forward_logprobs(tokens)["logprobs"]


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
    cfg["architectures"] = ["GPT2LMHeadModel"]
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


def m2h_failures_worker(rank, world, inputs, out):
    """mcore-to-hf of damaged or mismatched inputs into the existing directory `out` (with overwrite). Damaged
    files go through `msrl convert` (in this rank: WORLD_SIZE is set, so the CLI converts in this world), config
    mismatches through the library. Returns {case: (exit code or exception type, message)}."""
    from contextlib import redirect_stderr

    from megatron_sparse_rl.checkpoint.convert import mcore_to_hf
    from megatron_sparse_rl.tools.cli import main

    results = {}
    for case in ("damaged_item", "truncated_distcp"):
        err = io.StringIO()
        with redirect_stderr(err):
            code = main(["convert", "mcore-to-hf", "--mcore", f"{inputs}/{case}", "--out", out, "--overwrite"])
        results[case] = (code, err.getvalue())
    for case in ("ffn_config", "layers_config"):
        try:
            mcore_to_hf(f"{inputs}/mc", out, hf_config_dir=f"{inputs}/{case}", overwrite=True)
            results[case] = (None, "")
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[case] = (type(e).__name__, str(e))
    return results


# ---- tests ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    hf = str(build_tiny_hf_model(root / "hf", seed=5))
    progress = run_distributed(roundtrip_tp1_worker, 1, args=(hf, str(root)), timeout=300)[0]
    run_distributed(two_rank_worker, 2, args=(hf, str(root)), timeout=300)
    run_distributed(tp2ep2_worker, 4, args=(hf, str(root)), timeout=300)
    run_distributed(export_tp1_worker, 1, args=(str(root),), timeout=300)
    (root / "progress_hf_to_mcore.txt").write_text(progress[0])
    (root / "progress_mcore_to_hf.txt").write_text(progress[1])
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


@pytest.mark.parametrize("name", ["hf_ep2_at_tp1", "hf_tp1_at_tp2", "hf_tp2ep2", "hf_tp2ep2_at_tp1"])
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
    kind, msg = results["unsupported_arch"]
    assert kind == "ValueError" and "'GPT2LMHeadModel'" in msg
    for supported in ("DeepseekV3ForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "Qwen3MoeForCausalLM"):
        assert supported in msg, msg
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
    from megatron_sparse_rl.tools.cli import main

    hf, root = converted
    out = tmp_path / "cli_out"
    assert main(["convert", "mcore-to-hf", "--mcore", str(root / "mc_ep2"), "--out", str(out), "--ep", "2"]) == 0
    _assert_identical(hf, out)
    assert main(["convert", "mcore-to-hf", "--mcore", str(root / "mc_ep2"), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def _final(text: str, label: str) -> re.Match:
    lines = [ln for ln in text.splitlines() if ln.startswith(label + " [")]
    assert lines, text
    m = re.fullmatch(label + r" \[[#.]+\] +(\d+)/(\d+) tensors ([\d.]+)/([\d.]+) MB ([\d.]+) MB/s eta \S+", lines[-1])
    assert m, lines[-1]
    return m


def _tensor_bytes(d) -> tuple[int, int]:
    tensors = _load_dir(d)
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("direction,src", [("hf_to_mcore", "hf"), ("mcore_to_hf", "hf_tp1")])
def test_progress_counts_match_the_bytes_moved(converted, direction, src):
    """The last progress line counts every tensor and exactly the tensor bytes of the HF side (read or written)."""
    hf, root = converted
    text = (root / f"progress_{direction}.txt").read_text()
    label = {"hf_to_mcore": "hf-to-mcore read", "mcore_to_hf": "mcore-to-hf write"}[direction]
    done, total, mb_done, mb_total, rate = _final(text, label).groups()
    count, nbytes = _tensor_bytes(hf if src == "hf" else root / src)
    assert int(done) == int(total) == count
    assert float(mb_done) == float(mb_total) == round(nbytes / 1e6, 2)
    assert float(rate) > 0
    phase = {"hf_to_mcore": "hf-to-mcore torch_dist save", "mcore_to_hf": "mcore-to-hf torch_dist load"}[direction]
    assert re.search(phase + r": [\d.]+ MB in [\d.]+ s \([\d.]+ MB/s\)", text), text


def test_verify_passes_on_a_correct_conversion(converted, tmp_path):
    hf, _ = converted
    run_distributed(verify_worker, 2, args=(hf, str(tmp_path)), timeout=300)
    _assert_identical(hf, tmp_path / "hf_verify")


def test_converted_checkpoint_loads_into_a_learner(converted):
    """Saved by the converter at TP2xEP2 (model only), loaded by the training loader into a TP1 Learner: its
    logprobs equal HF transformers' (fp32)."""
    from tests.distributed.test_learner import hf_reference

    hf, root = converted
    tokens = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(3))
    ours = run_distributed(learner_load_worker, 1, args=(hf, str(root / "mc_tp2ep2"), tokens), timeout=300)[0]
    ref, _ = hf_reference(hf, tokens)
    assert (ours.double() - ref).abs().max() < 1e-4


# ---- mcore-to-hf: damaged files and config mismatches, named, nothing written --------------------------------
def _damaged_inputs(mc: Path, inputs: Path) -> None:
    """Copies of `mc`: one .distcp item's zip directory zeroed (the file keeps its size, so only the load finds
    it), one .distcp cut to 1000 bytes; and HF configs that disagree with the checkpoint (expert FFN size, layers)."""
    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(mc, inputs / "mc")
    item = shutil.copytree(mc, inputs / "damaged_item")
    _, info = next((i, s) for i, s in FileSystemReader(str(item)).read_metadata().storage_data.items()
                   if i.fqn == "decoder.layers.0.self_attention.linear_qkv.weight")
    data = bytearray((item / info.relative_path).read_bytes())
    data[info.offset + info.length - 22:info.offset + info.length] = bytes(22)
    (item / info.relative_path).write_bytes(bytes(data))
    cut = shutil.copytree(mc, inputs / "truncated_distcp")
    shard = sorted(cut.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    for case, change in (("ffn_config", {"moe_intermediate_size": 32}), ("layers_config", {"num_hidden_layers": 1})):
        d = shutil.copytree(mc / "hf", inputs / case)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **change}))


@pytest.fixture(scope="module")
def m2h_failures(converted, tmp_path_factory):
    """One spawned rank runs every case; returns (results, inputs dir, snapshots before, snapshots after)."""
    _, root = converted
    inputs, outs = tmp_path_factory.mktemp("m2h_inputs"), tmp_path_factory.mktemp("m2h_outs")
    _damaged_inputs(root / "mc_tp1", inputs)
    (outs / "existing").mkdir()
    (outs / "existing" / "keep.txt").write_text("the user's data")
    before = (snapshot(inputs), snapshot(outs))
    results = run_distributed(m2h_failures_worker, 1, args=(str(inputs), str(outs / "existing")), timeout=300)[0]
    return results, inputs, before, (snapshot(inputs), snapshot(outs))


def _assert_nothing_changed(before, after):
    assert after[1] == before[1], "the output directory changed (or a partial one was left)"
    assert after[0] == before[0], "an input changed"


def test_m2h_cli_names_the_damaged_distcp_item(m2h_failures):
    results, inputs, before, after = m2h_failures
    code, err = results["damaged_item"]
    assert code == 2, err
    assert re.search(rf"(?m)^error: ValueError: {re.escape(str(inputs))}/damaged_item/__\d+_\d+\.distcp: damaged "
                    r"torch_dist shard file: item 'decoder.layers.0.self_attention.linear_qkv.weight' at byte \d+ "
                    r"does not read \(BadZipFile", err), err
    _assert_nothing_changed(before, after)


def test_m2h_cli_names_the_truncated_distcp(m2h_failures):
    results, inputs, before, after = m2h_failures
    code, err = results["truncated_distcp"]
    assert code == 2 and "EOFError" not in err and "Traceback" not in err, err
    assert re.search(rf"(?m)^error: ValueError: {re.escape(str(inputs))}/truncated_distcp/__0_0\.distcp: damaged "
                    r"torch_dist shard file: 1000 bytes, but \.metadata places data up to byte \d+", err), err
    _assert_nothing_changed(before, after)


def test_m2h_saved_shapes_are_checked_against_the_config(m2h_failures):
    results, inputs, before, after = m2h_failures
    kind, msg = results["ffn_config"]
    assert kind == "ValueError" and f"do not fit the model of {inputs}/ffn_config/config.json" in msg, msg
    assert "decoder.layers.0.mlp.experts.experts.linear_fc1.weight: expected shape (4, 64, 64), found (4, 128, 64)" \
        in msg, msg
    _assert_nothing_changed(before, after)


def test_m2h_tensors_the_config_lacks_are_refused(m2h_failures):
    results, inputs, before, after = m2h_failures
    kind, msg = results["layers_config"]
    assert kind == "ValueError" and "missing [] (0), not in the model ['decoder.layers.1." in msg, msg
    _assert_nothing_changed(before, after)
