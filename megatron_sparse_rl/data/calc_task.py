"""The built-in tool task: multiplications of numbers too long for a tiny model to work out, with a `calc` tool that
knows the answer, as JSONL chat data.

Each record is {"messages": [user "47382*5821=", assistant "calc(47382*5821)", tool "275810622", assistant
"275810622"], "answer": "275810622"}: the user message is the prompt, the rest a demonstrated episode that the SFT
warm start trains on (data/templates.py `encode_demo`). Operands of `min_digits`..`max_digits` digits
(defaults 4..5, products of 7..10 digits), drawn from `random.Random(seed)`, distinct. A tiny model cannot multiply
such numbers, so one that writes the product at once is almost always wrong; a model that writes `calc(47382*5821)`
gets "r: 275810622" back (env.kind: tools) and has only to copy it as its next turn. The reward is on that final
answer (exact match). Why 4..5 and not longer: the model must copy both operands into the call and the whole product
into its answer without one wrong digit; with 5..7 digits a 64-wide tiny model needed far more warm-start steps
than a CPU run affords (docs/episodes.md, what was run and seen).

Write the files the config configs/tool_calc.yaml reads:
    python -m megatron_sparse_rl.data.calc_task megatron_sparse_rl/assets/tool_calc
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def calc_records(count: int, *, min_digits: int = 4, max_digits: int = 5, seed: int = 0,
                 exclude: frozenset[tuple[int, int]] = frozenset()) -> list[dict]:
    """`count` distinct multiplication records (pairs in `exclude` skipped, a*b and b*a counted once)."""
    if not 1 <= min_digits <= max_digits <= 12:
        raise ValueError(f"digits must satisfy 1 <= min_digits <= max_digits <= 12 (got {min_digits}, {max_digits})")
    rng = random.Random(seed)
    seen, out = set(exclude), []
    while len(out) < count:
        a, b = (rng.randint(10 ** (d - 1), 10 ** d - 1)
                for d in (rng.randint(min_digits, max_digits), rng.randint(min_digits, max_digits)))
        key = (min(a, b), max(a, b))
        if key in seen:
            continue
        seen.add(key)
        product = str(a * b)
        out.append({"messages": [{"role": "user", "content": f"{a}*{b}="},
                                 {"role": "assistant", "content": f"calc({a}*{b})"},
                                 {"role": "tool", "content": product},
                                 {"role": "assistant", "content": product}], "answer": product})
    return out


def _pairs(records: list[dict]) -> frozenset[tuple[int, int]]:
    keys = set()
    for r in records:
        a, b = map(int, r["messages"][0]["content"].rstrip("=").split("*"))
        keys.add((min(a, b), max(a, b)))
    return frozenset(keys)


def write_calc_jsonl(out_dir: str | Path, *, train: int = 512, eval_: int = 64, seed: int = 0, min_digits: int = 4,
                     max_digits: int = 5) -> tuple[Path, Path]:
    """Write train.jsonl and eval.jsonl (disjoint) into `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    digits = {"min_digits": min_digits, "max_digits": max_digits}
    held_out = calc_records(eval_, seed=seed + 1, **digits)
    splits = {"train.jsonl": calc_records(train, seed=seed, exclude=_pairs(held_out), **digits),
              "eval.jsonl": held_out}
    for name, records in splits.items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return out / "train.jsonl", out / "eval.jsonl"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=512)
    p.add_argument("--eval", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-digits", type=int, default=4)
    p.add_argument("--max-digits", type=int, default=5)
    a = p.parse_args(argv)
    print(*write_calc_jsonl(a.out_dir, train=a.train, eval_=a.eval, seed=a.seed, min_digits=a.min_digits,
                            max_digits=a.max_digits))


if __name__ == "__main__":
    main()
