"""Checkpoint conversion between Hugging Face safetensors and Megatron-Core torch_dist, verified bit-exact.

Both functions run inside an initialised torch.distributed world (one process is enough for tp=ep=pp=1;
`launch.py` spawns ranks for the CLI):

    hf_to_mcore("hf/Qwen3-30B-A3B", "ckpt/q30b_tp2ep8", tp=2, ep=8)     # world = a multiple of tp*pp
    mcore_to_hf("ckpt/q30b_tp2ep8", "hf/q30b_roundtrip")                 # at any layout of this world

Only the model shard is built (no DDP gradient buffer, no optimizer: `shard.py`), so a rank's peak memory is
about its model shard plus the tensor being moved. hf_to_mcore streams the HF tensors into this rank's shards
(each read once), saves a step-0 model-only checkpoint in the format of `learner/checkpoint.py` (loadable with
`load_learner(..., load_optimizer=False)`) and writes a manifest with the sha256 of every HF tensor plus the HF
side files (config, tokenizer) under `<out>/hf/`. mcore_to_hf loads that checkpoint (or one saved by training)
at the current layout, gathers full tensors to rank 0, writes safetensors shards, re-reads them and compares
every tensor with the manifest, naming the first one that differs. Rank 0 prints throttled progress lines
(tensors, MB done of the total, MB/s; `progress.py`). The inputs are checked against the model config first
(`checks.py`: HF headers before any process group use, torch_dist metadata and files before the load), every
error naming the file or tensor. Outputs appear atomically (staging directory, then rename); on any error
nothing is left behind.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, TextIO

import torch
import torch.distributed as dist

from megatron_sparse_rl.checkpoint.checks import (check_hf_files, check_hf_tensors, check_saved_tensors,
                                                  check_torch_dist_files, damaged_torch_dist_file)
from megatron_sparse_rl.checkpoint.gather import iter_full_tensors, ownership
from megatron_sparse_rl.checkpoint.progress import TransferProgress, report_phase
from megatron_sparse_rl.checkpoint.shard import (build_shard, dir_bytes, load_model_only, save_model_only,
                                                 sharded_shapes)
from megatron_sparse_rl.checkpoint.verify import check_forward_parity
from megatron_sparse_rl.config.schema import LearnerConfig, ModelConfig, ParallelConfig
from megatron_sparse_rl.formats import manifest as M
from megatron_sparse_rl.formats.hf_io import HFCheckpoint
from megatron_sparse_rl.formats.hf_writer import ShardedSafetensorsWriter, parse_size, write_side_files
from megatron_sparse_rl.formats.safe_load import UnsafeFileError
from megatron_sparse_rl.learner.integrity import read_manifest as read_file_digests
from megatron_sparse_rl.learner.integrity import verify_files
from megatron_sparse_rl.learner.learner import Learner
from megatron_sparse_rl.learner.params import load_full_tensors, local_params
from megatron_sparse_rl.models import load_spec
from megatron_sparse_rl.models.tensor_map import to_hf, to_mcore
from megatron_sparse_rl.parallel import ParallelLayout
from megatron_sparse_rl.parallel.world import on_rank0
from megatron_sparse_rl.patches import megatron_cpu

log = logging.getLogger(__name__)


class ConversionError(RuntimeError):
    """The converted tensors do not match what the manifest recorded."""


# ---- small helpers shared by both directions -------------------------------------------------------
def _staging(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial")


def _clean(out: Path) -> None:
    """Remove every temporary path a conversion to `out` may have created. A `.<out>.old` left by a conversion
    stopped between `_publish`'s two renames is the only copy of the previous output: it is put back, not removed."""
    stage = _staging(out)
    old = out.with_name(f".{out.name}.old")
    if old.is_dir() and not out.exists():
        log.warning("restoring %s from %s (a previous conversion stopped while replacing it)", out, old)
        os.replace(old, out)
    for p in (stage, stage.with_name(f".{stage.name}.tmp"), old):
        shutil.rmtree(p, ignore_errors=True)


def _check_out(out: Path, overwrite: bool, inputs: list) -> None:
    """Refuse an output that would replace, or be written into or around, an input (any of the paths a conversion
    writes: `out`, its staging and its `.old` copy), compared after resolving symlinks; then an existing `out`
    without `overwrite`. Runs before anything is written."""
    written = [out, _staging(out), _staging(out).with_name(f".{_staging(out).name}.tmp"),
               out.with_name(f".{out.name}.old")]  # `out` first: a relation it has is the one named
    for given in (Path(p) for p in inputs if p is not None):
        inp = given.resolve()
        for path in written:
            target = path.resolve()
            relation = ("is" if target == inp else "is inside" if inp in target.parents
                        else "contains" if target in inp.parents else None)
            if relation:
                where = "" if path == out else f" (through the conversion's temporary path {str(path)!r})"
                raise ValueError(f"output {str(out)!r}{where} {relation} the input {str(given)!r} (resolved: "
                                 f"{str(target)!r} and {str(inp)!r}); a conversion never writes into, over or "
                                 "around its own input: choose an output outside it")
    if out.exists() and not overwrite:
        raise FileExistsError(f"output {str(out)!r} already exists; pass overwrite=True (--overwrite) to replace it")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {str(out)!r} exists and is not a directory")


def _publish(stage: Path, out: Path) -> None:
    """Move the finished staging directory to `out`, replacing an existing one only after success (rank 0)."""
    old = out.with_name(f".{out.name}.old")
    if out.exists():
        os.replace(out, old)
    os.replace(stage, out)
    shutil.rmtree(old, ignore_errors=True)


def _layout(spec, tp: int, ep: int, pp: int, etp: int, pipeline_layout: str | None = None, vpp: int = 1):
    layout = ParallelLayout.from_config(ParallelConfig(tp=tp, ep=ep, pp=pp, etp=etp, sequence_parallel=tp > 1,
                                                       pipeline_layout=pipeline_layout, vpp=vpp),
                                        dist.get_world_size())
    layout.check_model(spec)
    return layout


def _build(model_dir: Path, layout, dtype: str, verify: bool):
    """The model shard alone (a `ModelShard`), or a full Learner when `verify` needs its forward pass (the HF
    model that --verify compares with is loaded whole anyway). Both have `.model` and `.groups`."""
    megatron_cpu.apply()
    if not verify:
        return build_shard(model_dir, layout, dtype)
    adapter, spec = load_spec(model_dir)
    groups = layout.initialize()
    return Learner(adapter, spec, layout, groups, model_cfg=ModelConfig(path=str(model_dir), dtype=dtype),
                   cfg=LearnerConfig(micro_batch_size=4), total_steps=1)


def _read_into_shards(holder, spec, ckpt: HFCheckpoint, maps: list, stream) -> dict:
    """Stream the HF tensors into this rank's shards, reading each one once: a rank reads the tensors of the
    Megatron parameters it holds and hashes those it is the lowest holding rank of. Returns name -> manifest
    entry for every HF tensor (gathered from all ranks)."""
    rank = dist.get_rank()
    held = set(local_params(holder.model, holder.groups))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(held))
    hasher = {}
    for r, names in reversed(list(enumerate(every))):
        hasher.update(dict.fromkeys(names, r))
    unheld = [tm.mcore for tm in maps if tm.mcore not in hasher]
    if unheld:
        raise ValueError(f"the Megatron model holds no parameter for {len(unheld)} tensor-map names, e.g. {unheld[:3]}")
    mine = [tm for tm in maps if tm.mcore in held]
    progress = TransferProgress("hf-to-mcore read", total_tensors=sum(len(tm.hf) for tm in mine),
                                total_bytes=sum(ckpt.header(n)[2] for tm in mine for n in tm.hf), stream=stream,
                                enabled=rank == 0)
    digests: dict = {}

    def tensors():
        for tm in mine:
            hf = [ckpt.get(n) for n in tm.hf]
            if hasher[tm.mcore] == rank:
                digests.update((n, M.tensor_entry(t)) for n, t in zip(tm.hf, hf))
            progress.add(sum(t.numel() * t.element_size() for t in hf), len(hf))
            yield tm.mcore, to_mcore(tm, hf, spec)

    problem = None
    try:  # an error on one rank is raised on every rank (the others would wait in the gather below forever)
        loaded = load_full_tensors(holder.model, holder.groups, tensors())
        progress.finish()
        if held - loaded:
            problem = ValueError(f"{ckpt.dir}: no weights for {len(held - loaded)} parameters of the Megatron model, "
                                 f"e.g. {sorted(held - loaded)[:3]}")
    except Exception as e:  # noqa: BLE001 - re-raised below on every rank
        problem = e
    dist.all_gather_object(every, (problem, digests))
    for err, _ in every:
        if err is not None:
            raise err
    merged = {k: v for _, part in every for k, v in part.items()}
    return {n: merged[n] for tm in maps for n in tm.hf}


# ---- HF -> Megatron --------------------------------------------------------------------------------
def hf_to_mcore(hf_dir, out_dir, *, tp: int, ep: int, pp: int = 1, etp: int = 1, overwrite: bool = False,
                verify: bool = False, progress: TextIO | None = None, pipeline_layout: str | None = None,
                vpp: int = 1) -> Path:
    """Convert the HF checkpoint at `hf_dir` into a torch_dist checkpoint at `out_dir` (see module doc).
    Rank 0 prints progress lines to `progress` (default stderr). `pipeline_layout`: parallel.pipeline_layout (None:
    balanced stages where pp does not divide the layers); `vpp`: parallel.vpp, model chunks per pipeline rank (the
    balanced split is then over pp * vpp virtual stages). The checkpoint holds global layer numbers either way, so it
    loads at any other split."""
    hf_dir, out = Path(hf_dir), Path(out_dir).absolute()
    _check_out(out, overwrite, [hf_dir])
    adapter, spec = load_spec(hf_dir)
    ckpt = HFCheckpoint(hf_dir)
    if verify and ckpt.fp8 is not None:
        raise ValueError(f"{hf_dir}: --verify compares with HF transformers, which cannot load this block-wise fp8 "
                         "checkpoint here (it needs accelerate and a GPU kernel); convert without --verify, then "
                         "verify the export: `msrl convert mcore-to-hf ... --verify` checks the dequantised weights "
                         "against transformers")
    check_hf_files(ckpt)  # the input checks need no process group: they run before anything else
    check_hf_tensors(ckpt, adapter, spec, hf_dir / "config.json")
    layout = _layout(spec, tp, ep, pp, etp, pipeline_layout, vpp)
    maps = adapter.tensor_maps(spec)
    hf_names = [n for tm in maps for n in tm.hf]
    float_dtypes = {ckpt.header(n)[0] for n in hf_names}
    param_dtype = "bfloat16" if float_dtypes == {"bfloat16"} else "float32"
    stage = _staging(out)
    try:
        if dist.get_rank() == 0:
            _clean(out)
        dist.barrier()
        holder = _build(hf_dir, layout, param_dtype, verify)
        tensors = _read_into_shards(holder, spec, ckpt, maps, progress)
        if verify:
            check_forward_parity(holder, hf_dir)
        t0 = time.perf_counter()
        save_model_only(holder.model, stage)
        if dist.get_rank() == 0:
            report_phase("hf-to-mcore torch_dist save", dir_bytes(stage), time.perf_counter() - t0, stream=progress)
        saved = {"tp": tp, "ep": ep, "pp": pp, "etp": etp, "world_size": dist.get_world_size()}

        def finish():
            files = M.copy_side_files(hf_dir, stage / M.HF_FILES_DIR)
            M.write_manifest(stage, architecture=spec.architecture, param_dtype=param_dtype, layout=saved,
                             tensors=tensors, side_files=files)
            _publish(stage, out)

        on_rank0(finish)
    except BaseException:
        if dist.get_rank() == 0:
            _clean(out)
        raise
    log.info("converted %s -> %s (tp=%d ep=%d pp=%d etp=%d)", hf_dir, out, tp, ep, pp, etp)
    return out


# ---- Megatron -> HF --------------------------------------------------------------------------------
def _target_dtypes(manifest: dict | None, hf_cfg: dict, param_dtype: str) -> Callable[[str], torch.dtype]:
    if manifest is not None:
        return lambda name: M.DTYPES[manifest["tensors"][name]["dtype"]]
    default = M.DTYPES.get(str(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or param_dtype), torch.float32)
    return lambda name: default


def _check_digests(mcore: Path) -> None:
    """A checkpoint saved by training carries every file's sha256 (learner/integrity.py): a bit flip inside
    tensor data, which the structural checks cannot see, is named here before anything is built."""
    if read_file_digests(mcore) is not None and (problems := verify_files(mcore)):
        raise ValueError(f"{mcore}: damaged checkpoint files:\n  " + "\n  ".join(problems))


def mcore_to_hf(mcore_dir, out_dir, *, tp: int = 1, ep: int = 1, pp: int = 1, etp: int = 1,
                hf_config_dir=None, max_shard_size: str | int = "5GB", overwrite: bool = False,
                verify: bool = False, progress: TextIO | None = None, pipeline_layout: str | None = None,
                vpp: int = 1) -> Path:
    """Convert the torch_dist checkpoint at `mcore_dir` (loaded at this world's layout tp/ep/pp/etp) to HF
    safetensors at `out_dir`. Side files come from `<mcore_dir>/hf/` (converted and training checkpoints carry it)
    or `hf_config_dir`; a training checkpoint has no conversion manifest, so its tensors are checked by its sha256
    manifest and read-back. Rank 0 prints
    progress lines to `progress` (default stderr)."""
    mcore, out = Path(mcore_dir), Path(out_dir).absolute()
    _check_out(out, overwrite, [mcore, hf_config_dir])
    max_bytes = parse_size(max_shard_size)
    meta = check_torch_dist_files(mcore)
    _check_digests(mcore)
    manifest = M.read_manifest(mcore)
    side_dir = Path(hf_config_dir) if hf_config_dir else mcore / M.HF_FILES_DIR
    if not (side_dir / "config.json").is_file():
        raise FileNotFoundError(f"{side_dir}: no config.json; a checkpoint without its hf/ copy needs "
                                "hf_config_dir (--hf-config) naming the HF config/tokenizer directory")
    adapter, spec = load_spec(side_dir)
    if manifest is not None and manifest["architecture"] != spec.architecture:
        raise ValueError(f"{mcore}: manifest architecture {manifest['architecture']!r} != config.json's "
                         f"{spec.architecture!r}")
    hf_cfg = json.loads((side_dir / "config.json").read_text())
    param_dtype = manifest["param_dtype"] if manifest else ("bfloat16" if hf_cfg.get("dtype") == "bfloat16"
                                                            else "float32")
    layout = _layout(spec, tp, ep, pp, etp, pipeline_layout, vpp)
    stage = _staging(out)
    try:
        if dist.get_rank() == 0:
            _clean(out)
        holder = _build(side_dir, layout, param_dtype, verify)
        _check_saved(holder, mcore, meta, side_dir / "config.json")
        t0 = time.perf_counter()
        _load(holder, mcore, meta, f"tp={tp} ep={ep} pp={pp}")
        if dist.get_rank() == 0:
            report_phase("mcore-to-hf torch_dist load", dir_bytes(mcore), time.perf_counter() - t0, stream=progress)
            stage.mkdir(parents=True)
        dist.barrier()
        _write_hf(holder, adapter, spec, stage, max_bytes, _target_dtypes(manifest, hf_cfg, param_dtype), manifest,
                  progress)
        on_rank0(lambda: write_side_files(side_dir, stage))  # config.json without fp8 quantization or MTP layers
        if verify:
            check_forward_parity(holder, stage)
        on_rank0(lambda: _publish(stage, out))
    except BaseException:
        if dist.get_rank() == 0:
            _clean(out)
        raise
    log.info("converted %s -> %s", mcore, out)
    return out


def _check_saved(holder, mcore: Path, meta, config: Path) -> None:
    """The checkpoint's tensor shapes and dtypes against those of the model built from `config` (every rank
    checks the union of all ranks' tensors, so all raise the same error)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sharded_shapes(holder.model))
    check_saved_tensors(mcore, meta, {k: v for part in every for k, v in part.items()}, config)


def _load(holder, mcore: Path, meta, layout: str) -> None:
    """Load the checkpoint into the model; a failure names the damaged shard file when one does not read back
    (torch.distributed.checkpoint reports a bare EOFError/RuntimeError inside a CheckpointException)."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        load_model_only(holder.model, mcore)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        damaged = damaged_torch_dist_file(mcore, meta)
        if damaged:
            raise ValueError(damaged) from None
        cause = e
        if isinstance(e, CheckpointException) and e.failures:
            cause = next(iter(e.failures.values()))[0]  # (exception, traceback) of the first failing rank
        if isinstance(cause, UnsafeFileError):  # a pickle outside the allowlists (patches/torch_dist_safe_load.py)
            raise cause from None
        raise ValueError(f"{mcore}: cannot load the torch_dist checkpoint at {layout} "
                         f"({type(cause).__name__}: {cause})") from e


def _write_hf(holder, adapter, spec, stage: Path, max_bytes: int, target_dtype, manifest: dict | None,
              stream) -> None:
    """Gather, split into HF tensors, write and check them (rank 0); every rank takes part in the gathers."""
    maps = {tm.mcore: tm for tm in adapter.tensor_maps(spec)}
    owners = ownership(holder.model, holder.groups, list(maps))
    writer = ShardedSafetensorsWriter(stage, max_bytes) if dist.get_rank() == 0 else None
    progress = TransferProgress(
        "mcore-to-hf write", total_tensors=sum(len(tm.hf) for tm in maps.values()),
        total_bytes=sum(math.prod(owners[n][1]) * target_dtype(tm.hf[0]).itemsize for n, tm in maps.items()),
        stream=stream, enabled=dist.get_rank() == 0)
    digests: dict[str, str] = {}
    first_bad: list[str] = []
    for name, full in iter_full_tensors(holder.model, holder.groups, list(maps), owners=owners):
        # keep consuming on a mismatch: the other ranks are still sending
        for hf_name, t in zip(maps[name].hf, to_hf(maps[name], full, spec)):
            t = t.to(target_dtype(hf_name)).contiguous()
            digests[hf_name] = M.tensor_digest(t)
            if manifest is not None and not first_bad:
                want = manifest["tensors"].get(hf_name)
                got = {"shape": list(t.shape), "dtype": M.dtype_name(t.dtype), "sha256": digests[hf_name]}
                if want != got:
                    first_bad.append(_describe(hf_name, want, got))
            if not first_bad:
                writer.add(hf_name, t)
            progress.add(t.numel() * t.element_size())

    def finish():
        if first_bad:
            raise ConversionError(f"converted tensor differs from the manifest: {first_bad[0]}")
        if manifest is not None and set(manifest["tensors"]) != set(digests):
            raise ConversionError(f"manifest names {sorted(set(manifest['tensors']) ^ set(digests))[:3]} "
                                  "differ from the converted tensors")
        on_disk = writer.finish()
        progress.finish()
        for n, d in digests.items():
            if on_disk.get(n) != d:
                raise ConversionError(f"{n}: the tensor read back from disk differs from the one written")

    on_rank0(finish)


def _describe(name: str, want: dict | None, got: dict) -> str:
    if want is None:
        return f"{name}: not in the manifest"
    for key in ("shape", "dtype", "sha256"):
        if want[key] != got[key]:
            return f"{name}: {key} {got[key]} != manifest {want[key]}"
    return name
