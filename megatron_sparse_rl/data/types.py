"""The records the data pipeline passes around: a raw `Prompt`, and its templated, tokenized form."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prompt:
    """One verifiable problem: the prompt text (before templating) and its reference answer."""

    text: str
    """The problem as the dataset holds it, e.g. "12+7="."""
    answer: str
    """The reference answer the reward compares against, e.g. "19"."""
    difficulty: int = 0
    """Difficulty level (arithmetic: digits of the longer operand); 0 when the dataset has none."""
    source: str = ""
    """Where it came from, for error messages: "file.jsonl:12" or "arithmetic"."""
    solution: str = ""
    """The full reference response the SFT warm start trains on when it is more than the answer (the scratchpad
    arithmetic task's worked columns, ending with the answer); '' = the answer itself."""
    messages: tuple[tuple[str, str], ...] = ()
    """Chat data: the conversation before the model's first turn as (role, content) pairs, rendered with the chat
    template (data.template chat); `text` then holds the contents one per line, for error messages. () = the prompt
    is `text`."""
    demo: tuple[tuple[str, str], ...] = ()
    """Chat data: the record's messages from the first assistant message on (assistant turns and tool results), a
    demonstrated episode the SFT warm start trains on (the assistant turns only); () = none."""


@dataclass(frozen=True, slots=True)
class Example:
    """A prompt after the template and the tokenizer: what the trainer samples from and scores."""

    prompt: str
    """The templated prompt text (e.g. "12+7=" plain, "q: 12+7=\na: " simple chat)."""
    answer: str
    """The reference answer."""
    ids: tuple[int, ...]
    """Token ids of `prompt`, special tokens included (use these: re-encoding a chat-templated text with
    special tokens would add <bos> twice)."""
    difficulty: int = 0
    """Difficulty level of the raw prompt (0 when unknown)."""
    source: str = ""
    """Where the raw prompt came from ("file.jsonl:12", "arithmetic")."""
    solution: str = ""
    """The raw prompt's full reference response for SFT ('' = the answer itself)."""
    demo_ids: tuple[int, ...] = ()
    """A demonstrated episode after the prompt (`Prompt.demo` rendered by the chat template), what the SFT warm
    start trains on instead of the answer; () = none."""
    demo_mask: tuple[int, ...] = ()
    """One per `demo_ids`: 1 on the assistant turns' tokens (trained), 0 on tool results and chat markup."""

    @property
    def sft_target(self) -> str:
        """What the SFT warm start trains the model to emit (before <eos>): the solution, else the answer."""
        return self.solution or self.answer


@dataclass(frozen=True, slots=True)
class SFTExample:
    """A supervised warm-start sequence: templated prompt, then the SFT target (`Example.sft_target`), then <eos>."""

    input_ids: tuple[int, ...]
    """Prompt ids followed by the target's ids and the eos id."""
    loss_mask: tuple[int, ...]
    """Same length as input_ids: 1 where the token is a target (SFT target and eos), 0 on the prompt.
    The mask over next-token targets [S-1] that `learner.sft.make_sft_loss` takes is `loss_mask[1:]`."""
