"""Prompt templates and tokenization of prompts and of SFT (warm-start) sequences.

Templates (`data.template`):
- plain: the prompt text as is, encoded with the tokenizer's special tokens (the character
  tokenizer prepends <bos>).
- chat: the tokenizer's own chat template (one user turn, generation prompt added) when it has one;
  otherwise the simple format `SIMPLE_CHAT_FORMAT` = "q: {prompt}\\na: ", which stays inside the
  character tokenizer's alphabet.
- chat data (a JSONL record whose prompt is a list of `messages`, each {"role", "content"}): rendered by
  `render_messages` with the tokenizer's chat template, or `CHAR_CHAT_TEMPLATE` without one (user "q: ...",
  assistant "a: ...", tool "r: ...", one line each; the generation prompt "a: "), which renders one user message
  exactly as `SIMPLE_CHAT_FORMAT`. Multi-turn episodes show a tool's result as `tool_observation`.

Data is text: a prompt, a message's content and a tool's result are tokenized as text, so a special-token string in
them (the tokenizer's `<eos>`, a chat template's `<|im_end|>`) stays characters and never becomes the special id;
only the template's own text is read with its special tokens (`encode_pieces`). A Hugging Face tokenizer called on
the rendered string would read both alike (the injection of a turn end or an eos from data).

`tokenizer` is a Hugging Face tokenizer (e.g. `AutoTokenizer.from_pretrained(model_dir)`).
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from megatron_sparse_rl.data.types import Example, SFTExample

SIMPLE_CHAT_FORMAT = "q: {prompt}\na: "
TEMPLATES = ("plain", "chat")
CHAT_ROLES = ("system", "user", "assistant", "tool")
CHAR_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ 'q: ' + m['content'] + '\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ 'a: ' + m['content'] + '\\n' }}"
    "{%- elif m['role'] == 'tool' -%}{{ 'r: ' + m['content'] + '\\n' }}"
    "{%- else -%}{{ m['content'] + '\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'a: ' }}{%- endif -%}")
"""The chat template of tokenizers without one (the built-in character tokenizer): one line per message, roles
written "q:", "a:", "r:" (tool), a system message as it is; all inside the character tokenizer's alphabet."""


class ChatTemplateError(ValueError):
    """The chat template failed on a conversation (it raised, the sandbox stopped it, or it does not render a message
    as a continuation of the conversation before it); the message says which."""


Piece = tuple[str, bool]
"""A run of rendered text and whether it is data (a prompt, a message's content, a tool's result: tokenized as text)
rather than the template's own text (read with its special tokens)."""
_MARK = re.compile("\ue000(\\d+)\ue001")  # private-use characters: a content's place in a rendering


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def special_strings(tokenizer) -> tuple[str, ...]:
    """The strings `tokenizer` reads as one special token wherever they occur in text (its added tokens marked
    special: "<eos>", "<|im_end|>", ...)."""
    return tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)


def _special_in_data(pieces: Sequence[Piece], specials: Sequence[str]) -> bool:
    """Whether a special-token string occurs in the joined text overlapping a data piece (also across its edges)."""
    text, spans, at = "".join(t for t, _ in pieces), [], 0
    for t, data in pieces:
        if data and t:
            spans.append((at, at + len(t)))
        at += len(t)
    for s in specials:
        k = text.find(s)
        while k >= 0:
            if any(k < end and start < k + len(s) for start, end in spans):
                return True
            k = text.find(s, k + 1)
    return False


def _added_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids `tokenizer` adds before and after a text with add_special_tokens (e.g. [<bos>], [])."""
    bare = list(tokenizer("0", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("0", add_special_tokens=True)["input_ids"])
    for k in range(len(full) - len(bare) + 1):
        if full[k:k + len(bare)] == bare:
            return full[:k], full[k + len(bare):]
    raise ValueError("the tokenizer's special tokens do not surround the text they are added to")


def encode_pieces(tokenizer, pieces: Sequence[Piece], *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of the joined `pieces`, a data piece's text never read as a special token.

    When no special-token string touches a data piece, the joined text is encoded whole (the ids are those of
    `tokenizer(text)`); otherwise each piece is encoded on its own, data with `split_special_tokens` (its "<eos>" is
    the characters < e o s >), the template's text with its special tokens, and `add_special_tokens` puts the
    tokenizer's own around the whole."""
    if not _special_in_data(pieces, special_strings(tokenizer)):
        return list(tokenizer("".join(t for t, _ in pieces), add_special_tokens=add_special_tokens)["input_ids"])
    ids = [i for t, data in pieces if t
           for i in tokenizer(t, add_special_tokens=False, split_special_tokens=data)["input_ids"]]
    if not add_special_tokens:
        return ids
    before, after = _added_around(tokenizer)
    return before + ids + after


def render_pieces(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True) -> list[Piece]:
    """`render_messages` as pieces: the template's text and each message's content in order. Only computed when a
    content holds a special-token string (else one template piece: `encode_pieces` then encodes it whole, as it
    would anyway); ValueError when the template does not render each content once, in order and unchanged (it could
    not be told apart from the template's text)."""
    text = render_messages(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    specials = special_strings(tokenizer)
    if not any(s in m["content"] for m in messages for s in specials):
        return [(text, False)]
    marked = render_messages(tokenizer, [dict(m, content=f"\ue000{k}\ue001") for k, m in enumerate(messages)],
                             add_generation_prompt=add_generation_prompt)
    parts = _MARK.split(marked)  # template, index, template, index, ..., template
    pieces = [(parts[0], False)]
    for k, after in enumerate(parts[2::2]):
        pieces += [(messages[k]["content"] if k < len(messages) else "", True), (after, False)]
    if parts[1::2] != [str(k) for k in range(len(messages))] or "".join(t for t, _ in pieces) != text:
        raise ChatTemplateError("a message holds a special-token string, and the chat template does not render every "
                         "message's content once, in order and unchanged, so the content cannot be told from the "
                         "template's own text to be tokenized as text")
    return pieces


def _drop(pieces: Sequence[Piece], n: int) -> list[Piece]:
    """`pieces` less their first `n` characters."""
    out = []
    for t, data in pieces:
        cut = min(n, len(t))
        n -= cut
        if t[cut:]:
            out.append((t[cut:], data))
    return out


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


def render_messages(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
    """`messages` ([{"role", "content"}, ...]) as text: the tokenizer's chat template, or `CHAR_CHAT_TEMPLATE`.
    `ChatTemplateError` when the template fails (it is the model's code: whatever it raises is reported as that)."""
    own = _has_chat_template(tokenizer)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **({} if own else {"chat_template": CHAR_CHAT_TEMPLATE}))
    except Exception as e:  # jinja2's SecurityError and TemplateError, and whatever else the template's code raises
        detail = str(e).strip().split("\n")[0][:300]
        raise ChatTemplateError(f"the chat template raised {type(e).__name__}: {detail} (rendering "
                                f"{', '.join(str(m.get('role')) for m in messages)})") from None


def encode_messages(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """(rendered text with the generation prompt, token ids). The tokenizer's own template writes its special tokens;
    `CHAR_CHAT_TEMPLATE` gets the tokenizer's (<bos>), as the simple chat format does."""
    pieces = render_pieces(tokenizer, messages)
    ids = encode_pieces(tokenizer, pieces, add_special_tokens=not _has_chat_template(tokenizer))
    return "".join(t for t, _ in pieces), ids


def encode_demo(tokenizer, prompt: tuple[tuple[str, str], ...], demo: tuple[tuple[str, str], ...]
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ids, loss mask) of a demonstrated episode after `prompt` (both (role, content) pairs), as an episode lays
    it out: each message's tokens are what the chat template adds for it (an assistant turn after the generation
    prompt, through its line end: mask 1; a tool result with the next generation prompt: mask 0), each piece
    encoded on its own without special tokens, as the episode runner appends them."""
    def pieces(messages, generation: bool) -> list[Piece]:
        return render_pieces(tokenizer, [{"role": r, "content": c} for r, c in messages],
                             add_generation_prompt=generation)

    ids, mask, done = [], [], tuple(prompt)
    for k, message in enumerate(demo):
        model = message[0] == "assistant"
        before = "".join(t for t, _ in pieces(done, generation=model))
        after = pieces(done + (message,), generation=not model and k + 1 < len(demo))
        if not "".join(t for t, _ in after).startswith(before):
            raise ChatTemplateError(f"the chat template does not render message {k} of the demonstration as a "
                             "continuation of the conversation before it")
        piece = encode_pieces(tokenizer, _drop(after, len(before)))
        ids += piece
        mask += [int(model)] * len(piece)
        done += (message,)
    return tuple(ids), tuple(mask)


def tool_observation(tokenizer, result: str) -> str:
    """The text a tool's `result` adds after a model turn: the chat template's tool message, then the generation
    prompt (the difference between rendering [user, assistant] and [user, assistant, tool] + generation prompt).
    ValueError when the template does not render the longer conversation as a continuation of the shorter."""
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = render_messages(tokenizer, head, add_generation_prompt=False)
    after = render_messages(tokenizer, head + [{"role": "tool", "content": result}])
    if not after.startswith(before):
        raise ChatTemplateError("the tokenizer's chat template does not render a tool message as a continuation of the "
                         "conversation before it; multi-turn episodes need one that does")
    return after[len(before):]


def encode_prompt(tokenizer, text: str, template: str) -> tuple[str, list[int]]:
    """(templated text, token ids). A chat template writes its own special tokens, so they are not added
    twice; plain text and the simple chat format get the tokenizer's (e.g. <bos>)."""
    own_specials = template == "chat" and _has_chat_template(tokenizer)
    if own_specials:
        pieces = render_pieces(tokenizer, [{"role": "user", "content": text}])
    elif template == "chat":
        head, tail = SIMPLE_CHAT_FORMAT.split("{prompt}")
        pieces = [(head, False), (text, True), (tail, False)]
    else:
        apply_template(tokenizer, text, template)  # refuses an unknown template
        pieces = [(text, True)]
    return "".join(t for t, _ in pieces), encode_pieces(tokenizer, pieces, add_special_tokens=not own_specials)


def unknown_characters(tokenizer, text: str) -> list[str]:
    """The distinct pieces of `text`, in order, that `tokenizer` encodes as its unknown token (e.g. "é" for the
    character tokenizer); [] for a tokenizer without one (byte-level BPE encodes every character)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    fast = bool(getattr(tokenizer, "is_fast", False))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast, split_special_tokens=True)
    ids = list(enc["input_ids"])
    if unk not in ids:
        return []
    if fast:
        pieces = [text[a:b] for i, (a, b) in zip(ids, enc["offset_mapping"]) if i == unk]
    else:  # a slow tokenizer has no offsets: ask character by character
        pieces = [c for c in text
                  if unk in tokenizer(c, add_special_tokens=False, split_special_tokens=True)["input_ids"]]
    return list(dict.fromkeys(p for p in pieces if p))


def encode_sft(tokenizer, example: Example) -> SFTExample:
    """The encoded prompt's ids + the SFT target's ids + eos, with the loss on the target and eos only. The target
    is `example.sft_target`: the worked solution when the task has one (scratchpad arithmetic), else the answer.
    Chat data with a demonstrated episode (`example.demo_ids`): the prompt's ids + the episode's, the loss on its
    assistant turns only (`example.demo_mask`).

    The target is tokenized on its own, as text (no special tokens added or read from it); with the character
    tokenizer this equals tokenizing the concatenation. Raises ValueError if the tokenizer has no eos token.
    """
    if example.demo_ids:  # a demonstrated episode: its assistant turns are the target (they end at the turn stop)
        return SFTExample(input_ids=tuple(example.ids) + example.demo_ids,
                          loss_mask=(0,) * len(example.ids) + example.demo_mask)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("SFT examples need a tokenizer with an eos token (tokenizer.eos_token_id is None)")
    answer_ids = list(tokenizer(example.sft_target, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    answer_ids.append(eos)
    return SFTExample(input_ids=tuple(example.ids) + tuple(answer_ids),
                      loss_mask=(0,) * len(example.ids) + (1,) * len(answer_ids))


def sft_examples(tokenizer, examples: list[Example]) -> list[SFTExample]:
    """`encode_sft` over a list (e.g. the arithmetic train split) for the warm-start stage."""
    return [encode_sft(tokenizer, e) for e in examples]
