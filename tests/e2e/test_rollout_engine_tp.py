"""Engine tensor parallelism on CPU: two gloo ranks form ONE vLLM engine (rollout.tensor_parallel_size=2,
vLLM's external_launcher), colocated with a Megatron learner at TP2 on the same ranks.

- each rank holds half of every attention projection (a real TP2 engine, not two TP1 copies);
- both ranks return the same rollouts, equal to a TP1 engine's with the same seeds (tokens equal,
  logprobs within float32 noise, the same captured routes and top-k sampling support), and the engine's
  prompt logprobs equal transformers' (independent);
- after an SFT step, `sync_to_engine` (the full HF stream on every rank; vLLM's loaders take each rank's
  slice) leaves the engine equal to the learner's own forward within the fp32 tolerance, and different
  from before the sync; the learner's world survives the engine's shutdown;
- sparse KV (SnapKV, kv_keep recorded) in the TP2 engine: each rank compacts its own KV heads; the same
  tokens as a TP-1 sparse engine, logprobs within float32 noise, and the kv_keep records joined over the
  engine's ranks equal the TP-1 engine's (every layer, KV head and compaction).
Run: .venv/bin/python -m pytest -q tests/e2e/test_rollout_engine_tp.py
"""
import pytest
import torch

from tests.spawn import run_distributed

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

TOL = 1e-4  # fp32 engine vs learner / transformers, measured ~1e-6
PROMPTS = [[1, 5, 6, 14, 11], [1, 43, 21, 19], [1, 7, 7, 30, 22, 9, 12]]
PROBE = [[1, 5, 6, 14, 11, 18, 22, 20, 27, 21, 19, 5, 13], [1, 43, 21, 19, 9, 7, 15, 4, 4, 18, 22, 30, 31]]


def _sampling():
    from megatron_sparse_rl.config.rollout import SamplingConfig

    return SamplingConfig(n=2, temperature=1.0, top_k=8, max_tokens=10, seed=11)


def _engine(model_dir, tp: int):
    """An engine that also records the routes it used (R3) and the sampler's kept ids (keep-sampling-mask)."""
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.rollout.routes import EngineRouteCapture
    from megatron_sparse_rl.rollout.sampling_mask import SamplingMaskCapture

    vllm_cpu.apply()
    return RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=8, kv_cache_gb=1,
                                                  tensor_parallel_size=tp, logprobs_mode="processed",
                                                  record_sampling_mask=True),
                         extensions=[SamplingMaskCapture(), EngineRouteCapture()])


def _qkv_rows(model) -> int:
    return model.model.layers[0].self_attn.qkv_proj.weight.shape[0]


def _tp2_rank(rank, world_size, model_dir):
    import torch.distributed as dist

    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.weight_sync import sync_to_engine, verify_logprobs
    from tests.learner_workers import make_learner

    learner = make_learner(world_size, model_dir, tp=2)
    engine = _engine(model_dir, tp=2)
    rows = engine.apply_model(_qkv_rows)
    batch = engine.generate(PROMPTS, _sampling())
    before = engine.prompt_logprobs(PROBE)
    tokens = torch.tensor(PROBE)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
    sync_to_engine(learner, engine, bucket_mb=0.05)
    diff = verify_logprobs(learner, engine, tokens, tol=TOL)
    after = engine.prompt_logprobs(PROBE)
    engine.shutdown()
    x = torch.ones(1)
    dist.all_reduce(x)  # the learner's world outlived the engine
    return dict(rows=rows, responses=batch.responses(), logprobs=batch.rollout_logprobs, before=before,
                routes=batch.features.routed_experts.indices, support=batch.features.sampling_mask,
                after=after, diff=diff, world=x.item())


def test_two_ranks_form_one_engine(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model
    from tests.e2e.test_rollout_engine import hf_logprobs, max_diff

    model_dir = str(build_tiny_hf_model(tmp_path / "m", seed=0))
    r0, r1 = run_distributed(_tp2_rank, world_size=2, args=(model_dir,), timeout=420)
    with _engine(model_dir, tp=1) as ref:
        full_rows = ref.apply_model(_qkv_rows)
        want = ref.generate(PROMPTS, _sampling())
    assert r0["rows"] == r1["rows"] == full_rows // 2, (r0["rows"], full_rows)
    assert r0["world"] == r1["world"] == 2.0
    # one engine: both ranks see the same rollouts, and they are the TP1 engine's
    assert r0["responses"] == r1["responses"] == want.responses()
    assert torch.equal(r0["logprobs"], r1["logprobs"])
    # the records that ride along: the experts every layer used (R3) and the sampler's top-k support
    assert torch.equal(r0["routes"], want.features.routed_experts.indices) and torch.equal(r1["routes"], r0["routes"])
    ref = want.features.sampling_mask
    for got in (r0["support"], r1["support"]):
        assert torch.equal(got.prompt_lens, ref.prompt_lens)
        assert all(torch.equal(a, b) for a, b in zip(got.counts + got.ids, ref.counts + ref.ids, strict=True))
    assert all(int(c.min()) == 8 for c in ref.counts)  # top-k = 8 kept exactly 8 ids at every token
    sampled = (r0["logprobs"] - want.rollout_logprobs).abs().max().item()
    reference = max_diff(r0["before"], hf_logprobs(model_dir, PROBE))
    moved = max_diff(r0["after"], r0["before"])
    print(f"engine TP2 vs TP1 sampled logprobs {sampled:.2e}; vs transformers {reference:.2e}; after sync vs "
          f"learner {r0['diff']:.2e} / {r1['diff']:.2e}; moved by the sync {moved:.2e}")
    assert sampled < TOL and reference < TOL
    assert r0["diff"] < TOL and r1["diff"] < TOL
    assert moved > 1e-3, "the SFT step must move the weights the engine is checked against"


SPARSE_PROMPTS = [[1] + [5 + (7 * i + 3 * j) % 30 for j in range(21 + 4 * i)] for i in range(4)]


def _sparse(model_dir, tp: int):
    """A SnapKV engine (budget 64, compaction every 32 tokens) and its 150-token rollouts of SPARSE_PROMPTS."""
    from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig, SamplingConfig
    from megatron_sparse_rl.kv.engine_extension import SparseKV
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    kv = KVConfig(policy="snapkv", budget=64, window=8, interval=32, record_keep=True)
    vllm_cpu.apply()
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=640, max_num_seqs=8, kv_cache_gb=1, kv=kv,
                                                    tensor_parallel_size=tp), extensions=[SparseKV()])
    # fixed-length generations (the tiny random model samples EOS often): vLLM's ignore_eos
    engine._sampling_params = lambda s, i, **extra: RolloutEngine._sampling_params(engine, s, i, ignore_eos=True,
                                                                                   **extra)
    with engine:
        batch = engine.generate(SPARSE_PROMPTS, SamplingConfig(n=2, temperature=1.0, max_tokens=150, seed=11))
    return batch.responses(), batch.rollout_logprobs, batch.features.kv_keep


def _sparse_rank(rank, world_size, model_dir):
    return _sparse(model_dir, tp=2)


def test_sparse_kv_in_a_tp2_engine(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / "m", seed=0))
    (tok0, lp0, kv0), (tok1, lp1, kv1) = run_distributed(_sparse_rank, world_size=2, args=(model_dir,), timeout=420)
    tok, lp, kv = _sparse(model_dir, tp=1)
    assert tok0 == tok1 == tok
    assert torch.equal(lp0, lp1) and (lp0 - lp).abs().max().item() < TOL
    assert min(r.num_compactions for r in kv) >= 3
    for got, want, other in zip(kv0, kv, kv1):
        assert got.lengths == want.lengths == other.lengths
        assert got.kept[0].shape == want.kept[0].shape  # [layers, every KV head, budget]
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(got.kept, want.kept, other.kept))
    print(f"sparse TP2 vs TP1: tokens equal, logprobs {(lp0 - lp).abs().max().item():.2e}, "
          f"{sum(r.num_compactions for r in kv)} compactions' keep sets equal")
