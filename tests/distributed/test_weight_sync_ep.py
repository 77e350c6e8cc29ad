"""Weight sync from a sharded learner: EP2 (2 gloo ranks, each holding half the experts), TP2 (2 gloo
ranks, each holding half of every linear layer, sequence parallel as Megatron requires for MoE under TP) and
PP2 (2 pipeline stages, each holding one of the two layers), one engine per rank, after a train step sync into an engine equal to one synced from a TP1 learner after
the same step; both ranks receive the whole, identical HF-named stream.

The TP1 run is the reference: its learner holds every tensor whole, so its stream needs no gathering.
Run: .venv/bin/python -m pytest -q tests/distributed/test_weight_sync_ep.py
"""
import pytest
import torch

from tests.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

TOL = 1e-4
PROBE = [[1, 5, 6, 14, 11, 18, 22, 20, 27, 21, 19, 5, 13], [1, 43, 21, 19, 9, 7, 15, 4, 4, 18, 22, 30, 31]]


def sync_worker(rank, world_size, model_dir, tp, ep, pp=1):
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.weight_sync import iter_hf_tensors, sync_to_engine, verify_logprobs
    from tests.learner_workers import make_learner

    # lr=1, eps=1: Adam's first step is smooth in the gradient, so layouts agree to ulps (see learner_workers)
    learner = make_learner(world_size, model_dir, tp=tp, ep=ep, pp=pp, lr=1.0, eps=1.0, clip=0.0)
    tokens = torch.tensor(PROBE)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    rows = torch.arange(tokens.shape[0]).chunk(learner.layout.dp)[learner.groups.dp_rank]
    learner.train_step(tokens[rows], make_sft_loss(mask[rows], mask.sum().item()))
    streamed = {name: t.clone() for name, t in iter_hf_tensors(learner)}
    # one engine per rank: vLLM builds its groups with new_group, a collective over the whole world
    vllm_cpu.apply()
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1))
    stats = sync_to_engine(learner, engine, bucket_mb=0.1)
    diff = verify_logprobs(learner, engine, PROBE, tol=TOL)
    out = {"streamed": streamed, "stats": stats, "diff": diff, "engine": torch.stack(engine.prompt_logprobs(PROBE))}
    engine.shutdown()
    return out


@pytest.fixture(scope="module")
def tp1_reference(tmp_path_factory):
    """The tiny MoE model dir and the TP1 learner's stream / engine after one step (shared by both tests)."""
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    from safetensors.torch import load_file

    model_dir = build_tiny_hf_model(tmp_path_factory.mktemp("moe"), seed=3)
    ref = run_distributed(sync_worker, 1, args=(str(model_dir), 1, 1), timeout=240)[0]
    initial = load_file(str(model_dir / "model.safetensors"))
    assert set(initial) == set(ref["streamed"]), "the stream must hold exactly the HF checkpoint's tensors"
    assert _max_tensor_diff(ref["streamed"], initial) > 1e-2, "the train step must move the weights"
    return str(model_dir), ref


def _max_tensor_diff(a: dict, b: dict) -> float:
    return max((a[n].double() - b[n].double()).abs().max().item() for n in b)


def test_ep2_sync_equals_tp1_sync(tp1_reference):
    model_dir, ref = tp1_reference
    r0, r1 = run_distributed(sync_worker, 2, args=(model_dir, 1, 2), timeout=240)
    print(f"EP2 |engine - learner| = {r0['diff']:.2e}; |engine EP2 - engine TP1| = "
          f"{(r0['engine'] - ref['engine']).abs().max():.2e}; |stream EP2 - stream TP1| = "
          f"{_max_tensor_diff(r0['streamed'], ref['streamed']):.2e}; {r0['stats']}")
    assert r0["diff"] < TOL and r1["diff"] < TOL
    assert (r0["engine"] - ref["engine"]).abs().max() < 1e-5
    assert (r1["engine"] - ref["engine"]).abs().max() < 1e-5
    assert list(r0["streamed"]) == list(r1["streamed"]) == list(ref["streamed"]), "same names, same order"
    assert any(".mlp.experts.3." in n for n in r0["streamed"]), "rank 0 must receive rank 1's experts"
    for name, value in ref["streamed"].items():
        assert torch.equal(r0["streamed"][name], r1["streamed"][name]), name
        assert torch.allclose(r0["streamed"][name], value, atol=1e-5), name
    assert r0["stats"].tensors == r1["stats"].tensors == ref["stats"].tensors
    assert r0["stats"].bytes == ref["stats"].bytes


def test_tp2_sync_equals_tp1_sync(tp1_reference):
    model_dir, ref = tp1_reference
    r0, r1 = run_distributed(sync_worker, 2, args=(model_dir, 2, 1), timeout=240)
    engine_diff = max((r["engine"] - ref["engine"]).abs().max().item() for r in (r0, r1))
    stream_diff = _max_tensor_diff(r0["streamed"], ref["streamed"])
    print(f"TP2 |engine - learner| = {max(r0['diff'], r1['diff']):.2e}; |engine TP2 - engine TP1| = "
          f"{engine_diff:.2e}; |stream TP2 - stream TP1| = {stream_diff:.2e}; {r0['stats']}")
    assert r0["diff"] < TOL and r1["diff"] < TOL
    assert list(r0["streamed"]) == list(r1["streamed"]) == list(ref["streamed"]), "same names, same order"
    for name, value in ref["streamed"].items():
        # the gathered tensor has the full (TP1) shape on both ranks, identical bit for bit between them
        assert r0["streamed"][name].shape == value.shape, name
        assert torch.equal(r0["streamed"][name], r1["streamed"][name]), name
    # the TP1 and TP2 steps reduce the gradient in different orders: fp32 rounding only
    assert stream_diff < 1e-6
    assert engine_diff < 1e-5
    assert (r0["stats"].tensors, r0["stats"].bytes) == (ref["stats"].tensors, ref["stats"].bytes)


def test_pp2_sync_equals_tp1_sync(tp1_reference):
    model_dir, ref = tp1_reference
    r0, r1 = run_distributed(sync_worker, 2, args=(model_dir, 1, 1, 2), timeout=240)
    engine_diff = max((r["engine"] - ref["engine"]).abs().max().item() for r in (r0, r1))
    stream_diff = _max_tensor_diff(r0["streamed"], ref["streamed"])
    print(f"PP2 |engine - learner| = {max(r0['diff'], r1['diff']):.2e}; |engine PP2 - engine TP1| = "
          f"{engine_diff:.2e}; |stream PP2 - stream TP1| = {stream_diff:.2e}; {r0['stats']}")
    assert r0["diff"] < TOL and r1["diff"] < TOL
    assert list(r0["streamed"]) == list(r1["streamed"]) == list(ref["streamed"]), "same names, same order"
    for name in ref["streamed"]:
        assert torch.equal(r0["streamed"][name], r1["streamed"][name]), name  # each stage got the other's layers
    assert stream_diff < 1e-6
    assert engine_diff < 1e-5
    assert (r0["stats"].tensors, r0["stats"].bytes) == (ref["stats"].tensors, ref["stats"].bytes)
