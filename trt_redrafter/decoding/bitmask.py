"""Token bitmasks: which tokens a grammar allows at a position, 32 tokens per int32 word (xgrammar's layout: token t
is bit t % 32 of word t // 32). The host fills them (runtime/grammar.py); the step applies them to the logits
before anything chooses a token, so a constrained step is the unconstrained one over masked logits.

Plain tensor code with static shapes, so it compiles into the step (xgrammar's own `apply_token_bitmask_inplace`
is a custom kernel that torch.compile would break the graph at).
"""

from __future__ import annotations

import torch

WORD_BITS = 32


def words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return -(-vocab_size // WORD_BITS)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [..., words] int32 -> [..., vocab_size] bool."""
    shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 of a negative word is still 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with every token the mask disallows at -inf (out of place)."""
    return logits.masked_fill(~allowed(bitmask, logits.shape[-1]), float("-inf"))


def full(*shape: int) -> torch.Tensor:
    """int32 bitmasks of `shape` (the last dimension: words per row) allowing every token."""
    return torch.full(shape, -1, dtype=torch.int32)
