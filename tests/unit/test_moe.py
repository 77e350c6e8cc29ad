"""moe/ without Megatron or vLLM: packed route storage (dtype, offsets, select, safetensors round trip, bad
input), statistics against hand-computed values, RoutingConfig checks, and `msrl routing inspect|compare`.
Run: .venv/bin/python -m pytest -q tests/unit/test_moe.py
"""
import math

import pytest
import torch

from megatron_sparse_rl.moe.stats import agreement, expert_load, flipped_fraction, load_entropy, routing_metrics
from megatron_sparse_rl.moe.storage import RouteStore, RoutingError, index_dtype, token_hash


def _store(routes, experts=8, layers=(0, 1), source="x"):
    toks = [list(range(10, 10 + r.shape[0])) for r in routes]
    return RouteStore.from_sequences(routes, toks, num_experts=experts, layers=layers, source=source)


def test_packed_uint8_no_padding():
    a, b = torch.randint(0, 8, (5, 2, 2)), torch.randint(0, 8, (3, 2, 2))
    s = _store([a, b])
    assert s.indices.dtype == torch.uint8 and s.indices.shape == (8, 2, 2)  # 5 + 3 rows, not 2 x 5
    assert s.offsets.tolist() == [0, 5, 8] and len(s) == 2
    assert torch.equal(s.sequence(1).long(), b)
    assert s.nbytes == 8 * 4 + 3 * 8 + 2 * 8
    assert torch.equal(s.select([1, 0]).sequence(0).long(), b)


def test_concat_joins_every_field_as_one_store_of_all_sequences():
    """concat of two stores equals the store packed from all their sequences at once (the reference), field by
    field; a field added to RouteStore fails here until concat and this test know it."""
    from dataclasses import fields

    routes = [torch.randint(0, 8, (n, 2, 2)) for n in (5, 3, 4)]
    joined = RouteStore.concat([_store(routes[:2]), _store(routes[2:])])
    want = _store(routes)
    assert {f.name for f in fields(RouteStore)} == {"indices", "offsets", "token_hash", "num_experts", "layers",
                                                    "source"}
    assert torch.equal(joined.indices, want.indices) and joined.offsets.tolist() == [0, 5, 8, 12]
    assert torch.equal(joined.offsets, want.offsets) and torch.equal(joined.token_hash, want.token_hash)
    assert (joined.num_experts, joined.layers, joined.source) == (8, (0, 1), "x")
    with pytest.raises(RoutingError, match="disagree on layers"):
        RouteStore.concat([_store(routes[:1]), _store([routes[1][:, :1]], layers=(1,))])


def test_dtype_by_expert_count():
    assert index_dtype(256) == torch.uint8 and index_dtype(257) == torch.uint16
    s = _store([torch.tensor([[[300, 1]]])], experts=512, layers=(3,))
    assert s.indices.dtype == torch.uint16 and int(s.indices.long().max()) == 300


def test_bad_routes_raise():
    with pytest.raises(RoutingError, match="sequence 0: expert index out of"):
        _store([torch.tensor([[[8, 1], [0, 1]]])])
    with pytest.raises(RoutingError, match="sequence 1: routes of shape"):
        RouteStore.from_sequences([torch.zeros(2, 2, 2), torch.zeros(3, 2, 2)], [[1, 2], [1, 2]], num_experts=4,
                                  layers=(0, 1))
    with pytest.raises(RoutingError, match="sequence 5: no routes"):
        _store([torch.zeros(2, 2, 2, dtype=torch.long)]).select([5])


def test_save_load_round_trip(tmp_path):
    s = _store([torch.randint(0, 8, (4, 2, 2)), torch.randint(0, 8, (6, 2, 2))], source="engine")
    path = s.save(tmp_path / "r.safetensors")
    t = RouteStore.load(path)
    assert torch.equal(t.indices, s.indices) and torch.equal(t.offsets, s.offsets)
    assert torch.equal(t.token_hash, s.token_hash) and t.layers == (0, 1) and t.source == "engine"
    (tmp_path / "bad.safetensors").write_bytes(b"nope")
    with pytest.raises(Exception):
        RouteStore.load(tmp_path / "bad.safetensors")


def test_token_hash_identifies_tokens():
    assert token_hash([1, 2, 3]) == token_hash(torch.tensor([1, 2, 3]))
    assert token_hash([1, 2, 3]) != token_hash([1, 2, 4])


def test_agreement_and_flips_hand_computed():
    # 3 tokens, 2 layers, top-2. Order within a set does not matter.
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]])
    b = torch.tensor([[[1, 0], [2, 3]], [[4, 6], [6, 7]], [[0, 2], [1, 4]]])
    sa, sb = _store([a]), _store([b])
    assert agreement(sa, sb).tolist() == pytest.approx([2 / 3, 2 / 3])
    assert flipped_fraction(sa, sb) == pytest.approx(2 / 3)
    other = RouteStore.from_sequences([b], [[9, 9, 9]], num_experts=8, layers=(0, 1))
    with pytest.raises(RoutingError, match="sequence 0: the two route sets belong to different tokens"):
        agreement(sa, other)


def test_load_and_entropy_hand_computed():
    s = _store([torch.tensor([[[0, 1]], [[0, 1]]])], experts=4, layers=(0,))
    load = expert_load(s)
    assert load.tolist() == [[2, 2, 0, 0]]
    assert load_entropy(load).tolist() == pytest.approx([math.log(2) / math.log(4)])
    m = routing_metrics(s, s)
    assert m["routing/flip_rate/layer0"] == 0.0 and m["routing/flipped_token_fraction"] == 0.0
    assert m["routing/load_max_over_mean/layer0"] == pytest.approx(2.0)


def test_routing_config():
    from megatron_sparse_rl.config.routing import RoutingConfig

    assert RoutingConfig().mode == "off" and RoutingConfig(mode="R3").capture
    with pytest.raises(ValueError, match="routing.mode must be one of"):
        RoutingConfig(mode="R4")
    with pytest.raises(ValueError, match="routing.aux_loss must be one of"):
        RoutingConfig(aux_loss="on")


def test_cli_inspect_compare(tmp_path, capsys):
    from megatron_sparse_rl.tools.cli import main

    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    b = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [6, 7]]])
    pa, pb = _store([a], source="engine").save(tmp_path / "a.st"), _store([b], source="learner").save(tmp_path / "b.st")
    assert main(["routing", "inspect", str(pa)]) == 0
    assert "1 sequences, 2 tokens, 2 MoE layers" in capsys.readouterr().out
    png = tmp_path / "agree.png"
    assert main(["routing", "compare", str(pa), str(pb), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "layer 1: agreement 0.5000" in out and "flipped expert 0.5000" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["routing", "inspect", str(tmp_path / "missing.st")]) == 2
    c = _store([torch.zeros(3, 2, 2, dtype=torch.long)]).save(tmp_path / "c.st")
    assert main(["routing", "compare", str(pa), str(c)]) == 2
    assert "cover different tokens" in capsys.readouterr().err
