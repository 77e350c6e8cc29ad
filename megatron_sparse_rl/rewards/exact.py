"""Exact-answer reward: the response's answer text must equal the reference answer.

The answer text of a response is what precedes the first "<eos>" (the character tokenizer's eos, in
case the response was decoded with special tokens) or newline, stripped of surrounding whitespace. A task
whose responses work towards the answer (`DataConfig.answer_marker`, e.g. "so" for scratchpad arithmetic)
passes that marker: the answer text is then what follows its last occurrence on that line, and a line
without it (a response cut off before the answer) has an empty answer.

Decimal numerals compare by value: "19" == "19.0" == "19.00" (a dataset's `19.0` is the number 19, which a
response writes "19"). A decimal numeral here is an optional "-", an integer part without leading zeros and an
optional fraction ("0.5", "-12", "3.140"); the zeros that end its fraction do not count, nothing else changes: "019",
"+19", "1,9", "1e3" and "1/2" are text, as they were ("math", or its fallback `numeric_answer`, reads those as
numbers). Answers that are not decimal numerals compare as text.
"""
from __future__ import annotations

import re
from fractions import Fraction

from megatron_sparse_rl.models.char_tokenizer import EOS

_STOPS = (EOS, "\n")
_DECIMAL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")


def decimal_form(text: str) -> str:
    """`text` stripped, and when it is a decimal numeral without the zeros that end its fraction ("19.00" -> "19",
    "0.50" -> "0.5"); two decimal numerals have the same value exactly when their forms are equal ("-0" aside)."""
    text = text.strip()
    if "." in text and _DECIMAL.fullmatch(text):
        text = text.rstrip("0").rstrip(".")
    return text


def extract_answer(response: str, marker: str = "") -> str:
    """The answer text: up to the first <eos> or newline, stripped; with a `marker`, only what follows the
    marker's last occurrence there ('' when it does not occur)."""
    cut = len(response)
    for stop in _STOPS:
        i = response.find(stop)
        if i != -1:
            cut = min(cut, i)
    line = response[:cut]
    if marker:
        i = line.rfind(marker)
        line = line[i + len(marker):] if i != -1 else ""
    return line.strip()


def exact_answer(response: str, answer: str) -> float:
    """1.0 if the response's answer text equals `answer` (stripped), decimal numerals by value ("19" matches
    "19.0"), else 0.0."""
    return 1.0 if decimal_form(extract_answer(response)) == decimal_form(answer) else 0.0


def as_number(text: str) -> Fraction | None:
    """`text` as an exact rational ("19", "-3", "0.5", "1/2", "1e3", "1,000"), or None if it is not one."""
    text = text.strip().replace(",", "")
    if not text:
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def numeric_answer(response: str, answer: str) -> float:
    """1.0 if the answer text equals `answer` exactly or as a number ("0.50" == "1/2"), else 0.0."""
    got = extract_answer(response)
    if decimal_form(got) == decimal_form(answer):
        return 1.0
    a, b = as_number(got), as_number(answer)
    return 1.0 if a is not None and b is not None and a == b else 0.0


def digit_overlap(response: str, answer: str) -> float:
    """Fraction of the reference's characters that the answer text matches, aligned from the right
    (units digit against units digit), decimal numerals without their fraction's ending zeros; used for partial
    credit."""
    got, ref = decimal_form(extract_answer(response)), decimal_form(answer)
    if not ref:
        return 0.0
    hits = sum(g == r for g, r in zip(reversed(got), reversed(ref)))
    return hits / max(len(ref), len(got))
