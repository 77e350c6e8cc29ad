"""Prompt templates and tokenization of prompts and of SFT (warm-start) sequences.

Templates (`data.template`):
- plain: the prompt text as is, encoded with the tokenizer's special tokens (the character
  tokenizer prepends <bos>).
- chat: the tokenizer's own chat template (one user turn, generation prompt added) when it has one;
  otherwise the simple format `SIMPLE_CHAT_FORMAT` = "q: {prompt}\\na: ", which stays inside the
  character tokenizer's alphabet.

`tokenizer` is a Hugging Face tokenizer (e.g. `AutoTokenizer.from_pretrained(model_dir)`).
"""
from __future__ import annotations

from megatron_sparse_rl.data.types import Example, SFTExample

SIMPLE_CHAT_FORMAT = "q: {prompt}\na: "
TEMPLATES = ("plain", "chat")


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply_template(tokenizer, text: str, template: str) -> str:
    """The templated prompt text (what is tokenized and shown to the model)."""
    if template == "plain":
        return text
    if template == "chat":
        if _has_chat_template(tokenizer):
            return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return SIMPLE_CHAT_FORMAT.format(prompt=text)
    raise ValueError(f"data.template: {template!r} is not allowed; choose one of {', '.join(map(repr, TEMPLATES))}")


def encode_prompt(tokenizer, text: str, template: str) -> tuple[str, list[int]]:
    """(templated text, token ids). A chat template writes its own special tokens, so they are not added
    twice; plain text and the simple chat format get the tokenizer's (e.g. <bos>)."""
    templated = apply_template(tokenizer, text, template)
    own_specials = template == "chat" and _has_chat_template(tokenizer)
    ids = tokenizer(templated, add_special_tokens=not own_specials)["input_ids"]
    return templated, list(ids)


def unknown_characters(tokenizer, text: str) -> list[str]:
    """The distinct pieces of `text`, in order, that `tokenizer` encodes as its unknown token (e.g. "é" for the
    character tokenizer); [] for a tokenizer without one (byte-level BPE encodes every character)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    fast = bool(getattr(tokenizer, "is_fast", False))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast)
    ids = list(enc["input_ids"])
    if unk not in ids:
        return []
    if fast:
        pieces = [text[a:b] for i, (a, b) in zip(ids, enc["offset_mapping"]) if i == unk]
    else:  # a slow tokenizer has no offsets: ask character by character
        pieces = [c for c in text if unk in tokenizer(c, add_special_tokens=False)["input_ids"]]
    return list(dict.fromkeys(p for p in pieces if p))


def encode_sft(tokenizer, example: Example) -> SFTExample:
    """The encoded prompt's ids + the SFT target's ids + eos, with the loss on the target and eos only. The target
    is `example.sft_target`: the worked solution when the task has one (scratchpad arithmetic), else the answer.

    The target is tokenized on its own (no special tokens); with the character tokenizer this equals
    tokenizing the concatenation. Raises ValueError if the tokenizer has no eos token.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("SFT examples need a tokenizer with an eos token (tokenizer.eos_token_id is None)")
    answer_ids = list(tokenizer(example.sft_target, add_special_tokens=False)["input_ids"]) + [eos]
    return SFTExample(input_ids=tuple(example.ids) + tuple(answer_ids),
                      loss_mask=(0,) * len(example.ids) + (1,) * len(answer_ids))


def sft_examples(tokenizer, examples: list[Example]) -> list[SFTExample]:
    """`encode_sft` over a list (e.g. the arithmetic train split) for the warm-start stage."""
    return [encode_sft(tokenizer, e) for e in examples]
