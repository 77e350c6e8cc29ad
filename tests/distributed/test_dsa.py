"""DeepSeek Sparse Attention models on the Megatron learner (fp32 CPU, Megatron-Core 0.16.1's DSAttention with the
Hadamard shim of patches/megatron_dsa_hadamard.py) against transformers 5.19 (fp32, eager attention):

- DeepSeek-V3.2 (half-split indexer rope, YaRN) and GLM-5 (interleaved indexer rope, default rope), tiny, with
  index_topk 4 on sequences of 16: every query from position 4 on really selects. Per layer and query, Megatron's
  DSAIndexer picks the same tokens as transformers' indexer (no tie at the k-th score, checked, so "the same" is
  defined), logprobs and entropies are within 1e-4 (measured here: about 1e-6), and the selection matters: the
  same model with top-k >= length (dense MLA) moves the logprobs by more than 1e-2. Also at TP2 x EP2
  (DeepSeek-V3.2) and TP2 (GLM-5), sequence parallel; every parameter's gradient within 1e-4 relative of
  transformers' autograd (DeepSeek-V3.2; the indexer's are zero on both sides).
- HF -> torch_dist -> HF round trips bit-exact (every tensor, the indexer's included): DeepSeek-V3.2 at TP2 x EP2,
  GLM-5 at PP2.
Run: .venv/bin/python -m pytest -q tests/distributed/test_dsa.py
"""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import learner_workers as W
from tests.distributed.test_learner import hf_reference
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

TOPK = 4
TOKENS = torch.randint(3, 40, (2, 17), generator=torch.Generator().manual_seed(1))
"""The learner reads the first 16 tokens of each row: 16 > TOPK."""
ARCHS = {"deepseek_v32": dict(rope="yarn", seed=3), "glm_moe_dsa": dict(rope="default", seed=5)}


@pytest.fixture(scope="module", params=list(ARCHS))
def dsa_dir(request, tmp_path_factory):
    from megatron_sparse_rl.models.tiny_families import build_tiny_dsa

    arch = request.param
    return arch, str(build_tiny_dsa(tmp_path_factory.mktemp(arch) / "hf", arch=arch, layers=2, index_topk=TOPK,
                                    **ARCHS[arch]))


def selection_worker(rank, world, model_dir, tokens):
    """Logprobs, entropies, and every DSAIndexer call's (index scores, top-k indices) of a TP1 learner."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    learner = W.make_learner(world, model_dir)
    seen = []
    for module in learner.model.modules():
        if isinstance(module, DSAIndexer):  # DSAttention calls forward_with_scores directly: wrap it (test-side)
            def record(*args, _call=module.forward_with_scores, **kwargs):
                scores, indices = _call(*args, **kwargs)
                seen.append((scores.detach().clone(), indices.detach().clone()))
                return scores, indices
            module.forward_with_scores = record
    out = learner.forward_logprobs(tokens)
    return out["logprobs"], out["entropy"], seen


def _hf_selection(model_dir, tokens):
    """transformers' top-k per indexer call (forward hooks), and its logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    seen = []
    for layer in model.model.layers:
        layer.self_attn.indexer.register_forward_hook(lambda mod, args, out: seen.append(out))
    with torch.no_grad():
        model(tokens)
    return seen


def _chosen(indices, b, q):
    return sorted(int(i) for i in indices[b, q] if i <= q)


def test_learner_selects_as_transformers_and_matches_logprobs(dsa_dir):
    arch, model_dir = dsa_dir
    lp, ent, ours = run_distributed(selection_worker, 1, args=(model_dir, TOKENS), timeout=300)[0]
    inputs = TOKENS[:, :-1]
    theirs = _hf_selection(model_dir, inputs)
    assert len(ours) == len(theirs) == 2
    batch, seq = inputs.shape
    assert seq > TOPK
    for layer, ((scores, mine), hf) in enumerate(zip(ours, theirs)):
        for b in range(batch):
            for q in range(seq):
                assert _chosen(mine, b, q) == _chosen(hf, b, q), (arch, layer, b, q)
                if q >= TOPK:  # a real choice: the k-th and (k+1)-th best scores must differ for it to be defined
                    best = scores[b, q, :q + 1].sort(descending=True).values
                    assert best[TOPK - 1] - best[TOPK] > 1e-6, (arch, layer, b, q, best)
    ref_lp, ref_ent = hf_reference(model_dir, TOKENS, attn_implementation="eager")
    assert float((lp.double() - ref_lp).abs().max()) < 1e-4
    assert float((ent.double() - ref_ent).abs().max()) < 1e-4
    dense_lp, _ = hf_reference(model_dir, TOKENS, attn_implementation="eager", index_topk=TOKENS.shape[1])
    assert float((dense_lp - ref_lp).abs().max()) > 1e-2, "top-k did not change the model: the test would not see it"


LEARNER_LAYOUTS = {"deepseek_v32": (2, 2), "glm_moe_dsa": (2, 1)}


def test_tensor_parallel_learner_matches_transformers(dsa_dir):
    """TP2 (sequence parallel: the indexer gathers its input; its projections are whole on both ranks), with EP2
    for DeepSeek-V3.2."""
    arch, model_dir = dsa_dir
    tp, ep = LEARNER_LAYOUTS[arch]
    ref_lp, ref_ent = hf_reference(model_dir, TOKENS, attn_implementation="eager")
    for lp, ent in run_distributed(W.logprobs_worker, 2, args=(model_dir, TOKENS, tp, ep), timeout=300):
        assert float((lp.double() - ref_lp).abs().max()) < 1e-4
        assert float((ent.double() - ref_ent).abs().max()) < 1e-4


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_learner_gradients_match_transformers(dsa_dir, tp):
    """Every parameter's gradient (gathered whole at tp 2, sequence parallel on) within 1e-4 relative of
    transformers' autograd on the same loss, through the sparse attention; the indexer's own are zero on both sides
    (transformers runs it under no_grad; Megatron trains it only through its KL loss, whose coefficient the adapter
    sets to 0). At tp 2 this needs patches/megatron_mla.py item 3 (the shared RoPE key's gradient over all heads)."""
    from tests.distributed.test_deepseek import grads_worker, hf_grads

    _, model_dir = dsa_dir
    hf = hf_grads(model_dir, TOKENS, attn_implementation="eager")
    for _, ours in run_distributed(grads_worker, tp, args=(model_dir, TOKENS, tp), timeout=300):
        _check_grads(model_dir, ours, hf)


def _check_grads(model_dir, ours, hf):
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.models.tensor_map import to_mcore

    adapter, spec = load_spec(model_dir)
    compared = indexer = 0
    for tm in adapter.tensor_maps(spec):
        if ".indexer." in tm.mcore:
            assert not any(n in hf for n in tm.hf) and torch.count_nonzero(ours[tm.mcore]) == 0, tm.mcore
            indexer += 1
        elif not tm.mcore.endswith("router.expert_bias"):  # a buffer: no gradient on either side
            ref = to_mcore(tm, [hf[n] for n in tm.hf], spec)
            assert ref.norm() > 0 and float((ours[tm.mcore] - ref).norm() / ref.norm()) < 1e-4, tm.mcore
            compared += 1
    assert indexer == 2 * 5 and compared + indexer == len(ours)


# ---- conversion -------------------------------------------------------------------------------------------------
def roundtrip_worker(rank, world, hf, root, tp, ep, pp):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(hf, f"{root}/mc", tp=tp, ep=ep, pp=pp)
    mcore_to_hf(f"{root}/mc", f"{root}/hf", tp=tp, ep=ep, pp=pp)


LAYOUTS = {"deepseek_v32": (2, 2, 1), "glm_moe_dsa": (1, 1, 2)}


def test_conversion_roundtrip_is_bit_exact(dsa_dir, tmp_path):
    arch, model_dir = dsa_dir
    run_distributed(roundtrip_worker, 2, args=(model_dir, str(tmp_path), *LAYOUTS[arch]), timeout=300)
    original = load_file(f"{model_dir}/model.safetensors")
    back = {}
    for f in Path(tmp_path, "hf").glob("*.safetensors"):
        back.update(load_file(str(f)))
    assert sorted(back) == sorted(original)
    norm = "model.layers.1.self_attn.indexer.k_norm.bias"
    assert original[norm].abs().max() > 0.01, "a zero k_norm bias would not show a wrong row order"
    assert {"wq_b", "wk", "k_norm", "weights_proj"} <= {n.split(".")[-2] for n in back if ".indexer." in n}
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
