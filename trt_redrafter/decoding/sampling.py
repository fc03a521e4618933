"""Target-model sampling: logits -> processed probabilities -> one token per row, with no host sync.

`process_logits` applies, in Hugging Face `generate`'s order and with its definitions, temperature
(`TemperatureLogitsWarper`), top-k (`TopKLogitsWarper`: drop tokens scoring below the k-th best, ties at the k-th
kept) and top-p (`TopPLogitsWarper`: sort ascending, drop the low tail whose cumulative mass is <= 1 - p, always
keeping the most likely token), then renormalizes. It is one sort per row and no data-dependent branch, so it runs
inside a compiled step or a CUDA graph.

Randomness is counter-based: the noise for a draw is a hash of (request seed, sequence position of the token being
drawn, vocabulary index), not the state of a generator. Consequences:
  * a request's tokens do not depend on which requests share its batch, on TP size, or on the step layout;
  * `draw` is the exponential race (Gumbel-max): token = argmax_v p_v / E_v with E_v ~ Exp(1), which is a draw from
    p; the same noise at the same position gives the same token, so ReDrafter with `exact` acceptance emits, for a
    given seed, the very tokens AR sampling emits (it draws every tree node at the node's own position);
  * it is cheap to generate for [rows, V] inside one fused kernel.
The hash is `lowbias32` (Chris Wellons' hash-prospector), computed in int64 with every product kept below 2**63
so the same bits come out of eager PyTorch, inductor's C++/Triton code and the Triton kernels in `plugins/`.
"""

from __future__ import annotations

import torch

GREEDY_TEMPERATURE = 0.0  # a row with this temperature gets a one-hot argmax distribution
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # Weyl increment between vocabulary indices
# Stream ids keep the noise of different uses independent.
STREAM_TOKEN = 0x1B873593  # the draw of an emitted token
STREAM_APPLE_U = 0x5BD1E995  # `apple` acceptance's uniform per (beam, depth)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without overflowing int64."""
    lo = x * (c & 0xFFFF)  # < 2**48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # only the low 16 bits of the high product survive mod 2**32
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """Per-row 32-bit keys [N] from seeds [N] and positions [N] (int64)."""
    k = mix32((seed & _M32) ^ stream)
    k = mix32((k + ((seed >> 32) & _M32)) & _M32)
    return mix32(k ^ (position & _M32))


def uniform(keys: torch.Tensor, width: int) -> torch.Tensor:
    """keys [N] -> uniforms [N, width] float32 in [2**-24, 1 - 2**-24], one per (row, column).

    23 random bits: (k + 0.5) / 2**23 is exact in float32, so u never rounds to 1 (where -log u would be 0).
    """
    col = torch.arange(width, device=keys.device, dtype=torch.int64) * _GOLDEN  # [width]
    h = mix32((keys[:, None] + col[None, :]) & _M32)  # [N, width]
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def draw(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [N, V] (rows need not be normalized), drawn with the noise of (seed, position).

    seed, position: [N] int64; `position` is the sequence position of the token being drawn.
    """
    assert probs.dim() == 2 and seed.shape == position.shape == probs.shape[:1], \
        f"probs must be [N, V] with seed/position [N], got {tuple(probs.shape)}, {tuple(seed.shape)}, {tuple(position.shape)}"
    u = uniform(row_keys(seed, position, STREAM_TOKEN), probs.shape[1])  # [N, V]
    race = probs.float() / -torch.log(u)  # p / Exp(1)
    return race.argmax(dim=-1)


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] float32, per row: temperature, then top-k (0: off), then top-p (1: off).

    Rows with temperature 0 get the one-hot distribution of their (first) argmax. No host sync.
    """
    assert logits.dim() == 2, f"logits must be [N, V], got shape {tuple(logits.shape)}"
    N, V = logits.shape
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        assert t.shape == (N,), f"{name} must be [N]=[{N}], got shape {tuple(t.shape)}"
    dev = logits.device
    scores = logits.float()  # [N, V]
    greedy = (temperature <= GREEDY_TEMPERATURE).to(dev)  # [N]
    scores = scores / torch.where(greedy, 1.0, temperature.float().to(dev))[:, None]

    asc, order = scores.sort(dim=-1)  # [N, V] ascending, as HF's top-p sorts
    k = top_k.to(device=dev, dtype=torch.long)
    kth = asc.gather(1, (V - k.clamp(1, V))[:, None])  # [N, 1] the k-th largest
    keep_k = (k <= 0)[:, None] | (asc >= kth)  # ties with the k-th are kept
    asc = asc.masked_fill(~keep_k, float("-inf"))
    cum = asc.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
    drop = (cum <= (1.0 - top_p.float().to(dev))[:, None]) & (top_p < 1.0).to(dev)[:, None]
    drop[:, -1] = False  # the most likely token always stays
    asc = asc.masked_fill(drop, float("-inf"))
    probs = torch.empty_like(asc).scatter_(1, order, asc.softmax(dim=-1))  # back to vocabulary order

    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)
