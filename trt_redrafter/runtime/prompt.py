"""The prompt phase on the device: a request's prompt (what is left of it after a reused prefix, chunk by chunk where
`prefill_chunk` says) through the base model, its first token, and its first tree from the device drafter.

The engine orchestrates it (`Engine._prefill`: which requests end their prompt this step, what their proposers do
with the first tree); this module builds the inputs and runs `DecodeStep.prefill_chunk`, `prefill` and
`draft_from_prompt`. The prompt step is eager: its length varies per request, and it runs once per request.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import AcceptanceRule, ReDrafterConfig
from .kv_cache import PagedKVCache
from .sequence import Draft, Sequence, TreeNodes
from .state import SlotState
from .step import DecodeStep


class PromptPhase:
    """Prompt steps of one engine's requests."""

    def __init__(self, steps: DecodeStep, cache: PagedKVCache, state: SlotState, tree: ReDrafterConfig,
                 vocab_size: int, device: torch.device):
        self.steps, self.cache, self.state, self.tree = steps, cache, state, tree
        self.vocab_size, self.device = vocab_size, device

    @staticmethod
    def ends(s: Sequence) -> bool:
        """Whether `s`'s next prompt step computes the rest of its prompt (else only its next chunk)."""
        return not s.prefill_chunk or s.prefix_len + s.prefill_chunk >= len(s.prompt) + len(s.output)

    def chunks(self, seqs: list[Sequence]) -> None:
        """The K/V of each request's next prompt chunk, `prefill_chunk` tokens from `prefix_len` on: no draw; the
        chunk's full blocks become reusable."""
        texts = [(s.prompt + s.output)[s.prefix_len:s.prefix_len + s.prefill_chunk] for s in seqs]
        slots, ids, lengths, start, prompt_len = self._inputs(seqs, texts)
        self.steps.prefill_chunk(slots, ids, lengths, start, max(s.prefix_len for s in seqs), prompt_len)
        for s, t in zip(seqs, texts):
            s.prefix_len += len(t)
            s.ctx_len = s.prefix_len
            self.cache.commit(s.seq_id, (s.prompt + s.output)[:s.prefix_len])

    def last(self, seqs: list[Sequence], rule: AcceptanceRule, logprobs: bool, grammar: Optional[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[Optional[list[int]]]]:
        """The prompt step that ends each request's prompt (its last chunk, or all of it) -> (slots, the last prompt
        token's hidden states, the first tokens, each one's log-probability columns or None); `grammar` [bs, words]:
        the first tokens' bitmasks."""
        texts = [s.prompt + s.output for s in seqs]
        slots, ids, lengths, start, prompt_len = self._inputs(seqs, [t[s.prefix_len:] for s, t in zip(seqs, texts)])
        h, cols = self.steps.prefill(slots, ids, lengths, rule, prompt_len, start, max(s.prefix_len for s in seqs),
                                     logprobs=logprobs, grammar=grammar.to(self.device) if grammar is not None else None)
        for s, t in zip(seqs, texts):  # its prompt's full blocks, reusable by requests that start alike
            self.cache.commit(s.seq_id, t)
        return slots, h, self.state.true_tok[slots].tolist(), cols.tolist() if cols is not None else [None] * len(seqs)

    def first_trees(self, slots: torch.Tensor, h: torch.Tensor, rule: AcceptanceRule, drafting: list[bool],
                    beams: list[bool]) -> tuple[dict[int, TreeNodes], dict[int, Draft]]:
        """The device drafter's first trees for the prompt step's rows that draft on the device (`drafting`) -> per
        row: the packed tree's nodes, and its beams where asked (`beams`: a proposer composes from them, a grammar
        masks the tree they make)."""
        rows = [i for i, d in enumerate(drafting) if d]
        if not rows:
            return {}, {}
        P, dev = self.tree.max_tree_tokens, self.device
        apple = rule is AcceptanceRule.APPLE
        if apple:
            self.state.ensure_draft_logp(self.vocab_size)
        idx = torch.tensor(rows, device=dev)
        packed = self.steps.draft_from_prompt(slots[idx], h[idx], apple).tolist()
        nodes = {i: TreeNodes.of_positions(row[1:1 + row[0]], row[1 + P:1 + P + row[0]], self.tree.beam_length)
                 for i, row in zip(rows, packed)}
        want = [i for i in rows if beams[i]]
        if not want:
            return nodes, {}
        w = slots[torch.tensor(want, device=dev)]  # read once, for the host
        flat = zip(self.state.beams[w].flatten(1).tolist(), self.state.scores[w].flatten(1).tolist())
        return nodes, {i: Draft.of_flat(b, sc, self.tree.num_beams) for i, (b, sc) in zip(want, flat)}

    def _inputs(self, seqs: list[Sequence], parts: list[list[int]]) -> tuple[torch.Tensor, ...]:
        """A prompt step's inputs on the device: the requests' slots, their `parts` (the tokens this step computes)
        right-padded [bs, T] with their lengths, the positions each already holds (`prefix_len`: a reused prefix,
        earlier chunks), and each prompt's length (< the text's after a preemption, for dynamic-NTK RoPE)."""
        ids = torch.zeros(len(parts), max(len(p) for p in parts), dtype=torch.long)
        for i, p in enumerate(parts):
            ids[i, :len(p)] = torch.tensor(p)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return (as_tensor([s.slot for s in seqs]), ids.to(self.device), as_tensor([len(p) for p in parts]),
                as_tensor([s.prefix_len for s in seqs]), as_tensor([len(s.prompt) for s in seqs]))
