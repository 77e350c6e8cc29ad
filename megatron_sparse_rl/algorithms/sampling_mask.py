"""Keep-sampling-mask (DeepSeek-V3.2, arXiv 2512.02556): renormalise a policy over the token ids that
survived top-p/top-k when the rollout was sampled, so pi_theta, pi_old and mu share one support.

The recorded set per position is either a bool mask [..., vocab] or a padded id tensor [..., k] with
-1 as padding. A position with an empty set (padding, or no record) uses the full vocabulary, so
padded positions stay finite. A chosen token outside its non-empty set gets -inf: the record and
the sampled ids disagree, which callers should treat as a data error.
"""
from __future__ import annotations

import torch


def keep_set_to_mask(keep: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bool mask [..., vocab] from either a bool mask or a -1-padded id tensor [..., k]."""
    if keep.dtype == torch.bool:
        if keep.shape[-1] != vocab_size:
            raise ValueError(f"keep mask has {keep.shape[-1]} entries in its last dim, vocab is {vocab_size}")
        return keep
    ids = keep.long()
    valid = ids >= 0
    mask = torch.zeros(*ids.shape[:-1], vocab_size + 1, dtype=torch.bool, device=ids.device)
    # padding ids go to the extra column vocab_size, dropped below
    mask.scatter_(-1, torch.where(valid, ids, torch.full_like(ids, vocab_size)), True)
    return mask[..., :vocab_size]


def masked_log_softmax(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """log_softmax of `logits` [..., vocab] restricted to the kept ids (-inf elsewhere)."""
    mask = keep_set_to_mask(keep, logits.shape[-1])
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    return logits.masked_fill(~mask, float("-inf")).log_softmax(dim=-1)


def masked_token_logprobs(logits: torch.Tensor, keep: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log pi(token | kept set) [...] for the chosen `token_ids` [...] under the renormalised softmax."""
    logp = masked_log_softmax(logits, keep)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
