"""Algorithm config: references.md defaults, the project's dataclass convention (frozen, kw-only,
slots, a docstring under every field, allowed field types) and validation errors naming the field.

    .venv/bin/python -m pytest -q tests/unit/test_algorithms_config.py
"""
import ast
import dataclasses
import inspect
import types
import typing

import pytest

from megatron_sparse_rl.config import algorithm as A

CLASSES = [obj for _, obj in inspect.getmembers(A, inspect.isclass)
           if dataclasses.is_dataclass(obj) and obj.__module__ == A.__name__]


def test_defaults_follow_references():
    cfg = A.AlgorithmConfig()
    assert cfg.loss.name == "grpo" and cfg.loss.clip_bounds() == (0.2, 0.2)
    assert cfg.loss.clip_bounds("dapo") == (0.2, 0.28) and cfg.loss.dual_clip_c == 3.0
    assert cfg.loss.clip_bounds("gspo") == (3e-4, 4e-4)
    c = cfg.corrections
    assert (c.tis.cap, c.mis.low, c.mis.high, c.geo_rs.low, c.geo_rs.high) == (2.0, 0.5, 2.0, 0.999, 1.001)
    assert (c.veto.threshold, c.icepop.alpha, c.icepop.beta, c.opsm.delta) == (1e-4, 0.5, 5.0, 0.5)
    s = c.sparse_rl
    assert (s.eps, s.weight_cap, s.log_clamp) == (1e-4, 1.5, 20.0)
    assert (s.token_low, s.token_high, s.normalize) == (0.5, 1.5, True)
    assert c.batch_skip.max_k1 == 0.1
    assert not any(getattr(c, f.name).enabled for f in dataclasses.fields(c))
    assert cfg.kl.coef == 0.0 and cfg.kl.estimator == "k3"
    # the conventions docs/from_verl_slime.md compares: no k3 cap, KL weighted like the policy term, dropped tokens
    # out of the denominators, grpo without a negative-advantage cap (dual_clip has it)
    assert cfg.kl.clamp is None and cfg.kl.correction_weights and not cfg.loss.dropped_tokens_in_denominator


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_convention(cls):
    params = cls.__dataclass_params__
    assert params.frozen and hasattr(cls, "__slots__") and all(f.kw_only for f in dataclasses.fields(cls))
    body = ast.parse(inspect.getsource(cls)).body[0].body
    documented = {node.target.id for node, nxt in zip(body, body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                  and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        assert f.name in documented, f"{cls.__name__}.{f.name} has no docstring"
        assert allowed(hints[f.name]), f"{cls.__name__}.{f.name}: {hints[f.name]}"
    cls()  # every field has a default


def allowed(tp):
    if tp in (int, float, bool, str) or dataclasses.is_dataclass(tp):
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return True
    if origin is tuple:
        return len(args) == 2 and args[1] is Ellipsis and allowed(args[0])
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return len(rest) == 1 and len(args) == 2 and allowed(rest[0])
    return False


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        A.LossConfig().clip_low = 0.1


@pytest.mark.parametrize("make,message", [
    (lambda: A.LossConfig(clip_low=-0.1), r"algorithm\.loss\.clip_low must be >= 0 \(got -0\.1\)"),
    (lambda: A.LossConfig(clip_high=-1.0), r"algorithm\.loss\.clip_high must be >= 0 \(got -1\.0\)"),
    (lambda: A.LossConfig(clip_low=1.5), r"algorithm\.loss\.clip_low must be <= 1 \(got 1\.5\)"),
    (lambda: A.LossConfig(dual_clip_c=0.9), r"algorithm\.loss\.dual_clip_c must be > 1 \(got 0\.9\)"),
    (lambda: A.LossConfig(name="ppo"), r"algorithm\.loss\.name must be one of \['grpo', .*'cispo'\] \(got 'ppo'\)"),
    (lambda: A.LossConfig(aggregation="sum"), r"algorithm\.loss\.aggregation must be one of"),
    (lambda: A.MISConfig(low=3.0), r"algorithm\.corrections\.mis\.low must be <= algorithm\.corrections\.mis\.high "
                                   r"\(got 3\.0 > 2\.0\)"),
    (lambda: A.MISConfig(low=-1.0), r"algorithm\.corrections\.mis\.low must be > 0 \(got -1\.0\)"),
    (lambda: A.GeoRSConfig(low=1.01), r"algorithm\.corrections\.geo_rs\.low must be <="),
    (lambda: A.IcePopConfig(alpha=6.0), r"algorithm\.corrections\.icepop\.alpha must be <= .*beta \(got 6\.0 > 5\.0\)"),
    (lambda: A.SparseRLConfig(token_low=2.0), r"algorithm\.corrections\.sparse_rl\.token_low must be <="),
    (lambda: A.SparseRLConfig(eps=0.0), r"algorithm\.corrections\.sparse_rl\.eps must be > 0"),
    (lambda: A.TISConfig(cap=-2.0), r"algorithm\.corrections\.tis\.cap must be > 0"),
    (lambda: A.TISConfig(level="batch"), r"algorithm\.corrections\.tis\.level must be one of"),
    (lambda: A.VetoConfig(threshold=0.0), r"algorithm\.corrections\.veto\.threshold must be > 0"),
    (lambda: A.OPSMConfig(delta=-0.5), r"algorithm\.corrections\.opsm\.delta must be >= 0"),
    (lambda: A.BatchSkipConfig(max_k1=-0.1), r"algorithm\.corrections\.batch_skip\.max_k1 must be >= 0"),
    (lambda: A.KLConfig(coef=-1.0), r"algorithm\.kl\.coef must be >= 0 \(got -1\.0\)"),
    (lambda: A.KLConfig(estimator="k4"), r"algorithm\.kl\.estimator must be one of"),
    (lambda: A.AdvantageConfig(estimator="ppo"), r"algorithm\.advantage\.estimator must be one of"),
    (lambda: A.AdvantageConfig(eps=0.0), r"algorithm\.advantage\.eps must be > 0"),
])
def test_invalid_values_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()
