"""`msrl train` with model.lora end to end (real Megatron-Core learner, real vLLM engine, the tiny MoE of
tests/e2e/test_trainer.py, its run settings): rank-4 adapters on q/k/v/o train through a 3-step SFT warm-start and
2 RL steps.

- the run logs finite metrics and every sync's probe (engine vs learner logprobs after the merged sync) is within
  1e-4 (the checks of tests/e2e/test_trainer_disaggregated.py `_check_run`);
- the first sync moves the whole model and every later one q/k/v/o alone (weight_sync/scope.py), their bytes
  computed from the starting safetensors and config.json;
- the run summary and the start line say LoRA is on, with the adapter count; it equals the tensors of adapter/;
- only the adapters changed: every base tensor of the run checkpoint (torch_dist) equals the starting HF model's,
  and hf_final (the merged export) equals the start except the adapted weights, which are W + (alpha/r) B A of the
  checkpoint's adapter/ (float64);
- the checkpoint's adapter/ loads with transformers + PEFT, and PEFT + base gives hf_final's logprobs (the learner's
  merged weights, which the probe compared with the learner) within 1e-4;
- configs/demo_lora.yaml, shortened to one SFT and one RL step, trains through `msrl train`;
- the finished run continued to 3 steps resumes from its LoRA checkpoint;
- the same run on two data-parallel ranks (`msrl launch local`, ep 2): the same checks;
- the same run disaggregated (1 learner rank + 1 rollout rank, `msrl launch local`) with FP8 weights on the engine:
  every sync's probe agrees with the learner holding the engine's weights (the merged weights' FP8 round trip), and
  the syncs after the first move q/k/v/o alone.

The last four are runs of their own, marked slow (make test-all). On the shared 2-core CPU the first run's checks
took 50-95 s and the whole module 178-458 s, depending on the load.

    .venv/bin/python -m pytest -q tests/e2e/test_lora_train.py
"""
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.e2e.test_trainer import REPO, _args, _records, model_dir  # noqa: F401 (model_dir: the shared fixture)
from tests.e2e.test_trainer_disaggregated import TOL, _check_run, _launch
from tests.msrl import MSRL

pytestmark = pytest.mark.e2e
peft = pytest.importorskip("peft", reason="Hugging Face PEFT is the reference: pip install -e .[test]")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK, ALPHA = 4, 8.0
LORA = (f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", f"model.lora.target_modules=[{','.join(TARGETS)}]",
        "trainer.verify_sync_every=1")
# Megatron-Core's checkpoint keys name the layer norms as fused into the linear after them (TE's layout)
CHECKPOINT_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
TOKENS = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, model_dir):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("lora")
    proc = subprocess.run(_args(run_dir, model_dir, 2, extra=LORA), cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _last_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1]


def _adapters(run_dir: Path) -> dict[str, torch.Tensor]:
    """The A and B tensors of the last checkpoint's adapter/ (PEFT's keys; its optimizer state left out)."""
    from safetensors.torch import load_file

    return load_file(str(_last_checkpoint(run_dir) / "adapter" / "adapter_model.safetensors"))


def test_finite_metrics_and_every_probe_agrees(lora_run):
    run_dir, proc = lora_run
    _check_run(run_dir, [1, 2])
    probes = [r["sync/probe_max_abs_diff"] for r in _records(run_dir) if "sync/probe_max_abs_diff" in r]
    assert len(probes) >= 5, probes  # the first load, after SFT's eval and its end, after each RL step
    assert "[####################] 2/2" in proc.stdout + proc.stderr
    # the KL term to the initial policy (the base: B = 0) is live: the SFT steps moved the adapters away from it
    assert all(r["loss/kl_ref"] > 0 for r in _records(run_dir) if r["phase"] == "rl")


def _sync_records(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if "sync/bytes" in r]


def _attention_bytes(model_dir: Path) -> int:
    """The q/k/v/o weights' bytes of every layer, from config.json alone (fp32 engine: 4 bytes an entry)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim  # q and o; k and v
    return 4 * per_layer * cfg["num_hidden_layers"]


def test_syncs_after_the_first_move_the_adapted_tensors_alone(lora_run, model_dir):  # noqa: F811
    """The first sync moves the whole model (every tensor of the starting safetensors, fp32); every later one moves
    q/k/v/o merged alone, their bytes computed from config.json; every sync's probe still agrees (the learner holding
    the full merged model against the engine: the tensors not sent must be the ones it already had)."""
    run_dir, proc = lora_run
    records = _sync_records(run_dir)
    full = sum(4 * t.numel() for t in _load(model_dir).values())
    assert records[0]["sync/bytes"] == records[0]["sync/full_bytes"] == full
    later = [r["sync/bytes"] for r in records[1:]]
    assert len(later) >= 4 and set(later) == {_attention_bytes(model_dir)}, later
    assert all(r["sync/full_bytes"] == full for r in records)
    assert all(r["sync/probe_max_abs_diff"] < TOL for r in records)  # trainer.verify_sync_every=1: every sync
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "syncs now send the 8 adapted tensors alone" in log  # q/k/v/o of 2 layers
    assert "Failed to load weights" not in log and "not loaded from checkpoint" not in log  # DEBUG, not WARNING


def test_the_run_says_lora_is_on_with_the_adapter_count(lora_run):
    run_dir, proc = lora_run
    count = sum(t.numel() for t in _adapters(run_dir).values())
    assert f"lora: rank {RANK}, alpha {ALPHA:g} (scale {ALPHA / RANK:g}), dropout 0 on {', '.join(TARGETS)}" \
           in proc.stderr
    assert re.search(rf"trainable: {count:,} adapter parameters \(\d+\.\d\d% of the base's [\d,]+, frozen\)",
                     proc.stderr), proc.stderr[:3000]
    assert (f"LoRA rank {RANK}, {count:,} adapter parameters train (the base frozen), syncs after the first send the "
            "adapted tensors alone") in proc.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in this process, no_dist
def test_the_checkpoint_holds_the_starting_base(lora_run, model_dir):  # noqa: F811
    """Every base tensor of the run's torch_dist checkpoint equals the starting HF model's, laid out as Megatron
    holds it (the adapter's tensor maps, which tests/distributed/test_convert.py checks against transformers; routed
    experts stacked); the adapters moved (B is 0 at the start)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.models.tensor_map import to_mcore

    ckpt = _last_checkpoint(lora_run[0])
    adapter, spec = load_spec(model_dir)
    start = _load(model_dir)
    want = {}
    for tm in adapter.tensor_maps(spec):
        name = tm.mcore
        for norm, key in CHECKPOINT_NORMS.items():
            name = name.replace(norm, key)
        want[name] = to_mcore(tm, [start[h] for h in tm.hf], spec)
    experts = re.compile(r"\.local_experts\.(\d+)\.")
    stacked = {}
    for name in [n for n in want if experts.search(n)]:
        stacked.setdefault(experts.sub(".experts.", name), []).append(want.pop(name))
    want.update({n: torch.stack(parts) for n, parts in stacked.items()})
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    held = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()
            if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.")}
    dcp.load(held, checkpoint_id=str(ckpt), no_dist=True)
    lora = {k for k in held if ".lora." in k}
    assert len(lora) == 2 * len(TARGETS) * spec.num_layers
    assert set(held) - lora == set(want)
    for name, value in want.items():
        assert torch.equal(held[name], value), name
    assert all(held[k].abs().max() > 0 for k in lora if ".lora.B." in k)  # B starts at zero: the adapters trained


def test_hf_final_is_the_base_with_the_adapters_merged(lora_run, model_dir):  # noqa: F811
    run_dir, _ = lora_run
    final, start = _load(run_dir / "hf_final"), _load(model_dir)
    adapters = _adapters(run_dir)
    assert set(final) == set(start)
    merged = 0
    for name, value in final.items():
        module = name.removesuffix(".weight")
        a = adapters.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            assert torch.equal(value, start[name]), name  # not adapted: the base's, bit for bit
            continue
        b = adapters[f"base_model.model.{module}.lora_B.weight"].double()
        want = start[name].double() + (ALPHA / RANK) * b @ a.double()
        assert (value.double() - want).abs().max() <= 1e-6 * want.abs().max(), name
        assert (want - start[name].double()).abs().max() > 1e-5, name
        merged += 1
    assert merged == len(TARGETS) * 2  # q/k/v/o of both layers


def test_converting_the_checkpoint_points_to_merge_lora(lora_run, tmp_path):
    """`msrl convert mcore-to-hf` of a LoRA run's checkpoint is refused (exit 2, no traceback), naming its adapter/
    and `msrl convert merge-lora`."""
    ckpt = _last_checkpoint(lora_run[0])
    proc = subprocess.run([*MSRL, "convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "hf")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{ckpt}: a LoRA run's checkpoint (model.lora: 16 adapter tensors" in proc.stderr
    assert f"msrl convert merge-lora --base <the run's model.path> --adapter {ckpt / 'adapter'} --out DIR" \
           in proc.stderr
    assert not (tmp_path / "hf").exists()


def test_the_adapter_loads_with_peft_and_gives_the_learners_logprobs(lora_run, model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    run_dir, _ = lora_run
    adapter_dir = _last_checkpoint(run_dir) / "adapter"
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == RANK

    def logprobs(model):
        with torch.no_grad():
            logits = model.eval()(TOKENS).logits[:, :-1].double()
        return torch.log_softmax(logits, -1).gather(-1, TOKENS[:, 1:, None])[..., 0]

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    plain = logprobs(base)
    with_adapters = logprobs(peft.PeftModel.from_pretrained(base, str(adapter_dir)))
    learner = logprobs(AutoModelForCausalLM.from_pretrained(str(run_dir / "hf_final"), dtype=torch.float32))
    assert (with_adapters - plain).abs().max() > 1e-4  # the adapters change the model
    assert (with_adapters - learner).abs().max() < 1e-4


@pytest.mark.slow  # a run of its own (25-75 s); test_lora_checkpoint.py checks that load_learner resumes exactly
def test_the_run_resumes_from_its_lora_checkpoint(lora_run, tmp_path, model_dir):  # noqa: F811
    """The finished 2-step run continued to 3 steps: it resumes from its step-2 checkpoint (adapters and their Adam
    state, load_learner) and step 3 logs finite metrics with the probe agreeing."""
    import shutil

    run_dir = tmp_path / "resumed"
    shutil.copytree(lora_run[0], run_dir)
    proc = subprocess.run(_args(run_dir, model_dir, 3, extra=LORA), cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step_000002" in proc.stderr
    _check_run(run_dir, [1, 2, 3])


@pytest.mark.slow  # a run of its own (40-125 s each); the distributed LoRA tests check the adapters at each layout
@pytest.mark.parametrize("layout", [("parallel.ep=2",), ("parallel.tp=2", "parallel.sequence_parallel=true"),
                                    ("parallel.pp=2",)], ids=["dp2_ep2", "tp2_sp", "pp2"])
def test_two_ranks_run(tmp_path, model_dir, layout):  # noqa: F811
    """Colocated on two ranks (`msrl launch local`): data parallel 2 with the experts split over ep 2, tensor
    parallel 2 with sequence parallel, and pipeline parallel 2. The checks of `_check_run` hold (every sync's probe
    within the tolerance: the engine serves the merged adapters gathered over the ranks) and the checkpoint's
    adapter/ holds every adapter whole (tests/distributed/test_lora_data_parallel.py: the adapters equal one rank's;
    tests/distributed/test_lora.py: PEFT's gradients at tp 2 and pp 2)."""
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, model_dir, nproc=2, rollout_ranks=0, steps=2,
                   extra=(*LORA, *layout, "checkpoint.save_every=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(run_dir, [1, 2])
    assert sum(t.numel() for t in _adapters(run_dir).values()) == 5_120


@pytest.mark.slow  # a run of its own (35-155 s); test_lora_sync.py checks held_by on a LoRA learner
def test_disaggregated_run_with_fp8_weights_probes_the_merged_sync(tmp_path, model_dir):  # noqa: F811
    """FP8 block-quantised weights on an fp32 engine: the probe's reference is the learner holding the engine's
    weights (EngineWeights.held_by: the merged weights' FP8 round trip in its base, its adapters off), which the
    engine matches to fp32 numerics; the quantisation's own effect on the logprobs is measured and not zero (and the
    sampler's logprobs differ from the fp32 learner's, so `_check_run`'s k1 bound does not apply)."""
    run_dir = tmp_path / "dis"
    proc = _launch(run_dir, model_dir, nproc=2, rollout_ranks=1, steps=2, extra=(*LORA, "rollout.quantization=fp8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(run_dir)
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2] and not any(r.get("nonfinite") for r in records)
    probed = [r for r in records if "sync/probe_max_abs_diff" in r]
    assert len(probed) >= 5 and all("sync/probe_max_abs_diff" in r for r in rl)
    assert max(r["sync/probe_max_abs_diff"] for r in probed) < TOL
    assert min(r["sync/weight_format_max_abs_diff"] for r in probed) > 1e-4  # FP8 moves the logprobs
    synced = _sync_records(run_dir)  # the first sync whole, then q/k/v/o alone (FP8 round trips sent as fp32)
    assert synced[0]["sync/bytes"] == sum(4 * t.numel() for t in _load(model_dir).values())
    assert {r["sync/bytes"] for r in synced[1:]} == {_attention_bytes(model_dir)}


@pytest.mark.slow  # a run of its own (30-85 s); the module's first run is msrl train with model.lora
def test_the_demo_config_trains(tmp_path):
    """configs/demo_lora.yaml (what docs/lora.md shows) through `msrl train`, one SFT and one RL step at small
    batches: the adapters the summary counts train, the probe agrees."""
    cmd = [*MSRL, "train", str(REPO / "configs/demo_lora.yaml"), "--set", f"logging.dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}", "trainer.steps=1", "trainer.prompts_per_step=4", "rollout.sampling.n=4",
           "trainer.eval_prompts=8", "trainer.sft.max_steps=1", "trainer.sft.batch_size=8", "checkpoint.save_every=0",
           "logging.tensorboard=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainable: 57,344 adapter parameters" in proc.stderr  # rank 16 x q/k/v/o of 4 layers, hidden 128
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records if r["phase"] == "rl"] == [1] and not any(r.get("nonfinite") for r in records)
    assert max(r["sync/probe_max_abs_diff"] for r in records if "sync/probe_max_abs_diff" in r) < TOL


@pytest.mark.slow  # two runs of their own (about 40 s each)
def test_lora_rl_from_the_demo_warm_start(tmp_path):
    """docs/lora.md "LoRA RL from a trained base": the full demo's warm start (`msrl train configs/demo_tiny_moe.yaml`,
    shortened here to 2 SFT steps and 1 RL step), then LoRA RL on its hf_final with configs/demo_lora.yaml and no
    SFT of its own: the run adapts that base (not the tiny model demo_lora.yaml would build), the probe agrees."""
    base = tmp_path / "base"
    small = ["trainer.steps=1", "trainer.prompts_per_step=4", "rollout.sampling.n=4", "trainer.eval_prompts=8",
             "checkpoint.save_every=0", "logging.tensorboard=false"]
    warm = subprocess.run([*MSRL, "train", str(REPO / "configs/demo_tiny_moe.yaml"), "--set", f"logging.dir={base}",
                           f"model.path={tmp_path / 'model'}", "trainer.sft.max_steps=2", *small],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, warm.stderr[-3000:]
    proc = subprocess.run([*MSRL, "train", str(REPO / "configs/demo_lora.yaml"), "--set",
                           f"logging.dir={tmp_path / 'lora'}", f"model.path={base / 'hf_final'}",
                           "trainer.sft.max_steps=0", *small], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"model.path: {base / 'hf_final'}" in proc.stderr
    records = _records(tmp_path / "lora")
    assert not any(r["phase"] == "sft" for r in records) and [r["step"] for r in records if r["phase"] == "rl"] == [1]
    assert max(r["sync/probe_max_abs_diff"] for r in records if "sync/probe_max_abs_diff" in r) < TOL
    assert (tmp_path / "lora" / "checkpoints").is_dir() or (tmp_path / "lora" / "hf_final").is_dir()
