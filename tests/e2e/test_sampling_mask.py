"""Keep-sampling-mask end to end: the real vLLM engine records the sampler's support (top-k/top-p kept ids) at
every response token, and the real Megatron learner renormalised over it reproduces the engine's sampling
logprobs.

- the recorded sets equal an independent float64 top-k/top-p computed from the Hugging Face model's logits
  (positions whose top-p boundary is a near-tie excepted, counted);
- the learner (TP1 and TP2 with sequence parallel) at the sampling temperature, with the record, gives the
  engine's processed logprobs to numerics; without it, it is off by the truncated mass (measured);
- gradients flow only through the kept ids (train_step with the record).
Run: .venv/bin/python -m pytest -q tests/e2e/test_sampling_mask.py -s
"""
import pytest
import torch

from tests.spawn import run_distributed

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

PROMPTS = [[1, 5, 6, 14, 11], [1, 43, 21, 19], [1, 8, 8, 9, 30, 31], [1, 12, 13]]
TEMPERATURE, TOP_K, TOP_P = 0.8, 24, 0.7


def engine_worker(rank, world_size, model_dir):
    from megatron_sparse_rl.config.rollout import RolloutConfig, SamplingConfig
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.rollout.sampling_mask import SamplingMaskCapture

    vllm_cpu.apply()
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, record_sampling_mask=True),
                           extensions=[SamplingMaskCapture()])
    try:
        sampling = SamplingConfig(n=3, max_tokens=12, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=7)
        return engine.generate(PROMPTS, sampling)
    finally:
        engine.shutdown()


def _reference_support(logits: torch.Tensor, margin: float = 1e-4):
    """Kept ids of top-k then top-p (vLLM's order: temperature, top-k, top-p on the rest) in float64, and
    whether the top-p cut is a near-tie (cumulative mass within `margin` of the threshold)."""
    z = logits.double() / TEMPERATURE
    order = torch.argsort(z, descending=True)
    z_sorted = z[order][:TOP_K]
    probs = torch.softmax(z_sorted, dim=0)
    before = torch.cumsum(probs, 0) - probs  # mass strictly above each candidate
    keep = before < TOP_P
    near_tie = bool(((before - TOP_P).abs() < margin).any())
    return set(order[:TOP_K][keep].tolist()), near_tie


def learner_worker(rank, world_size, model_dir, batch, tp):
    from megatron_sparse_rl.learner.extras import ForwardExtras
    from megatron_sparse_rl.training.learner_batch import LearnerBatch
    from tests.learner_workers import make_learner

    learner = make_learner(world_size, model_dir, tp=tp, mbs=4)
    learner.temperature = TEMPERATURE
    view = LearnerBatch.from_rollout(batch, pad_id=0)
    tokens, mask, rollout_lp = view.tokens, view.loss_mask, view.rollout_logprobs
    keep = ForwardExtras(sampling_support=batch.features.sampling_mask)
    with_keep = learner.forward_logprobs(tokens, extras=keep)["logprobs"]
    without = learner.forward_logprobs(tokens)["logprobs"]
    out = {"with": (with_keep - rollout_lp)[mask].abs().max().item(),
           "without": (without - rollout_lp)[mask].abs().max().item()}
    # gradient of the sum of kept-id logprobs w.r.t. the output layer: zero rows for ids never kept
    weight = next(p for n, p in learner.model.named_parameters() if n.endswith("output_layer.weight"))

    def loss_fn(logprobs, entropy, index):
        m = mask[index].to(logprobs.device)
        return -(logprobs * m).sum() / mask.sum(), {}

    learner.train_step(tokens, loss_fn, extras=keep)
    grad = weight.main_grad if getattr(weight, "main_grad", None) is not None else weight.grad
    out["grad_rows"] = (grad.float().abs().sum(dim=1) > 0).nonzero().squeeze(1) + learner.groups.tp_rank * grad.shape[0]
    return out


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path_factory.mktemp("sm") / "moe", experts=4, topk=2, seed=1))
    return model_dir, run_distributed(engine_worker, 1, args=(model_dir,), timeout=300)[0]


def test_recorded_support_is_the_top_k_top_p_set_of_the_model(sampled):
    from transformers import AutoModelForCausalLM

    model_dir, batch = sampled
    support = batch.features.sampling_mask
    assert len(support) == len(batch) == len(PROMPTS) * 3
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    checked = ties = 0
    for i in range(len(batch)):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        seq = torch.cat([batch.prompt_ids[i, :p], batch.response_ids[i, :r]])
        with torch.no_grad():
            logits = hf(seq[None]).logits[0]
        counts, ids = support.counts[i], support.ids[i]
        assert len(counts) == r
        offsets = [0] + torch.cumsum(counts.long(), 0).tolist()
        for j in range(r):
            recorded = set(ids[offsets[j]:offsets[j + 1]].tolist())
            assert int(batch.response_ids[i, j]) in recorded
            want, near_tie = _reference_support(logits[p - 1 + j])
            if near_tie:
                ties += 1
                continue
            assert recorded == want, f"row {i} token {j}: {sorted(recorded)} != {sorted(want)}"
            checked += 1
    print(f"\nsupport: {checked} positions equal to the float64 reference, {ties} near-ties skipped")
    assert checked >= 0.9 * (checked + ties) and checked > 50


@pytest.mark.parametrize("tp", [1, 2])
def test_learner_over_the_support_reproduces_the_engine(sampled, tp):
    model_dir, batch = sampled
    outs = run_distributed(learner_worker, tp, args=(model_dir, batch, tp), timeout=300)
    out = outs[0]
    print(f"\nTP{tp}: max |learner - engine| logprob with the support {out['with']:.2e}, without {out['without']:.2e}")
    assert out["with"] < 1e-4
    assert out["without"] > 1e-2  # the truncated mass is visible without the record
    rows = set(torch.cat([o["grad_rows"] for o in outs]).tolist())
    kept = set(torch.cat(batch.features.sampling_mask.ids).tolist())
    untruncated = any(bool((c == 0).any()) for c in batch.features.sampling_mask.counts)
    print(f"output-layer rows with gradient {len(rows)}, ids ever kept {len(kept)}")
    assert rows and not untruncated  # top-k truncates every position here
    assert rows <= kept, f"gradient reached ids never kept: {sorted(rows - kept)[:5]}"
