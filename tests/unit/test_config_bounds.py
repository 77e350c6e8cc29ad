"""Configs are bounded: a YAML file (or `--set` value) whose anchors and aliases expand past what a run config holds
is refused before any Python object is built (it printed hundreds of megabytes before); every count of the config
dataclasses has an upper bound that names the field and the allowed range; and sampling that makes every sample of
a group the same (top_k = 1, a vanishing top_p, as greedy temperatures already were) is refused with groups of
n > 1. Nothing is written by a refused load.

    .venv/bin/python -m pytest -q tests/unit/test_config_bounds.py
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron_sparse_rl.config import ConfigError, load_config, to_dict
from tests.msrl import MSRL
from tests.snapshot import snapshot

ROOT = Path(__file__).resolve().parents[2]


def _write(folder: Path, text: str, name: str = "run.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def _refused(path: Path, overrides=()) -> str:
    """The ConfigError message of loading `path`; the folder is unchanged by the attempt."""
    before = snapshot(path.parent)
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    assert snapshot(path.parent) == before
    return str(err.value)


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
