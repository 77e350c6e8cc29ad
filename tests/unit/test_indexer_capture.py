"""R3 indexer capture (rollout/indexer_capture.py) on CPU, without vLLM's DSA (GPU only, never run here): the
conversion of filed engine indices into the learner's record against hand-built values, the capture's step filing
with stand-in steps and outputs, the padding to the learner's layout, the RolloutBatch field, and the learner's R3
requests (LearnerIndexer with a model without DSA layers; `_learner_recompute` with a stand-in learner).

    .venv/bin/python -m pytest -q tests/unit/test_indexer_capture.py
"""
from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_sparse_rl.learner.indexer_replay import IndexerResult, LearnerIndexer
from megatron_sparse_rl.moe.indexer_storage import IndexerRecord, IndexerReplayError, row_hashes
from megatron_sparse_rl.rollout.batch import FeatureRecords, RolloutBatch
from megatron_sparse_rl.rollout.indexer_capture import (
    EngineIndexerCapture, EngineIndexerRows, engine_indexer_rows, row_positions,
)
from megatron_sparse_rl.vllm_access import StepContext


def crc(tokens) -> int:
    return zlib.crc32(np.asarray(tokens, dtype=np.int32).tobytes())


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


# seq of 5 tokens: 4 input positions, 2 layers, topk 3. Engine values: per-request positions, -1 = no token.
SEQ = [11, 12, 13, 14, 15]
SEEN = {0: (11, t([[0, -1, -1], [-1, 0, -1]])),
        1: (12, t([[1, 0, -1], [0, -1, 1]])),
        2: (13, t([[2, 0, 1], [1, 2, 0]])),
        3: (14, t([[3, 1, 0], [2, 3, 7]])),  # 7: above the query (clamped to 3)
        4: (15, t([[4, 3, 2], [0, 1, 2]]))}  # the last token: not an input position of this row
WANT = [[[0, 0, 0], [0, 0, 0]],
        [[1, 0, 1], [0, 1, 1]],
        [[2, 0, 1], [1, 2, 0]],
        [[3, 1, 0], [2, 3, 3]]]


def test_row_positions_replace_missing_and_above_by_the_query_position():
    got = row_positions(0, SEQ, SEEN, layers=2, topk=3)
    assert got.dtype == torch.int64 and got.tolist() == WANT


def test_rows_are_packed_and_hash_the_whole_row():
    rows = engine_indexer_rows([SEQ, SEQ[:3]], [SEEN, SEEN], layers=(1, 3), topk=3)
    assert rows.layers == (1, 3) and rows.topk == 3 and len(rows) == 2
    assert rows.rows[0].dtype == torch.int16 and rows.rows[0].tolist() == WANT
    assert rows.rows[1].tolist() == WANT[:2]
    assert rows.token_hash.tolist() == [crc(SEQ), crc(SEQ[:3])]
    # what the learner checks a record against: the call's tokens up to each row's length
    tokens = torch.tensor([SEQ, SEQ[:3] + [0, 0]])
    assert rows.token_hash.tolist() == row_hashes(tokens, torch.tensor([5, 3])).tolist()


@pytest.mark.parametrize("seen, match", [
    ({p: v for p, v in SEEN.items() if p != 2}, r"^sequence 0: the engine's indexers never ran position 2$"),
    ({**SEEN, 1: (99, SEEN[1][1])}, r"^sequence 0: position 1 was indexed for token 99, the sequence has 12$"),
    ({**SEEN, 3: (14, t([[3, 1, -2], [0, 0, 0]]))}, r"^sequence 0: position 3 has indices below -1 \(-2\)"),
    ({**SEEN, 0: (11, t([[0, 0], [0, 0]]))}, r"^sequence 0: position 0 has indices of shape \[2, 2\], want \[2, 3\]"),
])
def test_bad_filings_name_sequence_and_position(seen, match):
    with pytest.raises(IndexerReplayError, match=match):
        row_positions(0, SEQ, seen, layers=2, topk=3)


def test_padded_to_the_learner_width_with_query_positions():
    rows = engine_indexer_rows([SEQ, SEQ[:3]], [SEEN, SEEN], layers=(0, 1), topk=3)
    record = rows.padded(5)
    assert isinstance(record, IndexerRecord) and tuple(record.indices.shape) == (2, 5, 2, 3)
    fill = [[[4] * 3] * 2]
    assert record.positions()[0].tolist() == WANT + fill
    assert record.positions()[1].tolist() == WANT[:2] + [[[2] * 3] * 2, [[3] * 3] * 2] + fill
    assert record.token_hash.tolist() == [crc(SEQ), crc(SEQ[:3])]
    with pytest.raises(IndexerReplayError, match=r"^sequence 0: 4 indexed positions do not fit the learner's width 3"):
        rows.padded(3)


def test_select_and_concat_keep_row_order():
    a = engine_indexer_rows([SEQ, SEQ[:3]], [SEEN, SEEN], layers=(0, 1), topk=3)
    b = engine_indexer_rows([SEQ[:4]], [SEEN], layers=(0, 1), topk=3)
    joined = EngineIndexerRows.concat([a, b])
    assert [r.shape[0] for r in joined.rows] == [4, 2, 3]
    assert joined.select([2, 0]).token_hash.tolist() == [crc(SEQ[:4]), crc(SEQ)]
    other = engine_indexer_rows([SEQ], [SEEN], layers=(0, 2), topk=3)
    with pytest.raises(IndexerReplayError, match="parts of other"):
        EngineIndexerRows.concat([a, other])


def _batch(prompts, responses, record):
    width = max(len(r) for r in responses)
    return RolloutBatch(
        prompt_ids=torch.tensor([p + [0] * (max(map(len, prompts)) - len(p)) for p in prompts]),
        prompt_lens=torch.tensor([len(p) for p in prompts]),
        response_ids=torch.tensor([r + [0] * (width - len(r)) for r in responses]),
        response_mask=torch.tensor([[i < len(r) for i in range(width)] for r in responses]),
        rollout_logprobs=torch.zeros(len(responses), width), finish_reasons=("stop",) * len(responses),
        group_ids=torch.arange(len(responses)), features=FeatureRecords(indexer_record=record))


def test_rollout_batch_carries_the_rows():
    one = _batch([[11, 12]], [[13, 14, 15]], engine_indexer_rows([SEQ], [SEEN], layers=(0, 1), topk=3))
    two = _batch([[11]], [[12, 13]], engine_indexer_rows([SEQ[:3]], [SEEN], layers=(0, 1), topk=3))
    joined = RolloutBatch.concat([one, two], pad_id=0)
    assert joined.features.indexer_record.token_hash.tolist() == [crc(SEQ), crc(SEQ[:3])]
    assert joined.select([1]).features.indexer_record.rows[0].tolist() == WANT[:2]


class _Out(SimpleNamespace):
    pass


def test_capture_files_steps_per_request_and_position():
    """Two engine steps of two requests (a chunked prefill then decodes), stand-in buffers with extra rows past the
    step's tokens (vLLM's buffer is max_num_batched_tokens long)."""
    cap = EngineIndexerCapture()
    cap.layers, cap.topk = (0, 1), 3
    cap.begin()
    prompt_a, resp_a = [11, 12, 13], [14, 15]  # row a = SEQ
    prompt_b, resp_b = [21, 22], [23]
    step1 = StepContext(req_ids=["0_a-0000abcd", "0_b-0000abcd"], starts=[0, 3, 5],
                        input_ids=torch.tensor([11, 12, 13, 21, 22]), positions=torch.tensor([0, 1, 2, 0, 1]))
    step2 = StepContext(req_ids=["0_a-0000abcd"], starts=[0, 1], input_ids=torch.tensor([14]),
                        positions=torch.tensor([3]))
    b_rows = {0: [[0, -1, -1], [0, -1, -1]], 1: [[1, 0, -1], [0, 1, -1]]}
    for step, rows in ((step1, [SEEN[0][1], SEEN[1][1], SEEN[2][1], t(b_rows[0]), t(b_rows[1])]),
                       (step2, [SEEN[3][1]])):
        cap._on_step(step)
        for j in range(2):
            buf = torch.full((8, 3), 5, dtype=torch.int32)
            buf[:len(rows)] = torch.stack([r[j] for r in rows])
            cap._on_indices(j, buf)
    outputs = [_Out(request_id="a", outputs=[_Out(index=0, token_ids=resp_a)]),
               _Out(request_id="b", outputs=[_Out(index=0, token_ids=resp_b)])]
    rows = cap.collect(outputs, [prompt_a, prompt_b])
    assert not cap.active
    assert rows.rows[0].tolist() == WANT
    assert rows.rows[1].tolist() == [[[0, 0, 0], [0, 0, 0]], [[1, 0, 1], [0, 1, 1]]]
    assert rows.token_hash.tolist() == [crc(prompt_a + resp_a), crc(prompt_b + resp_b)]


def test_capture_refuses_a_layer_without_indices_and_an_unseen_request():
    cap = EngineIndexerCapture()
    cap.layers, cap.topk = (0, 1), 3
    cap.begin()
    cap._on_step(StepContext(req_ids=["0_a-0000abcd"], starts=[0, 1], input_ids=torch.tensor([11]),
                             positions=torch.tensor([0])))
    cap._on_indices(0, torch.zeros(4, 3, dtype=torch.int32))
    with pytest.raises(IndexerReplayError, match=r"layers \[1\] returned no indices for an engine step"):
        cap._flush()
    cap.begin()
    out = [_Out(request_id="z", outputs=[_Out(index=0, token_ids=[1])])]
    with pytest.raises(IndexerReplayError, match=r"^sequence 0: no indices captured \(request z, sample 0\)"):
        cap.collect(out, [[5]])


def test_capture_refuses_cuda_graphs_and_prefix_caching():
    engine = SimpleNamespace(vllm_args={"enforce_eager": False}, cfg=SimpleNamespace(prefix_caching=False))
    with pytest.raises(IndexerReplayError, match="set rollout.enforce_eager = true"):
        EngineIndexerCapture().on_started(engine)
    engine = SimpleNamespace(vllm_args={"enforce_eager": True}, cfg=SimpleNamespace(prefix_caching=True))
    with pytest.raises(IndexerReplayError, match="set rollout.prefix_caching = false"):
        EngineIndexerCapture().on_started(engine)


# ---- the learner's R3 requests ---------------------------------------------------------------------------
def _learner_indexer(mode: str) -> LearnerIndexer:
    return LearnerIndexer(torch.nn.Linear(2, 2), SimpleNamespace(pp=1), None, mode)


def _record(value: int) -> IndexerRecord:
    return IndexerRecord(torch.full((1, 4, 2, 3), value, dtype=torch.int16), torch.tensor([crc(SEQ)]))


def test_r3_old_forward_replays_the_engine_and_compares_the_learner_with_it():
    indexer, engine = _learner_indexer("R3"), _record(0)
    request = indexer.old_forward(engine)
    assert request.replay is engine and request.compare_with is engine and request.record
    with pytest.raises(IndexerReplayError, match="indexer_replay=R3 but the rollout batch has no engine indices"):
        indexer.old_forward(None)
    fresh = IndexerResult(record=_record(1), metrics={"indexer/flip_rate": 0.25, "indexer/flip_rate/layer_0": 0.5,
                                                      "indexer/replay_applied_fraction": 1.0})
    replayed, metrics = indexer.after_old_forward(fresh, engine)
    assert replayed is engine
    assert metrics == {"indexer/engine_flip_rate": 0.25, "indexer/engine_flip_rate/layer_0": 0.5,
                       "indexer/engine_replay_applied_fraction": 1.0}
    update = indexer.update(replayed)
    assert update.replay is engine and update.compare_with is engine


def test_r2_and_none_requests_unchanged():
    r2 = _learner_indexer("R2")
    assert r2.old_forward().replay is None and r2.old_forward().record
    fresh = IndexerResult(record=_record(1), metrics={"indexer/flip_rate": 0.0})
    assert r2.after_old_forward(fresh, None) == (fresh.record, {})
    assert _learner_indexer("none").old_forward(_record(0)) is None
    with pytest.raises(ValueError, match=r"must be 'none', 'R2' or 'R3' on the learner \(got 'R4'\)"):
        _learner_indexer("R4")


def test_learner_recompute_replays_the_engine_rows_in_the_learner_layout():
    """`_learner_recompute` with a stand-in learner: the old forward gets the batch's engine rows padded to the
    call's width (hand-built), the updates get the engine's record, the metrics the learner-vs-engine comparison."""
    from megatron_sparse_rl.training.learner_batch import LearnerBatch
    from megatron_sparse_rl.training.update import OldPolicyInputs, _learner_recompute

    rows = engine_indexer_rows([SEQ, SEQ[:3]], [SEEN, SEEN], layers=(0, 1), topk=3)
    batch = _batch([[11, 12], [11]], [[13, 14, 15], [12, 13]], rows)
    tokens = torch.tensor([SEQ, SEQ[:3] + [0, 0]])
    seen_requests = []

    def forward_logprobs(tok, lengths, extras):
        seen_requests.append(extras.indexer)
        return {"logprobs": torch.zeros(2, 4), "indexer": IndexerResult(record=_record(1),
                                                                        metrics={"indexer/flip_rate": 0.125})}
    learner = SimpleNamespace(routing=None, indexer=_learner_indexer("R3"), forward_logprobs=forward_logprobs)
    view = LearnerBatch.from_rollout(batch, pad_id=0)
    assert torch.equal(view.tokens, tokens) and view.lengths.tolist() == [5, 3]
    x = OldPolicyInputs(view, None)
    _, old, metrics = _learner_recompute(learner, x)
    replay = seen_requests[0].replay
    assert tuple(replay.indices.shape) == (2, 4, 2, 3)
    assert replay.positions()[0].tolist() == WANT
    assert replay.positions()[1].tolist() == WANT[:2] + [[[2] * 3] * 2, [[3] * 3] * 2]
    assert old.indexer is replay and metrics["indexer/engine_flip_rate"] == 0.125


def test_the_trainer_builds_the_capture_under_r3_only(tmp_path):
    from megatron_sparse_rl.validation import validate
    from megatron_sparse_rl.training.context import _engine_extensions
    from tests.unit.test_config_validate import asset_model, run_of

    path = asset_model(tmp_path, "deepseek-v3.2")
    for mode, want in (("R3", 1), ("R2", 0), ("none", 0)):
        run = run_of(f"model.path={path}", f"routing.indexer_replay={mode}", "routing.record_stats=false")
        spec = validate(run, 1, cuda=True)
        got = [e for e in _engine_extensions(run, spec) if isinstance(e, EngineIndexerCapture)]
        assert len(got) == want, mode


def test_r3_without_the_learner_old_forward_is_refused():
    from megatron_sparse_rl.training.update import _no_learner_forward

    learner = SimpleNamespace(routing=None, indexer=_learner_indexer("R3"))
    with pytest.raises(ValueError, match=r"routing\.indexer_replay = 'R3' records \(R2\) or replays \(R3\)"):
        _no_learner_forward(learner, SimpleNamespace(batch=None))
