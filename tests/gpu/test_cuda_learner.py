"""The Megatron-Core learner (local spec, no Transformer Engine) on one device, against HF transformers on the same
device (the cuda variants passed on an H100 on 2026-11-27: docs/gpu.md):

- tiny Qwen3-MoE and tiny DeepSeek-V3 (MLA, sigmoid group-limited router, shared experts): next-token logprobs and
  entropies of an fp32 learner within 1e-4 of an fp32 transformers forward at every token; those of a bf16 learner
  within checkpoint/verify.py's bf16 tolerance (0.1) of a bf16 transformers forward on the MEAN over tokens. The
  max is recorded, not bounded: on a few tokens a router picks other experts in one bf16 implementation than in
  the other, which moves that logprob by up to ~1 (measured on CPU, seeds 3-5 of these models at 4 x 14 tokens:
  mean 0.013-0.070, max 0.04-1.03; transformers' own bf16 forward differs from its fp32 one by up to 1.62 there),
  while wrong weights or a broken kernel move every token (mean ~1);
- train steps with R2 routing replay: a forward replaying the routes a recording forward took gives that forward's
  logprobs and applies every route (routing/replay_applied_fraction 1, also in the train steps); the first step's
  loss is transformers' mean next-token NLL; the loss falls and every router weight moves; a bf16 learner's steps
  (Megatron's fp16/bf16 optimizer with fp32 main weights) lower its loss too.

    .venv/bin/python -m pytest -q tests/gpu/test_cuda_learner.py                           # cuda (needs CUDA)
    MSRL_GPU_TESTS_ON_CPU=1 .venv/bin/python -m pytest -q tests/gpu/test_cuda_learner.py   # the cpu variant
"""
import time

import pytest
import torch

from tests.gpu.devices import model_device, run_on

TOKENS = torch.randint(3, 40, (8, 24), generator=torch.Generator().manual_seed(5))
FP32_TOL = 1e-4


def _bf16_tol() -> float:
    from megatron_sparse_rl.checkpoint.verify import TOLERANCE

    return TOLERANCE[torch.bfloat16]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def parity_worker(rank, world, model_dir, tokens, device):
    """Per dtype: the learner's device and parameter dtype, and the max and mean |logprob| and |entropy|
    differences from transformers' forward in the same dtype on the same device."""
    from tests import learner_workers as W
    from tests.distributed.test_learner import hf_reference

    out = {}
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        learner = W.make_learner(world, model_dir, dtype=dtype)
        got = learner.forward_logprobs(tokens)
        # eager experts: a plain loop of matmuls (transformers' default grouped_mm takes other kernels on CUDA)
        ref_lp, ref_ent = hf_reference(model_dir, tokens, device=device, dtype=torch_dtype,
                                       experts_implementation="eager")
        diffs = {"logprob": (got["logprobs"].double() - ref_lp).abs(),
                 "entropy": (got["entropy"].double() - ref_ent).abs()}
        out[dtype] = {"device": model_device(learner.model),
                      "param_dtype": str(next(learner.model.parameters()).dtype),
                      **{f"{k}_{stat}": float(getattr(d, stat)())
                         for k, d in diffs.items() for stat in ("max", "mean")}}
        del learner
    return out


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    return str(build_tiny_hf_model(tmp_path_factory.mktemp("qwen3_moe"), seed=3))


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    return str(build_tiny_deepseek(tmp_path_factory.mktemp("deepseek") / "hf", seed=3))


@pytest.fixture(scope="module")
def parity(device, qwen3_moe_dir, deepseek_dir):
    """{arch: parity_worker's result} (one rank per architecture, run once per device)."""
    return {arch: run_on(device, parity_worker, (model_dir, TOKENS, device))
            for arch, model_dir in (("qwen3_moe", qwen3_moe_dir), ("deepseek_v3", deepseek_dir))}


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_match_transformers_on_the_same_device(parity, device, arch, dtype, figure):
    got = parity[arch][dtype]
    for key in ("logprob_max", "logprob_mean", "entropy_max", "entropy_mean"):
        figure(f"{arch}_{dtype}_{key}_abs_diff", got[key])
    assert got["device"] == device
    assert got["param_dtype"] == f"torch.{dtype}"
    if dtype == "float32":
        assert got["logprob_max"] < FP32_TOL and got["entropy_max"] < FP32_TOL, got
    else:
        assert got["logprob_mean"] < _bf16_tol() and got["entropy_mean"] < _bf16_tol(), got


def _timed_steps(learner, tokens, loss_fn, device, steps, extras=None):
    """Losses, metrics and wall milliseconds of `steps` train steps."""
    from megatron_sparse_rl.learner.extras import NO_EXTRAS

    losses, metrics, ms = [], [], []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        m = learner.train_step(tokens, loss_fn, extras=extras or NO_EXTRAS)
        _sync(device)
        ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(m["loss"])
        metrics.append(m)
    return losses, metrics, ms


def train_replay_worker(rank, world, model_dir, tokens, device):
    """R2 on an fp32 learner (record, replay, three replayed train steps), then two steps of a bf16 learner."""
    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.learner.extras import ForwardExtras, RouteRequest
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.moe.replay import find_routers
    from tests import learner_workers as W

    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    loss_fn = make_sft_loss(mask, mask.sum().item())
    learner = W.make_learner(world, model_dir, lr=1e-2, clip=0.0, routing=RoutingConfig(mode="R2"))
    recorded = learner.forward_logprobs(tokens, extras=ForwardExtras(routes=RouteRequest(record=True)))
    replay = ForwardExtras(routes=RouteRequest(replay=recorded["routing"].routes))
    replayed = learner.forward_logprobs(tokens, extras=replay)
    routers = [r.weight.detach().clone() for r in find_routers(learner.model)]
    losses, metrics, ms = _timed_steps(learner, tokens, loss_fn, device, 3, extras=replay)
    out = {"device": model_device(learner.model),
           "replayed_vs_recorded": float((replayed["logprobs"] - recorded["logprobs"]).abs().max()),
           "applied_forward": replayed["routing"].metrics["routing/replay_applied_fraction"],
           "applied_train": [m["routing/replay_applied_fraction"] for m in metrics],
           "losses": losses, "step_ms": min(ms[1:]),
           "router_moved": [float((r.weight.detach() - b).abs().max())
                            for r, b in zip(find_routers(learner.model), routers)]}
    learner.routing.close()
    del learner
    learner = W.make_learner(world, model_dir, dtype="bfloat16", lr=1e-2, clip=0.0)
    losses, _, ms = _timed_steps(learner, tokens, loss_fn, device, 3)
    out.update(bf16_device=model_device(learner.model), bf16_losses=losses, bf16_step_ms=min(ms[1:]))
    return out


@pytest.fixture(scope="module")
def trained(device, qwen3_moe_dir):
    return run_on(device, train_replay_worker, (qwen3_moe_dir, TOKENS, device))


def test_r2_replay_gives_the_recording_forward(trained, device, figure):
    figure("r2_max_abs_logprob_diff_replayed_vs_recorded", trained["replayed_vs_recorded"])
    assert trained["device"] == device
    assert trained["applied_forward"] == 1.0
    assert trained["replayed_vs_recorded"] < 1e-6


def test_train_steps_with_r2_replay(trained, qwen3_moe_dir, device, figure):
    from tests.distributed.test_learner import hf_reference

    losses = trained["losses"]
    figure("train_step_fp32_r2_ms", trained["step_ms"], "ms")
    figure("train_loss_change_fp32_r2_3_steps", losses[-1] - losses[0])
    hf_nll = -float(hf_reference(qwen3_moe_dir, TOKENS)[0].mean())  # on the host, fp32: an independent reference
    assert abs(losses[0] - hf_nll) < FP32_TOL, (losses[0], hf_nll)
    assert trained["applied_train"] == [1.0, 1.0, 1.0]
    assert losses[2] < losses[1] < losses[0], losses
    assert trained["router_moved"] and min(trained["router_moved"]) > 0, "the routers learn under replay"


def test_bf16_train_steps(trained, qwen3_moe_dir, device, figure):
    from tests.distributed.test_learner import hf_reference

    losses = trained["bf16_losses"]
    figure("train_step_bf16_ms", trained["bf16_step_ms"], "ms")
    hf_nll = -float(hf_reference(qwen3_moe_dir, TOKENS)[0].mean())
    assert trained["bf16_device"] == device
    assert abs(losses[0] - hf_nll) < _bf16_tol(), (losses[0], hf_nll)
    assert losses[2] < losses[0], losses
