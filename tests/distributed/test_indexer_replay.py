"""Indexer replay (R2 for DeepSeek Sparse Attention) on a 1-rank Megatron learner (learner/indexer_replay.py), against
transformers (fp32, eager) whose indexer output a forward hook replaces by the recorded indices:

- replaying the old forward's recorded indices gives the logprobs of transformers' forward forced to that selection
  (forward_logprobs and train_step's update forward), within 1e-4;
- after the indexers' weights_proj is moved on both sides (the same seeded noise) (so their fresh top-k changes), the learner's own
  selection moves the logprobs away from that reference, and replay brings them back within 1e-4;
- indexer/flip_rate and indexer/agreement (and per layer) equal the share of real queries whose token set differs
  between the recorded indices and transformers' fresh (perturbed) indexer choice on the replayed forward, and the
  mean share of the recorded tokens that choice keeps, counted here by hand;
- indexer/replay_applied_fraction is 1 under replay, and equals a hand count when something between the indexer and
  the attention changes one layer's selection (the attention's input is what it measures);
- misshapen indices, and indices recorded for other tokens, are refused before the forward.
One tiny DeepSeek-V3.2 (2 DSA layers, index_topk 4), 4 rows of lengths 17, 17, 9, 12 in micro-batches of 2.
Run: .venv/bin/python -m pytest -q tests/distributed/test_indexer_replay.py
"""
import pytest
import torch

from tests import learner_workers as W
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed

TOPK = 4
TOKENS = torch.randint(3, 40, (4, 17), generator=torch.Generator().manual_seed(2))
LENGTHS = torch.tensor([17, 17, 9, 12])


def perturb(weight: torch.Tensor, layer: int) -> None:
    """Move an indexer's weights_proj ([heads, hidden], the same layout on both sides) so that its top-k changes for
    some queries, not all: Gaussian noise of PERTURBATION times the weight's std, seeded per layer."""
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(7 + layer), dtype=weight.dtype)
    weight.data.add_(noise * weight.std() * PERTURBATION)


PERTURBATION = 0.5


def _logprob_loss(seen):
    def loss_fn(logprobs, entropy, index):
        seen.append((index.clone(), logprobs.detach().clone()))
        return logprobs.sum() * 0.0, {}
    return loss_fn


def replay_worker(rank, world, model_dir, tokens, lengths):
    from megatron_sparse_rl.learner.extras import ForwardExtras
    from megatron_sparse_rl.learner.indexer_replay import IndexerRequest
    from megatron_sparse_rl.moe.indexer_storage import IndexerRecord, IndexerReplayError

    learner = W.make_learner(world, model_dir, mbs=2, indexer_replay="R2")
    out = {}

    def call(request):
        return learner.forward_logprobs(tokens, lengths=lengths, extras=ForwardExtras(indexer=request))

    old = call(learner.indexer.old_forward())  # R2: record
    recorded = old["indexer"].record
    out["old"], out["recorded"] = old["logprobs"], recorded.indices
    out["replayed"] = call(IndexerRequest(replay=recorded))["logprobs"]
    for layer, module in enumerate(learner.indexer.model.indexers):  # pi_theta's indexer now chooses otherwise
        perturb(module.linear_weights_proj.weight, layer)
    out["fresh"] = call(None)["logprobs"]
    again = call(IndexerRequest(replay=recorded, record=True, compare_with=recorded))
    out["again"], out["again_metrics"] = again["logprobs"], again["indexer"].metrics
    seen = []
    metrics = learner.train_step(tokens, _logprob_loss(seen), lengths=lengths,
                                 extras=ForwardExtras(indexer=learner.indexer.update(recorded)))
    update_lp = torch.zeros_like(out["old"])
    for index, lp in seen:
        update_lp[index, :lp.shape[1]] = lp.float()
    out["update"], out["update_metrics"] = update_lp, metrics
    out["overridden_metrics"] = _overridden_layer0(learner, call, IndexerRequest(replay=recorded))
    for name, request, toks in (
            ("refusal", IndexerRequest(replay=IndexerRecord(recorded.indices[:, :-1], recorded.token_hash)), tokens),
            ("other_tokens", IndexerRequest(replay=recorded), _other_tokens(tokens))):
        try:
            learner.forward_logprobs(toks, lengths=lengths, extras=ForwardExtras(indexer=request))
        except IndexerReplayError as e:
            out[name] = str(e)
    out["step"] = _rl_step(learner, tokens, lengths)
    return out


def _other_tokens(tokens):
    """`tokens` with row 1's fifth token changed."""
    other = tokens.clone()
    other[1, 4] += 1
    return other


def _overridden_layer0(learner, call, request):
    """The metrics of a replayed call in which something after the indexer wrapper hands the first DSA layer's
    attention all-zero indices instead of the replayed ones."""
    module = learner.indexer.model.indexers[0]
    inner = module.forward_with_scores

    def zeroed(*args, **kwargs):
        scores, indices = inner(*args, **kwargs)
        return scores, torch.zeros_like(indices)
    module.forward_with_scores = zeroed
    try:
        return call(request)["indexer"].metrics
    finally:
        module.forward_with_scores = inner


def _rl_step(learner, tokens, lengths):
    """The RL step's wiring (training/update.py): the old forward records, two updates (zero advantages: pi_theta
    stays pi_old) replay their rows' indices."""
    from types import SimpleNamespace

    from megatron_sparse_rl.config.algorithm import AlgorithmConfig
    from megatron_sparse_rl.rollout.batch import FeatureRecords
    from megatron_sparse_rl.training.learner_batch import LearnerBatch
    from megatron_sparse_rl.training.update import OldPolicyInputs, PreparedBatch, _learner_recompute, update

    mask = torch.arange(tokens.shape[1] - 1)[None, :] < (lengths - 1)[:, None]
    rollout = SimpleNamespace(features=FeatureRecords())
    x = OldPolicyInputs(LearnerBatch(rollout, tokens, lengths, mask, torch.zeros(mask.shape)), None)
    old_lp, old, _ = _learner_recompute(learner, x)
    own = learner.forward_logprobs(tokens, lengths=lengths)["logprobs"]
    prep = PreparedBatch(tokens, mask, old_lp, old_lp, torch.zeros(tokens.shape[0]), torch.ones(mask.shape), {},
                         lengths=lengths, indexer_record=old.indexer)
    metrics = update(learner, prep, AlgorithmConfig(), updates=2, dp_group=None)
    return {"recorded": old.indexer.indices, "old_lp": old_lp, "own_lp": own, "metrics": metrics}


def hf_forced(model_dir, tokens, forced, perturbed: bool):
    """transformers' logprobs with every layer's indexer output replaced by forced[:, :, layer] (int [B, S-1, k]),
    and each layer's own (fresh) indexer output on that forward; `perturbed`: weights_proj moved by `perturb`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    fresh = []
    for j, layer in enumerate(model.model.layers):
        indexer = layer.self_attn.indexer
        if perturbed:
            perturb(indexer.weights_proj.weight, j)

        def hook(mod, args, output, _j=j):
            fresh.append(output.clone())
            return forced[:, :, _j].to(output.dtype)
        indexer.register_forward_hook(hook)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits.double()
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return logp, fresh


@pytest.fixture(scope="module")
def replay_run(tmp_path_factory):
    from megatron_sparse_rl.models.tiny_families import build_tiny_dsa

    model_dir = str(build_tiny_dsa(tmp_path_factory.mktemp("dsa") / "hf", arch="deepseek_v32", layers=2,
                                   index_topk=TOPK, rope="yarn", seed=3))
    return model_dir, run_distributed(replay_worker, 1, args=(model_dir, TOKENS, LENGTHS), timeout=300)[0]


def _real():
    return torch.arange(TOKENS.shape[1] - 1)[None, :] < (LENGTHS - 1)[:, None]


def _gap(a, b):
    return float((a.double() - b.double()).abs()[_real()].max())


def test_replay_matches_forced_selection_reference(replay_run):
    model_dir, out = replay_run
    recorded = out["recorded"]
    assert recorded.dtype == torch.int16 and tuple(recorded.shape) == (4, 16, 2, TOPK)
    ref, _ = hf_forced(model_dir, TOKENS, recorded, perturbed=False)
    assert _gap(out["old"], ref) < 1e-4  # the recorded indices are the ones the old forward attended
    assert _gap(out["replayed"], ref) < 1e-4


def test_replay_after_indexer_change(replay_run):
    model_dir, out = replay_run
    ref, fresh = hf_forced(model_dir, TOKENS, out["recorded"], perturbed=True)
    assert _gap(out["fresh"], ref) > 1e-3, "the indexer change did not move the logprobs: the test would not see it"
    assert _gap(out["again"], ref) < 1e-4
    assert _gap(out["update"], ref) < 1e-4


def test_flip_rate_equals_hand_count(replay_run):
    model_dir, out = replay_run
    _, fresh = hf_forced(model_dir, TOKENS, out["recorded"], perturbed=True)
    recorded, real = out["recorded"], _real()
    rates, agreements = [], []
    for layer in range(2):
        flips = total = kept = 0
        for b in range(4):
            for q in range(16):
                if real[b, q]:
                    mine = {int(i) for i in recorded[b, q, layer] if i <= q}
                    theirs = {int(i) for i in fresh[layer][b, q] if i <= q}
                    flips, total = flips + (mine != theirs), total + 1
                    kept += len(mine & theirs) / len(mine)
        rates.append(flips / total)
        agreements.append(kept / total)
        for metrics in (out["again_metrics"], out["update_metrics"]):
            assert metrics[f"indexer/flip_rate/layer_{layer}"] == pytest.approx(rates[-1], abs=1e-12)
            assert metrics[f"indexer/agreement/layer_{layer}"] == pytest.approx(agreements[-1], abs=1e-12)
    assert 0 < sum(rates) / 2 < 1 and 0 < sum(agreements) / 2 < 1
    assert out["update_metrics"]["indexer/flip_rate"] == pytest.approx(sum(rates) / 2, abs=1e-12)
    assert out["update_metrics"]["indexer/agreement"] == pytest.approx(sum(agreements) / 2, abs=1e-12)


def test_replay_applied_fraction(replay_run):
    _, out = replay_run
    for metrics in (out["again_metrics"], out["update_metrics"]):
        assert metrics["indexer/replay_applied_fraction"] == 1.0
    # layer 0's attention got indices {0} for every query: only the queries at position 0 read the replayed set
    real = _real()
    at_zero = int(real[:, 0].sum())
    over = out["overridden_metrics"]
    assert over["indexer/replay_applied_fraction/layer_0"] == pytest.approx(at_zero / int(real.sum()), abs=1e-12)
    assert over["indexer/replay_applied_fraction/layer_1"] == 1.0


def test_rl_step_records_and_replays(replay_run):
    _, out = replay_run
    step = out["step"]
    assert tuple(step["recorded"].shape) == (4, 16, 2, TOPK)
    assert _gap(step["old_lp"], step["own_lp"]) == 0.0  # recording leaves the old forward as it was
    metrics = step["metrics"]
    # zero advantages: pi_theta = pi_old in both updates, so every row's fresh choice is its recorded one
    assert {k: metrics[k] for k in metrics if k.startswith("indexer/")} == {
        f"indexer/{name}{layer}": value for name, value in (("flip_rate", 0.0), ("agreement", 1.0),
                                                            ("replay_applied_fraction", 1.0))
        for layer in ("", "/layer_0", "/layer_1")}


def test_misshapen_or_foreign_indices_refused(replay_run):
    _, out = replay_run
    assert "IndexerRequest.replay must be integer [rows, seq-1, DSA layers, index_topk] = [4, 16, 2, 4]" \
        in out["refusal"]
    assert "IndexerRequest.replay was recorded for other tokens: rows [1] of 4" in out["other_tokens"]
