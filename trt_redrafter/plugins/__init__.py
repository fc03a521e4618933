"""Custom kernels (OpenAI Triton) for the decode step on CUDA. Each has its PyTorch oracle in `decoding/` or
`model/`, asserts its inputs' rank, dtype and contiguity, and is tested against the oracle on CPU under Triton's
interpreter (TRITON_INTERPRET=1) and on CUDA at realistic shapes (tests/test_plugins.py, tests/test_gpu.py).

    tree_attention  verify attention over the paged KV cache       oracle: model.attention.torch_tree_attention
    beam_step       one drafter beam-search selection              oracle: decoding.beam_search.select_beams
    pack_beams      beams -> packed tree (dedup, ranks, mask)      oracle: decoding.tree.pack_beams
    accept_tokens   longest matching drafted prefix, best beam     oracle: decoding.acceptance.accept_tokens
    draw            counter-based draw (exponential race)          oracle: decoding.sampling.draw
    KVMover         the KV rewind, all layers in one launch        oracle: runtime.step.move_kv
    fused           add+RMSNorm, RoPE+KV write, SiLU*up            oracle: model.llama.TorchLayerOps
    weight_only     int8 / int4 weight-only GEMM                   oracle: model.linear.QuantWeight.dequantize

Importing this package needs `triton`; the engine imports it only on CUDA (RuntimeConfig.kernels), so CPU
installs never need it.
"""

from . import fused, weight_only
from .accept import accept_tokens, draw
from .beam_step import beam_step
from .kv_rewind import KVMover
from .tree_attention import tree_attention
from .tree_pack import pack_beams

__all__ = ["KVMover", "accept_tokens", "beam_step", "draw", "fused", "pack_beams", "tree_attention", "weight_only"]
