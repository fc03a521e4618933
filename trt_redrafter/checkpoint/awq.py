"""AWQ's activation-aware scales for `convert --quantize int4_awq`: per linear layer, the input-channel scale s that
makes int4 group quantization lose least on calibration activations (Lin et al., "AWQ", 2023; ModelOpt's `awq_lite`
searches the same grid).

For a layer y = x W^T fed by calibration inputs X, with m = mean |X| per input channel:
    s(alpha) = m^alpha / sqrt(max m^alpha * min m^alpha),  alpha in 0, 0.1, ..., 0.9
    error(alpha) = || X W^T - (X / s) Q(W s)^T ||^2       (Q: int4 per group of inputs, `quantization.quantize_groups`)
The alpha of least error wins; alpha = 0 is s = 1, plain round-to-nearest, so the search never does worse than it on
the calibration set. Layers that read one input (q, k, v; gate and up) share one s, summed errors deciding, as
TensorRT-LLM fuses them. The checkpoint then stores Q(W s) and `prequant_scaling_factor` = 1 / s, by which the
runtime multiplies the input (`quantization.awq_tensors`).

The activations come from the float model (Hugging Face's, fp32) run over the calibration prompts in the model's
chat template; at most `MAX_ROWS` token rows per layer are kept (checkpoint/calibration.py `awq_scales`).
"""

from __future__ import annotations

import torch

from .quantization import dequantize_groups, quantize_groups

ALPHAS = tuple(i / 10 for i in range(10))
MAX_ROWS = 1024


def _dequant(w: torch.Tensor, group_size: int) -> torch.Tensor:
    return dequantize_groups(*quantize_groups(w, group_size), group_size)


def best_scale(x: torch.Tensor, weights: list[torch.Tensor], group_size: int) -> tuple[torch.Tensor, float]:
    """Calibration inputs x [n, in] and the float weights [out, in] reading them -> (s [in], the chosen alpha)."""
    x = x.float()
    m = x.abs().mean(dim=0).clamp(min=1e-6)
    refs = [x @ w.float().T for w in weights]
    best = (float("inf"), torch.ones_like(m), 0.0)
    for alpha in ALPHAS:
        s = m.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        xs = x / s
        err = sum(float(((xs @ _dequant(w.float() * s, group_size).T) - ref).pow(2).sum())
                  for w, ref in zip(weights, refs))
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]
