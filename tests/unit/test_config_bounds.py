"""Configs are bounded: a YAML file (or `--set` value) whose anchors and aliases expand past what a run config holds
is refused before any Python object is built (it printed hundreds of megabytes before); every count of the config
dataclasses has an upper bound that names the field and the allowed range; and sampling that makes every sample of
a group the same (top_k = 1, a vanishing top_p, as greedy temperatures already were) is refused with groups of
n > 1. Nothing is written by a refused load.

    .venv/bin/python -m pytest -q tests/unit/test_config_bounds.py
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megatron_sparse_rl.config import ConfigError, load_config, to_dict
from megatron_sparse_rl.config.checks import MAX_BATCH
from tests.msrl import MSRL
from tests.snapshot import snapshot

ROOT = Path(__file__).resolve().parents[2]


from tests.unit.test_config_meaning import _refused, _write  # noqa: E402  (one pair of helpers for both)


# ---- YAML anchors and aliases ----------------------------------------------------------------------------------

def _laughs(levels: int, width: int = 10) -> str:
    """A flow list of `levels` anchored lists, each holding `width` aliases of the one before (the first `width`
    scalars): written out, level k holds (width**(k+1) - 1) / (width - 1) values (a list of 10 scalars is 11)."""
    items = ["&l0 [" + ", ".join(["lol"] * width) + "]"]
    items += [f"&l{k} [" + ", ".join([f"*l{k - 1}"] * width) + "]" for k in range(1, levels)]
    return "[" + ", ".join(items) + "]"


# Hand count of `model: {path: _laughs(5)}`: the top mapping, the key model, its mapping, the key path, the list,
# then the five levels 11 + 111 + 1111 + 11111 + 111111.
LAUGHS_5_VALUES = 1 + 1 + 1 + 1 + 1 + 11 + 111 + 1111 + 11111 + 111111


def test_an_alias_bomb_is_refused_naming_the_file_and_the_limit(tmp_path):
    path = _write(tmp_path, f"model:\n  path: {_laughs(5)}\n")
    assert len(path.read_text()) < 300
    message = _refused(path)
    assert message == (f"{path}: its anchors and aliases expand to {LAUGHS_5_VALUES:,} values; at most 100,000 are "
                       "allowed (a run config has a few hundred: write repeated values out, or alias a value without "
                       "nesting aliases inside aliases)")


def test_msrl_validate_of_an_alias_bomb_prints_one_line(tmp_path):
    """Before: `model.path: expected str, got [[...` with every copy written out (351 MB for 8 levels of 9)."""
    path = _write(tmp_path, f"model:\n  path: {_laughs(9)}\n")
    before = snapshot(tmp_path)
    done = subprocess.run([*MSRL, "validate", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[:2000]
    assert done.stderr.startswith(f"error: {path}: its anchors and aliases expand to 1,234,567,904 values")
    assert len(done.stdout) + len(done.stderr) < 2000
    assert snapshot(tmp_path) == before


def test_an_alias_bomb_in_an_override_is_refused_naming_it(tmp_path):
    path = _write(tmp_path, "")
    message = _refused(path, [f"rollout.sampling.stop={_laughs(5)}"])
    assert message.startswith(f"override rollout.sampling.stop=...: its anchors and aliases expand to "
                              f"{LAUGHS_5_VALUES - 4:,} values; at most 100,000 are allowed")


def test_a_recursive_alias_is_refused_naming_the_file_and_line(tmp_path):
    path = _write(tmp_path, "rollout:\n  sampling:\n    stop: &s [a, *s]\n")
    assert _refused(path) == (f"{path}: an alias refers to the anchor it is inside (a recursive value, line 3); a "
                              "run config holds no recursive values")


def test_ordinary_anchors_and_merge_keys_still_load(tmp_path):
    aliased = _write(tmp_path, "rollout:\n  sampling: {n: 8, max_tokens: 64, stop: &stops ['###', 'Q:']}\n"
                               "env:\n  turn_stop: *stops\n"
                               "trainer:\n  sft: {<<: {lr: 0.002, max_steps: 3}, batch_size: 8}\n", name="aliased.yaml")
    written_out = _write(tmp_path, "rollout:\n  sampling: {n: 8, max_tokens: 64, stop: ['###', 'Q:']}\n"
                                   "env:\n  turn_stop: ['###', 'Q:']\n"
                                   "trainer:\n  sft: {lr: 0.002, max_steps: 3, batch_size: 8}\n", name="plain.yaml")
    run = load_config(aliased)
    assert run.env.turn_stop == ("###", "Q:") and run.trainer.sft.max_steps == 3
    assert to_dict(run) == to_dict(load_config(written_out))


# ---- upper bounds of the counts -------------------------------------------------------------------------------

HUGE = 10**12


def _int_fields(cls=None, path: str = "") -> list[str]:
    """The dotted path of every field of the run config typed int (or int | None), at any depth."""
    import dataclasses
    import typing

    from megatron_sparse_rl.config import RunConfig

    cls = cls or RunConfig
    found = []
    for f in dataclasses.fields(cls):
        tp, dotted = typing.get_type_hints(cls)[f.name], f"{path}.{f.name}" if path else f.name
        members = typing.get_args(tp) or (tp,)
        section = next((m for m in members if dataclasses.is_dataclass(m)), None)
        if section is not None:
            found += _int_fields(section, dotted)
        elif int in members:
            found.append(dotted)
    return found


INT_FIELDS = _int_fields()
DERIVED = {"rollout.sampling.seed"}
"""Counts a run also fills in itself, beyond 10**12 in long runs: each step's requests get seeds derived from
rollout.seed (training/steps.py `_seed`: steps x 1,000,003)."""


def test_the_walk_finds_the_counts_of_every_section():
    assert {"env.max_turns", "rollout.sampling.n", "rollout.sampling.max_tokens", "trainer.steps",
            "trainer.prompts_per_step", "learner.micro_batch_size", "trainer.sft.batch_size", "model.tiny.hidden",
            "rollout.kv.budget", "launch.nodes", "launch.slurm.signal_seconds", "data.arithmetic.train_size",
            "algorithm.old_logprobs_samples", "checkpoint.save_every", "parallel.tp"} <= set(INT_FIELDS)


@pytest.mark.parametrize("dotted", sorted(set(INT_FIELDS) - DERIVED))
def test_every_count_refuses_a_nonsense_value_naming_the_field(tmp_path, dotted):
    """10**12 of anything (turns, samples, steps, seeds, layers, nodes) is a typo: refused at load, naming the field
    and the range allowed."""
    mla = dotted.split(".")[-1] in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                    "q_lora_rank", "first_k_dense", "shared_experts", "n_group", "topk_group")
    overrides = [f"{dotted}={HUGE}"] + (["model.tiny.arch=deepseek_v3"] if mla else [])
    message = _refused(_write(tmp_path, ""), overrides)
    assert message.startswith(dotted + " "), message
    assert f"(got {HUGE})" in message, message
    assert re.search(r"\[[^]]*, [^]]*\d\]|<= \S*\d", message), message  # the range allowed: [low, high] or <= x


@pytest.mark.parametrize("dotted, message", [
    ("env.max_turns", "env.max_turns must be in [1, 4096] (got 1000000000000)"),
    ("env.max_total_tokens", "env.max_total_tokens must be in [1, 16777216] (got 1000000000000)"),
    ("rollout.sampling.n", "rollout.sampling.n must be in [1, 1024] (got 1000000000000)"),
    ("rollout.sampling.max_tokens", "rollout.sampling.max_tokens must be in [1, 16777216] (got 1000000000000)"),
    ("trainer.steps", "trainer.steps must be in [0, 10000000] (got 1000000000000)"),
    ("trainer.prompts_per_step", "trainer.prompts_per_step must be in [1, 1048576] (got 1000000000000)"),
    ("learner.micro_batch_size", "learner.micro_batch_size must be in [1, 1048576] (got 1000000000000)"),
    ("launch.slurm.signal_seconds", "launch.slurm.signal_seconds must be in [10, 65535] (got 1000000000000)"),
])
def test_the_main_counts_say_their_range(tmp_path, dotted, message):
    assert _refused(_write(tmp_path, ""), [f"{dotted}={HUGE}"]) == message


def test_a_sampling_seed_takes_what_a_long_run_derives_and_refuses_what_a_torch_generator_cannot(tmp_path):
    derived = 2**32 - 1 + 1_000_003 * 10_000_000 + 10_007 * 65_536  # largest rollout.seed, steps and data rank
    assert load_config(_write(tmp_path, ""), [f"rollout.sampling.seed={derived}"]).rollout.sampling.seed == derived
    import torch

    torch.Generator().manual_seed(derived)  # what the engine does with it,
    torch.Generator().manual_seed(2**63 - 1 + MAX_BATCH)  # also for sample i of a batch (seed + i) at the bound
    with pytest.raises(ValueError, match="Overflow"):
        torch.Generator().manual_seed(2**64)
    assert _refused(_write(tmp_path, ""), [f"rollout.sampling.seed={2**63}"]) == (
        f"rollout.sampling.seed must be None or in [0, {2**63 - 1}] (got {2**63})")


@pytest.mark.parametrize("setting", ["env.max_turns=4096", "rollout.sampling.n=1024", "trainer.steps=10000000",
                                     "trainer.prompts_per_step=1048576", "rollout.sampling.max_tokens=16777216",
                                     "learner.seed=4294967295", "launch.slurm.signal_seconds=65535"])
def test_the_bounds_themselves_load(tmp_path, setting):
    dotted, value = setting.split("=")
    run = load_config(_write(tmp_path, ""), [setting])
    node = run
    for part in dotted.split("."):
        node = getattr(node, part)
    assert node == int(value)


def test_msrl_validate_refuses_ten_to_the_twelve_turns(tmp_path):
    """Before: `msrl validate configs/tiny_moe.yaml --set env.max_turns=1000000000000` printed the summary and ok."""
    before = snapshot(tmp_path)
    done = subprocess.run([*MSRL, "validate", str(ROOT / "configs" / "tiny_moe.yaml"), "--set",
                           f"env.max_turns={HUGE}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: env.max_turns must be in [1, 4096] (got 1000000000000)" in done.stderr
    assert snapshot(tmp_path) == before


# ---- truncation that makes a group greedy ----------------------------------------------------------------------

def test_top_k_one_with_groups_is_refused_naming_both_fields(tmp_path):
    path = _write(tmp_path, "rollout:\n  sampling:\n    n: 4\n    top_k: 1\n")
    assert _refused(path) == ("rollout.sampling.top_k = 1 (greedy) with rollout.sampling.n = 4: keeping only the most "
                              "likely token gives every sample of a group the same response (each group's advantages "
                              "would be 0); set rollout.sampling.top_k = -1 (off) or >= 2, or rollout.sampling.n = 1")


@pytest.mark.parametrize("top_p", ["1e-9", "0.001", "0.00999"])
def test_a_vanishing_top_p_with_groups_is_refused_naming_both_fields(tmp_path, top_p):
    path = _write(tmp_path, f"rollout:\n  sampling:\n    n: 8\n    top_p: {top_p}\n")
    message = _refused(path)
    assert message.startswith(f"rollout.sampling.top_p = {float(top_p):g} (nearly greedy) with "
                              "rollout.sampling.n = 8: ")
    assert message.endswith("set rollout.sampling.top_p >= 0.01, or rollout.sampling.n = 1")


def test_what_a_group_would_get_from_the_engine():
    """The reference for the two rules, vLLM's own top-k/top-p mask (its v1 sampler): top_k = 1 keeps one token of
    any distribution; top_p 0.001 keeps one token wherever the most likely one has probability >= 0.001, which even a
    nearly flat distribution over 1000 tokens has; top_p 0.01 keeps more where no token reaches 0.01."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    logits = 0.01 * torch.randn(2, 1000, generator=torch.Generator().manual_seed(0))  # every token near 0.001

    def kept(k, p):
        return (ops.apply_top_k_top_p(logits.clone(), k, p) > -float("inf")).sum(dim=-1).tolist()

    assert kept(torch.tensor([1, 1]), None) == [1, 1]
    assert kept(None, torch.tensor([0.001, 0.001])) == [1, 1]
    assert min(kept(None, torch.tensor([0.01, 0.01]))) > 1


@pytest.mark.parametrize("text", ["n: 1\n    top_k: 1", "n: 1\n    top_p: 0.001", "n: 4\n    top_k: 2",
                                  "n: 4\n    top_p: 0.01", "n: 4\n    top_k: -1\n    top_p: 0.95"])
def test_truncations_that_leave_a_group_room_to_differ_load(tmp_path, text):
    run = load_config(_write(tmp_path, f"rollout:\n  sampling:\n    {text}\n"))
    assert run.rollout.sampling.n in (1, 4)
