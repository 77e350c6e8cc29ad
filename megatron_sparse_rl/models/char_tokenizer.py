"""Character-level tokenizer for the synthetic arithmetic task, built locally (no model hub).

One token per character: digits, arithmetic operators, space, newline, a little punctuation and the
lowercase letters (enough for prompts like "q: 12+7=?\na: 19"), plus the special tokens <pad>, <bos>,
<eos>, <unk> and reserved ids that pad the vocabulary to `VOCAB_SIZE` (a multiple of 64, which keeps
vocab-parallel sharding of the embedding simple). Encoding prepends <bos> (add_special_tokens=True).

It is saved as a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json) that
`transformers.AutoTokenizer` and vLLM load as a fast tokenizer.

Build one by hand:
    python -c "from megatron_sparse_rl.models.char_tokenizer import build_tokenizer; print(build_tokenizer('/tmp/tok'))"
"""
from __future__ import annotations

import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
# Order fixes the ids: specials 0-3, then characters, then reserved tokens up to VOCAB_SIZE.
CHARACTERS: tuple[str, ...] = tuple(string.digits + "+-*/=" + " \n:?.,()" + string.ascii_lowercase)
VOCAB_SIZE = 64
RESERVED_TOKENS: tuple[str, ...] = tuple(
    f"<reserved_{i}>" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(CHARACTERS))
)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
MODEL_MAX_LENGTH = 4096


def vocab_size() -> int:
    """Number of token ids (specials + characters + reserved); the model's vocab_size."""
    return VOCAB_SIZE


def _vocab() -> dict[str, int]:
    tokens = SPECIAL_TOKENS + CHARACTERS + RESERVED_TOKENS
    if len(tokens) != VOCAB_SIZE or len(set(tokens)) != VOCAB_SIZE:
        raise AssertionError(f"tokenizer vocabulary must hold {VOCAB_SIZE} distinct tokens (got {len(tokens)})")
    return {tok: i for i, tok in enumerate(tokens)}


def _backend():
    """The `tokenizers.Tokenizer`: BPE without merges (= one token per character), fused on decode."""
    from tokenizers import Tokenizer, decoders, models, processors

    vocab = _vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(list(SPECIAL_TOKENS + RESERVED_TOKENS))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def character_tokenizer():
    """The tokenizer as a `transformers.PreTrainedTokenizerFast`, in memory (nothing written)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_backend(),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(out_dir: str | Path) -> Path:
    """Write the tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map) into `out_dir`.

    Returns `out_dir` as a Path. The directory is created if missing; existing tokenizer files are
    overwritten. Loadable with `AutoTokenizer.from_pretrained(out_dir)` and by vLLM.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    character_tokenizer().save_pretrained(str(out))
    return out
