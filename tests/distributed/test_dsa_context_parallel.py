"""DeepSeek Sparse Attention at context parallelism (parallel.cp = 2, 2 gloo ranks; models/dsa_context.py,
models/dsa_attention.py `SDPADSAttention`) on a tiny DeepSeek-V3.2 (2 DSA layers, MLA, index_topk 8), fp32 CPU.

Rows of 14, 11, 9 and 10 tokens in micro-batches of 2: 13 and 9 input positions, padded by the learner to 16 and 12
(multiples of 2 x cp = 4), so each rank's indexer picks over keys held by both ranks, and in the second micro-batch
over more keys (12) than it holds queries (6). One run at cp 1 (1 rank) is the reference, and transformers (eager):
- logprobs and entropies within 1e-4 of transformers and of cp 1; the R2 record of the indexers' top-k (per row,
  query and layer) equal to cp 1's;
- one SFT train_step with model.dsa_indexer_loss_coeff > 0 (learning rate 0): the loss and indexer/kl_loss within
  1e-6 of cp 1 (the KL's mean at cp 2 leaves out the padding to the 2 x cp chunks), the indexer's gradients (trained
  by the KL only) within 1e-4 of cp 1's, every other gradient within 1e-4 relative of transformers';
- indexer replay: with every indexer's weights_proj moved (its own top-k changes), replaying cp 1's record (as an R3
  engine record would be replayed: per row, cut to each rank's query rows) gives applied fraction 1.0 and cp 1's
  logprobs of the same replay (1e-5), and the fresh choice moved (flip rate > 0, equal to cp 1's).
The same at pp 2 x cp 2 (4 ranks, slow) against transformers and pp 2 x cp 1, and at tp 2 x cp 2 (4 ranks, slow).
Run: .venv/bin/python -m pytest -q tests/distributed/test_dsa_context_parallel.py
"""
import pytest
import torch

from tests import learner_workers as W
from tests.distributed.test_indexer_replay import perturb
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

TOPK = 8
COEFF = 0.3
TOKENS = torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(6))
LENGTHS = torch.tensor([14, 11, 9, 10])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_sparse_rl.models.tiny_families import build_tiny_dsa

    return str(build_tiny_dsa(tmp_path_factory.mktemp("dsa") / "hf", arch="deepseek_v32", layers=2, index_topk=TOPK,
                              rope="yarn", seed=3))


def _real(lengths, width):
    return torch.arange(width)[None, :] < (lengths - 1)[:, None]


def cp_worker(rank, world, model_dir, tokens, lengths, cp, replay, tp=1, pp=1):
    """R2 record forward, one SFT step with the indexer loss (its loss, metrics, every full gradient of this rank's
    stage), then with perturbed indexers the forward replaying `replay` (None: the record just made)."""
    from megatron_sparse_rl.learner.extras import ForwardExtras
    from megatron_sparse_rl.learner.indexer_replay import IndexerRequest
    from megatron_sparse_rl.learner.params import gather_full, local_params
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = W.make_learner(world, model_dir, tp=tp, pp=pp, cp=cp, clip=0.0, indexer_replay="R2",
                             indexer_loss=COEFF)

    def call(request):
        return learner.forward_logprobs(tokens, lengths=lengths, extras=ForwardExtras(indexer=request))

    old = call(learner.indexer.old_forward())
    mask = _real(lengths, tokens.shape[1] - 1).float()
    metrics = learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()), lengths=lengths, lr=0.0)
    grads = {}
    for name, lp in local_params(learner.model, learner.groups).items():
        grad = getattr(lp.param, "main_grad", None)
        if grad is not None:
            grads[name] = gather_full(type(lp)(lp.full_name, grad, lp.tp_dim, lp.glu, lp.expert), learner.groups)
    record = old["indexer"].record
    replay = record if replay is None else replay
    for layer, module in enumerate(learner.indexer.model.indexers):
        perturb(module.linear_weights_proj.weight, layer)
    replayed = call(IndexerRequest(replay=replay, record=True, compare_with=replay))
    return {"lp": old["logprobs"], "ent": old["entropy"], "record": record, "metrics": metrics, "grads": grads,
            "replay_lp": replayed["logprobs"], "replay": replayed["indexer"].metrics}


def _check(model_dir, ref, outs):
    """`outs` (every rank of a cp > 1 run) against `ref` (cp 1) and transformers (module docstring)."""
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.models.tensor_map import to_mcore

    from tests.distributed.test_deepseek import hf_grads
    from tests.distributed.test_learner import hf_reference

    real = _real(LENGTHS, TOKENS.shape[1] - 1)
    hf_lp, hf_ent = hf_reference(model_dir, TOKENS, attn_implementation="eager")
    hf = hf_grads(model_dir, TOKENS, real.float(), attn_implementation="eager")
    adapter, spec = load_spec(model_dir)
    assert float((ref["lp"].double() - hf_lp)[real].abs().max()) < 1e-4
    assert ref["metrics"]["indexer/kl_loss"] > 1e-3 and ref["replay"]["indexer/flip_rate"] > 0
    assert float((ref["replay_lp"] - ref["lp"])[real].abs().max()) < 1e-4, "the replay changes nothing it sees"
    held = {}
    for out in outs:
        assert float((out["lp"].double() - hf_lp)[real].abs().max()) < 1e-4
        assert float((out["ent"].double() - hf_ent)[real].abs().max()) < 1e-4
        assert float((out["lp"] - ref["lp"]).abs().max()) < 1e-5
        # the same tokens per real query (the order of top-k's output, and of the fillers clamped to the query, may
        # differ; positions after a row's last token are not queries the replay serves)
        ours, theirs = (r.positions().sort(-1).values for r in (out["record"], ref["record"]))
        assert torch.equal(ours[real], theirs[real])
        for key in ("loss", "indexer/kl_loss"):
            assert abs(out["metrics"][key] - ref["metrics"][key]) < 1e-6, key
        assert out["replay"]["indexer/replay_applied_fraction"] == 1.0
        assert out["replay"]["indexer/flip_rate"] == ref["replay"]["indexer/flip_rate"]
        assert float((out["replay_lp"] - ref["replay_lp"]).abs().max()) < 1e-5
        held.update(out["grads"])
    indexer = 0
    for tm in adapter.tensor_maps(spec):
        if tm.mcore.endswith("router.expert_bias"):  # a buffer: no gradient
            continue
        got = held[tm.mcore]
        if ".indexer." in tm.mcore:  # trained by the KL only: against cp 1
            want = ref["grads"][tm.mcore]
            assert want.norm() > 0 and float((got - want).abs().max()) < 1e-4 * float(want.abs().max()), tm.mcore
            indexer += 1
        else:
            want = to_mcore(tm, [hf[n] for n in tm.hf], spec)
            assert want.norm() > 0 and float((got - want).norm() / want.norm()) < 1e-4, tm.mcore
    assert indexer == 2 * 5


@pytest.fixture(scope="module")
def cp1(model_dir):
    return run_distributed(cp_worker, 1, args=(model_dir, TOKENS, LENGTHS, 1, None), timeout=300)[0]


def test_dsa_cp2_matches_cp1_and_transformers(model_dir, cp1):
    _check(model_dir, cp1, run_distributed(cp_worker, 2, args=(model_dir, TOKENS, LENGTHS, 2, cp1["record"]),
                                           timeout=300))


@pytest.mark.slow
def test_dsa_pp2_cp2_matches_pp2_cp1_and_transformers(model_dir):
    """pp 2 x cp 2 (4 ranks, stages 1,1). Its reference is pp 2 x cp 1 (2 ranks): with pipeline stages every
    micro-batch runs the batch's whole width, and the indexer KL's mean covers those positions (the learner's padding
    to 2 x cp chunks is left out, the micro-batch's own is not)."""
    ref = run_distributed(cp_worker, 2, args=(model_dir, TOKENS, LENGTHS, 1, None, 1, 2), timeout=600)
    ref = {**ref[-1], "grads": {**ref[0]["grads"], **ref[1]["grads"]}}
    _check(model_dir, ref, run_distributed(cp_worker, 4, args=(model_dir, TOKENS, LENGTHS, 2, ref["record"], 1, 2),
                                           timeout=600))


@pytest.mark.slow
def test_dsa_tp2_cp2_matches_cp1_and_transformers(model_dir, cp1):
    """tp 2 x cp 2 (4 ranks, sequence parallel): the same checks against cp 1 and transformers. Its gradients need
    patches/megatron_mla_tp.py (MLA's shared RoPE key at tp > 1)."""
    _check(model_dir, cp1, run_distributed(cp_worker, 4, args=(model_dir, TOKENS, LENGTHS, 2, cp1["record"], 2),
                                           timeout=600))
