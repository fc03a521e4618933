"""ReDrafter decoding math, model-free: drafter beam search, beams -> packed tree, sampling, acceptance.

One engine step (DESIGN.md, "The decoding step"): verify the packed tree with the base model -> `acceptance`
(choose beam, accepted count, next token) -> rewind KV along `tree.path_packed_indices` -> `beam_search.beam_search`
from the hidden state at the last accepted position and the next token -> `tree.pack_beams` for the next verify.
Terms (bs, nb, dl, bl = dl + 1, V, H) are defined in `trt_redrafter.config`; see docs/decoding.md.

The submodules are the API (`decoding.beam_search.beam_search`, `decoding.tree.pack_beams`, ...); the package
re-exports their types and functions except `beam_search`, whose name is the submodule's.
"""

from . import acceptance, beam_search, sampling, tree
from .acceptance import Acceptance, accept_apple, accept_exact, accept_greedy, accept_tokens, emitted_tokens
from .beam_search import BeamSearchResult, DrafterProtocol
from .sampling import draw, process_logits
from .tree import PackedTree, dedup_prefix, pack_beams, path_packed_indices, unpack

__all__ = [
    "acceptance", "beam_search", "sampling", "tree",
    "Acceptance", "accept_apple", "accept_exact", "accept_greedy", "accept_tokens", "emitted_tokens",
    "BeamSearchResult", "DrafterProtocol",
    "process_logits", "draw",
    "PackedTree", "dedup_prefix", "pack_beams", "path_packed_indices", "unpack",
]
