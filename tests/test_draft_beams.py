"""Drafting fewer beams (`--draft-beams`, and the speculation policy's choice of a beam count per drafting step): a
k-beam search fills the tree's other beam slots with copies of beam 0, which packing dedups, so the tree is the k-beam
search's own; the output stays AR's at every count, eager, compiled (one graph for every count: test_compiled) and at
TP 2 (test_tp);
the policy drafts fewer beams where the trees' other beams are not worth their drafting, and every beam where they
are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_utils import SMALL, build_small_engine, load_engine, record_tree_steps
from trt_redrafter.config import RuntimeConfig, SamplingConfig, Speculation
from trt_redrafter.decoding import tree
from trt_redrafter.decoding.beam_search import beam_search, select_beams_topk
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.calibration import Calibration
from trt_redrafter.runtime.costs import CostModel
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.graphs import beam_buckets, tree_buckets
from trt_redrafter.runtime.policy import BEAM_EXPLORE, Candidate, Phase, Policy, PolicyState, StepCosts, decide
from trt_redrafter.runtime.step import SCORE_SCALE

needs_small = pytest.mark.skipif(not (SMALL / "drafter" / "model.safetensors").is_file(),
                                 reason="models/small not trained")
PROMPTS = ["def dedent(text):\n    \"\"\"Remove any common leading whitespace from every line in `text`.\n",
           "class Fraction(numbers.Rational):\n", "def heappush(heap, item):\n"]


def q(p: float) -> int:
    import math
    return round(math.log(p) * SCORE_SCALE)


# ---- the tree of fewer beams ---------------------------------------------------------------------------------------

class _Drafter:
    """A random recurrent drafter over a small vocabulary (the beam search's protocol)."""

    def __init__(self, H=16, V=40, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.w, self.u = torch.randn(H, H, generator=g) / 4, torch.randn(H, H, generator=g) / 4
        self.head, self.emb = torch.randn(V, 2 * H, generator=g), torch.randn(V, H, generator=g)

    def init_state(self, n):
        return torch.zeros(n, self.w.shape[0])

    def update_state(self, emb, state, step):
        return torch.nn.functional.silu(emb @ self.w.T + state @ self.u.T)

    def logits(self, h, state):
        return torch.cat([h, state], -1) @ self.head.T


def test_beam_buckets():
    assert beam_buckets(1) == [1] and beam_buckets(4) == [1, 2, 4] and beam_buckets(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_k_beam_search_padded_with_copies_of_beam_0_packs_to_its_own_tree(k):
    """The step's padding (`DecodeStep._propose`) against packing the k beams alone: the same nodes, numbered the
    same, bit for bit; and the lowest beam through every node is below k (what the policy reads back)."""
    d = _Drafter()
    h, tok = torch.randn(5, 16, generator=torch.Generator().manual_seed(1)), torch.arange(5) + 3
    nb, bl = 4, 4
    own = beam_search(d, lambda i: d.emb[i], h, tok, k, bl - 1, warp_top_k=None, keep_log_probs=False,
                      select=select_beams_topk)
    fill = torch.where(torch.arange(nb) < k, torch.arange(nb), 0)
    padded = own.beams.index_select(1, fill)
    P = 1 + nb * (bl - 1)
    a, b = tree.pack_beams(padded, pad_to=P), tree.pack_beams(own.beams, pad_to=P)
    assert torch.equal(a.lengths, b.lengths)
    for name in ("tokens", "position_offsets", "beam_positions", "mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x, y) if name != "beam_positions" else torch.equal(x % bl, y % bl), name
    assert torch.equal(a.beam_positions, b.beam_positions)  # beam i * bl + j: the same beams, the same positions
    valid = torch.arange(P)[None] < a.lengths[:, None]
    assert (a.beam_positions[valid] // bl).max() == k - 1  # every beam of the search has a node of its own
    assert torch.equal(a.lengths, 1 + torch.tensor([len({tuple(r[1:j + 1].tolist()) for r in own.beams[i]
                                                         for j in range(1, bl)}) for i in range(5)]))


# ---- the policy's beam count ---------------------------------------------------------------------------------------

def beam_costs(ar=10.0, per_node=0.2, draft_per_beam=0.6, P=13) -> CostModel:
    """A tree step costs the AR step, drafting (per beam searched) and a little per verified node."""
    batches, widths, beams = [1, 2, 4], tree_buckets(P), [1, 2, 4]
    row_ar = [ar] * 3
    tree_ = [[ar + draft_per_beam * 4 * b + per_node * w * b for w in widths] for b in batches]
    draft = [[ar + draft_per_beam * k * b + per_node * b for k in beams] for b in batches]
    return CostModel(batches, widths, [100, 1100], [row_ar, row_ar], [tree_, tree_], beams=beams, draft=[draft, draft])


def tree_of(per_beam: list[list[float]]) -> tuple[list[int], list[int]]:
    """A tree of chains, one per beam (probabilities of each beam's nodes, root excluded) -> (scores best first,
    the beam of each node), as the step returns them."""
    nodes = sorted(((q(p), b) for b, chain in enumerate(per_beam) for p in chain), key=lambda x: -x[0])
    return [0] + [s for s, _ in nodes], [0] + [b for _, b in nodes]


def speculating(beams_at_hand: int = 4) -> PolicyState:
    return PolicyState(phase=Phase.SPECULATING, mean_gain=2.0, mean_cost=1.2, mean_batch=1)


def decide_beams(per_beam, state=None, costs=None):
    scores, beams = tree_of(per_beam)
    c = Candidate(0, True, scores, Calibration(), context=100, beams=beams)
    return decide(state or speculating(), [c], True, StepCosts(costs or beam_costs()), tree_buckets(13), None,
                  [1, 2, 4])


def test_trees_whose_other_beams_are_never_right_are_drafted_with_one_beam():
    """Beam 0 a sure chain, the other beams' nodes hopeless: drafting them costs, and they earn nothing."""
    d, _ = decide_beams([[0.9, 0.8, 0.7], [0.01, 0.005, 0.001], [0.01, 0.002, 0.001], [0.005, 0.001, 0.001]])
    assert d.is_tree and d.draft and d.beams == 1


def test_trees_right_on_every_beam_are_drafted_with_every_beam():
    """An oracle-like drafter: every beam's nodes likely (a branchy continuation): every beam pays."""
    d, _ = decide_beams([[0.9, 0.85, 0.8], [0.9, 0.85, 0.8], [0.85, 0.8, 0.75], [0.85, 0.8, 0.75]])
    assert d.is_tree and d.draft and d.beams == 4


def test_every_beam_is_drafted_again_after_a_run_with_fewer():
    """Trees of one beam, whatever they earn, say nothing of what more beams would find: after BEAM_EXPLORE drafting
    steps with fewer beams, one drafts every beam, and the choice is made again on its whole trees."""
    one = [[0.95, 0.95, 0.95]]
    state = speculating()
    for i in range(BEAM_EXPLORE):
        d, state = decide_beams(one, state)
        assert d.beams == 1, i
    d, state = decide_beams(one, state)
    assert d.beams == 4 and state.beam_hold == 0
    d, state = decide_beams([[0.9, 0.8, 0.7], [0.01], [0.01], [0.01]], state)  # its whole trees: one beam again
    assert d.beams == 1


def test_fixed_draft_beams_are_drafted_every_step():
    policy = Policy(Speculation.parse("3"), 13, None, [2])
    scores, beams = tree_of([[0.9], [0.9]])
    d = policy.decide([Candidate(0, True, scores, Calibration(), beams=beams)], True)
    assert d.width == 3 and d.beams == 2


def test_the_cost_model_charges_a_step_what_its_beams_cost():
    costs = beam_costs()
    full = costs.tree_ms(2, 5, 100)
    assert costs.tree_ms(2, 5, 100, 4) == full
    assert costs.tree_ms(2, 5, 100, 1) == pytest.approx(full - 0.6 * 3 * 2)
    old = CostModel.from_dict({k: v for k, v in costs.to_dict().items() if k not in ("beams", "draft")})
    assert old.tree_ms(2, 5, 100, 1) == full  # a model measured without beam counts charges every beam


# ---- engines -------------------------------------------------------------------------------------------------------

def small_4x4(root: Path, **runtime) -> tuple[Path, list[list[int]], list[list[int]]]:
    """models/small's 4 x 4 engine under `root`, PROMPTS tokenized, and their greedy AR outputs (40 tokens) from an
    engine loaded with `runtime`."""
    from transformers import AutoTokenizer

    engine = build_small_engine(root, num_beams=4, draft_len=4, max_batch_size=4, max_input_len=128, max_seq_len=256)
    tok = AutoTokenizer.from_pretrained(str(SMALL / "base"))
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    ar = [r.output_ids for r in generate(load_engine(engine, **runtime), prompts, SamplingConfig(max_tokens=40),
                                         mode="ar")]
    return engine, prompts, ar


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    return small_4x4(tmp_path_factory.mktemp("draft-beams"))


def beams_drafted(engine) -> list[int]:
    """Wrap the launcher to record the beam count of every tree step that drafts."""
    nb = engine.tree.num_beams
    return record_tree_steps(engine.launcher, lambda variant, beams, depth: (beams or nb) if variant.draft else None)


def check_every_beam_count(engine, small, counts=(1, 2, 4)) -> None:
    _, prompts, ar = small
    params = SamplingConfig(max_tokens=40)
    sampled = [SamplingConfig(max_tokens=40, temperature=0.8, top_k=50, seed=s) for s in range(len(prompts))]
    sampled_ar = [r.output_ids for r in generate(engine, prompts, sampled, mode="ar")]
    tokens_per_step = {}
    for k in counts:
        engine.policy.beam_options = [k]
        seen = beams_drafted(engine)
        res = generate(engine, prompts, params, mode="redrafter")
        assert [r.output_ids for r in res] == ar, k
        assert seen and set(seen) == {k}, (k, set(seen))
        assert sum(r.accepted_draft_tokens for r in res) > 0, k  # drafted and accepted
        tokens_per_step[k] = sum(r.tokens_per_step for r in res) / len(res)
        assert [r.output_ids for r in generate(engine, prompts, sampled, mode="redrafter")] == sampled_ar, k
        del engine.launcher.tree
    assert all(tokens_per_step[k] > 1.3 for k in counts), tokens_per_step


@needs_small
def test_every_beam_count_gives_ar_tokens_greedy_and_sampled(small):
    engine = load_engine(small[0])
    assert engine.launcher.beam_options == [1, 2, 4] and engine.policy.beam_options == [4]  # by default: all
    check_every_beam_count(engine, small)


@needs_small
def test_the_policy_chooses_beam_counts_and_keeps_ar_tokens(small):
    """`--speculate auto` with a cost model where drafting a beam is dear: AR's tokens, and fewer beams drafted."""
    engine = load_engine(small[0], speculate="auto", draft_beams="auto")
    assert engine.policy.beam_options == [1, 2, 4]
    engine.policy.costs = beam_costs(draft_per_beam=1.5, P=engine.tree.max_tree_tokens)
    seen = beams_drafted(engine)
    _, prompts, ar = small
    assert [r.output_ids for r in generate(engine, prompts, SamplingConfig(max_tokens=40))] == ar
    assert 1 in seen or 2 in seen, seen


def test_draft_beams_are_checked_against_what_the_steps_can_draft():
    from trt_redrafter.runtime.launch import draft_beam_options

    assert draft_beam_options("auto", [1, 2, 4], 4) == [1, 2, 4]
    assert draft_beam_options("all", [1, 2, 4], 4) == [4]
    assert draft_beam_options("2", [1, 2, 4], 4) == [2]
    with pytest.raises(UserError, match="--draft-beams 3: this engine's steps can draft 1, 2, 4 beams"):
        draft_beam_options("3", [1, 2, 4], 4)
    with pytest.raises(UserError, match="only on the CPU"):
        draft_beam_options("1", [4], 4)
    for bad in ("some", "0", "-2", "1.5"):
        with pytest.raises(UserError, match="runtime.draft_beams"):
            RuntimeConfig(draft_beams=bad).validate()
