"""Drafting less deep (`--draft-depth`, and the speculation policy's choice of a depth per drafting step): a search
stopped after d tokens runs the drafter over no rows at the later depths (no read of its weights), its beams keep
their parents there and their nodes score SCORE_PAD, so the tree's drafted nodes are the d-step search's own and the
steps never verify the others; the output stays AR's at every depth, eager, compiled (one graph for every depth:
test_compiled) and at TP 2 (test_tp); the policy drafts less deep where the trees' deeper nodes are not worth their
drafting, and the whole depth where they are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_utils import SMALL, load_engine, record_tree_steps
from test_draft_beams import _Drafter, beam_costs, q, small_4x4
from trt_redrafter.config import RuntimeConfig, SamplingConfig, Speculation
from trt_redrafter.decoding import tree
from trt_redrafter.decoding.beam_search import LOG_ZERO, beam_search, select_beams_topk
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.calibration import Calibration
from trt_redrafter.runtime.costs import CostModel
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.graphs import depth_buckets, tree_buckets
from trt_redrafter.runtime.policy import BEAM_EXPLORE, Candidate, Phase, Policy, PolicyState, StepCosts, decide
from trt_redrafter.runtime.step import SCORE_PAD

needs_small = pytest.mark.skipif(not (SMALL / "drafter" / "model.safetensors").is_file(),
                                 reason="models/small not trained")


def test_depth_buckets():
    assert depth_buckets(1) == [1] and depth_buckets(4) == [1, 2, 3, 4]


class _Counting(_Drafter):
    """The random drafter, counting the rows its head runs over."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def logits(self, h, state):
        self.rows.append(h.shape[0])
        return super().logits(h, state)


@pytest.mark.parametrize("k,d", [(4, 1), (4, 2), (4, 3), (2, 2), (1, 1)])
def test_a_search_stopped_at_depth_d_is_the_d_step_search(k, d):
    """`depth_rows` against the d-step search itself: the same first d + 1 columns and scores, bit for bit; past them
    every beam repeats its last token with a LOG_ZERO score; and the drafter's head ran over no rows past depth d."""
    drafter = _Counting()
    h, tok = torch.randn(5, 16, generator=torch.Generator().manual_seed(1)), torch.arange(5) + 3
    dl = 4
    own = beam_search(drafter, lambda i: drafter.emb[i], h, tok, k, d, warp_top_k=None, keep_log_probs=False,
                      select=select_beams_topk)
    drafter.rows.clear()
    rows = [torch.arange(5 * k if t < d else 0) for t in range(1, dl)]
    cut = beam_search(drafter, lambda i: drafter.emb[i], h, tok, k, dl, warp_top_k=None, keep_log_probs=False,
                      select=select_beams_topk, depth_rows=rows)
    assert drafter.rows == [5] + [5 * k] * (d - 1) + [0] * (dl - d)
    assert torch.equal(cut.beams[:, :, :d + 1], own.beams)
    assert torch.equal(cut.scores[:, :, :d], own.scores)
    assert torch.equal(cut.beams[:, :, d + 1:], own.beams[:, :, -1:].expand(-1, -1, dl - d))
    assert (cut.scores[:, :, d:] == LOG_ZERO).all()
    if d < dl:  # and the whole depth without depth_rows is the search with every row
        whole = beam_search(drafter, lambda i: drafter.emb[i], h, tok, k, dl, warp_top_k=None, keep_log_probs=False,
                            select=select_beams_topk, depth_rows=[torch.arange(5 * k)] * (dl - 1))
        plain = beam_search(drafter, lambda i: drafter.emb[i], h, tok, k, dl, warp_top_k=None, keep_log_probs=False,
                            select=select_beams_topk)
        assert torch.equal(whole.beams, plain.beams) and torch.equal(whole.scores, plain.scores)


def test_the_nodes_past_the_depth_pack_last_at_the_padding_score():
    """The step's tree of a search stopped at depth 2 of 3: its drafted nodes are the 2-step tree's, first, and the
    nodes past depth 2 score SCORE_PAD (`DecodeStep._propose`, `pack`), below every drafted node."""
    from trt_redrafter.runtime.step import SCORE_FLOOR, quantize_scores

    drafter = _Drafter()
    h, tok = torch.randn(3, 16, generator=torch.Generator().manual_seed(2)), torch.arange(3) + 5
    nb, dl, d = 4, 3, 2
    rows = [torch.arange(3 * nb if t < d else 0) for t in range(1, dl)]
    res = beam_search(drafter, lambda i: drafter.emb[i], h, tok, nb, dl, warp_top_k=None, keep_log_probs=False,
                      select=select_beams_topk, depth_rows=rows)
    ran = torch.tensor([True] + [r.numel() > 0 for r in rows])
    scores = torch.where(ran, quantize_scores(res.scores), SCORE_PAD)
    P = 1 + nb * dl
    packed = tree.pack_beams(res.beams, pad_to=P)
    packed, node = tree.order_by_score(packed, tree.node_scores(packed, scores, SCORE_PAD))
    own = beam_search(drafter, lambda i: drafter.emb[i], h, tok, nb, d, warp_top_k=None, keep_log_probs=False,
                      select=select_beams_topk)
    for i in range(3):
        n = int(packed.lengths[i])
        drafted = [j for j in range(1, n) if node[i, j] > SCORE_PAD]
        assert drafted == list(range(1, len(drafted) + 1))  # the drafted nodes first
        assert all(node[i, j] >= SCORE_FLOOR for j in drafted)
        assert all(node[i, j] == SCORE_PAD for j in range(len(drafted) + 1, n))
        assert max(int(packed.position_offsets[i, j]) for j in drafted) == d
        paths = {tuple(r[1:j + 1].tolist()) for r in own.beams[i] for j in range(1, d + 1)}
        assert len(drafted) == len(paths)


# ---- the policy's depth -------------------------------------------------------------------------------------------

def depth_costs(ar=10.0, per_node=0.2, draft_per_depth=0.8, P=13, dl=3) -> CostModel:
    """A tree step costs the AR step, drafting (per depth searched) and a little per verified node."""
    batches, widths, depths = [1, 2, 4], tree_buckets(P), list(range(1, dl + 1))
    row_ar = [ar] * 3
    tree_ = [[ar + draft_per_depth * dl * b + per_node * w * b for w in widths] for b in batches]
    by_depth = [[ar + draft_per_depth * d * b + per_node * b for d in depths] for b in batches]
    return CostModel(batches, widths, [100, 1100], [row_ar, row_ar], [tree_, tree_], depths=depths,
                     by_depth=[by_depth, by_depth])


def chains(per_beam: list[list[float]], drafted: int = 3) -> Candidate:
    """A tree of chains, one per beam (probabilities of each beam's nodes by depth, root excluded), as the step
    returns it: best first, with each node's beam and depth; `drafted`: the depth the search ran to (the nodes past
    it at SCORE_PAD)."""
    nodes = [((q(p) if j < drafted else SCORE_PAD), b, j + 1) for b, chain in enumerate(per_beam)
             for j, p in enumerate(chain)]
    nodes.sort(key=lambda x: -x[0])
    return Candidate(0, True, [0] + [s for s, _, _ in nodes], Calibration(), context=100,
                     beams=[0] + [b for _, b, _ in nodes], depths=[0] + [j for _, _, j in nodes])


def speculating() -> PolicyState:
    return PolicyState(phase=Phase.SPECULATING, mean_gain=2.0, mean_cost=1.2, mean_batch=1)


def decide_depth(cand, state=None, costs=None, beams=(4,)):
    return decide(state or speculating(), [cand], True, StepCosts(costs or depth_costs()), tree_buckets(13), None,
                  list(beams), [1, 2, 3])


def test_trees_whose_deeper_nodes_are_never_right_are_drafted_one_token_deep():
    """Every beam's first node likely, the deeper ones hopeless: each further depth costs a read of the drafter's
    weights and earns nothing."""
    d, _ = decide_depth(chains([[0.9, 0.01, 0.001], [0.5, 0.01, 0.001], [0.2, 0.005, 0.001], [0.1, 0.001, 0.001]]))
    assert d.is_tree and d.draft and d.depth == 1


def test_trees_right_at_every_depth_are_drafted_to_the_whole_depth():
    """An oracle-like drafter: every node likely: every depth pays."""
    d, _ = decide_depth(chains([[0.95, 0.9, 0.9], [0.6, 0.5, 0.5], [0.3, 0.3, 0.3], [0.2, 0.2, 0.2]]))
    assert d.is_tree and d.draft and d.depth == 3


def test_a_useless_drafter_drafts_neither_deep_nor_wide_before_it_stops():
    """Beams and depth chosen together: only beam 0's first node worth anything."""
    cand = chains([[0.9, 0.02, 0.01], [0.01, 0.005, 0.001], [0.01, 0.002, 0.001], [0.005, 0.001, 0.001]])
    costs = CostModel.from_dict({**depth_costs().to_dict(), "beams": [1, 2, 4],
                                 "draft": [[[10 + 0.5 * k * b for k in (1, 2, 4)] for b in (1, 2, 4)]] * 2})
    d, _ = decide_depth(cand, costs=costs, beams=(1, 2, 4))
    assert d.is_tree and d.draft and (d.beams, d.depth) == (1, 1)


def test_the_whole_depth_is_drafted_again_after_a_run_less_deep():
    """Trees one token deep, whatever they earn, say nothing of what deeper nodes would: after BEAM_EXPLORE drafting
    steps less deep, one drafts the whole depth, and the choice is made again on its whole trees."""
    shallow = chains([[0.95, 0.9, 0.9], [0.5, 0.5, 0.5]], drafted=1)
    assert shallow.drafted_depth == 1
    state = speculating()
    for i in range(BEAM_EXPLORE):
        d, state = decide_depth(shallow, state)
        assert d.depth == 1, i
    d, state = decide_depth(shallow, state)
    assert d.depth == 3 and state.beam_hold == 0
    d, state = decide_depth(chains([[0.95, 0.9, 0.9], [0.6, 0.5, 0.5], [0.3, 0.3, 0.3]]), state)  # its whole trees
    assert d.depth == 3


def test_the_nodes_past_the_depth_are_never_kept():
    """A fixed width (`--speculate full`) keeps a tree's drafted nodes, not the ones past where the search stopped."""
    cand = chains([[0.9, 0.8, 0.7], [0.5, 0.4, 0.3]], drafted=1)
    d, _ = decide(PolicyState(), [cand], True, StepCosts(None), tree_buckets(7), 7, [2], [1, 2, 3])
    assert d.width == 7 and d.keep[0] == 3  # the root and the two depth-1 nodes


def test_fixed_draft_depth_is_drafted_every_step():
    policy = Policy(Speculation.parse("3"), 13, None, [4], [2])
    d = policy.decide([chains([[0.9, 0.9, 0.9]])], True)
    assert d.width == 3 and d.depth == 2


def test_the_cost_model_charges_a_step_what_its_depth_costs():
    costs = depth_costs()
    full = costs.tree_ms(2, 5, 100)
    assert costs.tree_ms(2, 5, 100, depth=3) == full
    assert costs.tree_ms(2, 5, 100, depth=1) == pytest.approx(full - 0.8 * 2 * 2)
    old = CostModel.from_dict({k: v for k, v in costs.to_dict().items() if k not in ("depths", "by_depth")})
    assert old.tree_ms(2, 5, 100, depth=1) == full  # a model measured without depths charges the whole depth


def test_fewer_beams_save_at_each_depth_drafted():
    """Drafting 1 of 4 beams saves at each drafting step: drafted 1 deep of 3, a third of what it saves at the whole
    depth (the two savings, each measured with the other whole, added up charged such a step less than it costs)."""
    beams = beam_costs()
    costs = depth_costs()
    costs.beams, costs.draft = beams.beams, beams.draft
    full = costs.tree_ms(2, 5, 100)
    beam_saving = full - costs.tree_ms(2, 5, 100, beams=1)
    depth_saving = full - costs.tree_ms(2, 5, 100, depth=1)
    assert beam_saving > 0 and depth_saving > 0
    assert costs.tree_ms(2, 5, 100, beams=1, depth=1) == pytest.approx(full - depth_saving - beam_saving / 3)
    assert costs.tree_ms(2, 5, 100, beams=1, depth=3) == pytest.approx(full - beam_saving)


def test_drafting_less_never_saves_more_than_the_fixed_cost_share():
    """A busy host timed the depth-1 and one-beam steps far below the whole one (here: at a tenth of the AR step):
    each saving is capped at its share of the fixed cost (width 1 less AR), so a step drafting 1 beam of 4, 1 token
    deep of 3, still costs the AR step and 1/12 of the fixed cost."""
    costs = depth_costs()
    costs.beams, costs.draft = beam_costs().beams, beam_costs().draft
    for table in (costs.by_depth, costs.draft):
        for per_ctx in table:
            for row in per_ctx:
                row[0] = 1.0
    ar, width1 = costs.ar_ms(2, 100), costs.tree_ms(2, 1, 100)
    fixed = width1 - ar
    assert costs.tree_ms(2, 1, 100, depth=1) == pytest.approx(width1 - fixed * 2 / 3)
    assert costs.tree_ms(2, 1, 100, beams=1) == pytest.approx(width1 - fixed * 3 / 4)
    assert costs.tree_ms(2, 1, 100, beams=1, depth=1) == pytest.approx(ar + fixed / 12)


def test_a_step_drafting_less_deep_is_observed_against_its_own_cost():
    """The running scale of measured to modelled tree steps (`Policy.observe_step`): a step that drafted one token
    deep and took what the model says such a step takes leaves the scale at 1 (against the whole depth's cell it would
    read as a machine 14% faster, and the policy would count the saving twice)."""
    from trt_redrafter.runtime.policy import StepDecision

    costs = depth_costs()
    policy = Policy(Speculation.parse("auto"), 13, costs, [4], [1, 2, 3])
    shallow = StepDecision(5, {0: 5}, True, depth=1)
    for _ in range(3):
        policy.observe_step(shallow, 1, 100, costs.tree_ms(1, 5, 100, depth=1))
    assert policy.step_scale[1] == pytest.approx(1.0)


def test_draft_depth_is_checked_against_what_the_steps_can_draft():
    from trt_redrafter.runtime.launch import draft_depth_options

    assert draft_depth_options("auto", [1, 2, 3, 4], 4) == [1, 2, 3, 4]
    assert draft_depth_options("all", [1, 2, 3, 4], 4) == [4]
    assert draft_depth_options("2", [1, 2, 3, 4], 4) == [2]
    with pytest.raises(UserError, match="--draft-depth 5: this engine's steps can draft to depth 1, 2, 3, 4"):
        draft_depth_options("5", [1, 2, 3, 4], 4)
    with pytest.raises(UserError, match="only on the CPU"):
        draft_depth_options("1", [4], 4)
    for bad in ("some", "0", "-2", "1.5"):
        with pytest.raises(UserError, match="runtime.draft_depth"):
            RuntimeConfig(draft_depth=bad).validate()


# ---- engines -------------------------------------------------------------------------------------------------------
# `kernels="torch"`: the drafter runs as ops (on an AVX-512 CPU the default `cpu` kernels draft in the fused beam_draft
# kernel, which drafts every depth: there the launcher offers the whole depth only)

@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    return small_4x4(tmp_path_factory.mktemp("draft-depth"), kernels="torch")


def depths_drafted(engine) -> list[int]:
    """Wrap the launcher to record the depth of every tree step that drafts."""
    dl = engine.tree.draft_len_per_beam
    return record_tree_steps(engine.launcher, lambda variant, beams, depth: (depth or dl) if variant.draft else None)


@needs_small
def test_every_draft_depth_gives_ar_tokens_greedy_and_sampled(small):
    """Each depth, every drafting step (`--draft-depth N`, the whole tree verified: `--speculate full`): AR's tokens,
    greedy and sampled; drafts made and accepted; and a deeper search accepts more per step."""
    engine = load_engine(small[0], kernels="torch")
    assert engine.launcher.depth_options == [1, 2, 3, 4] and engine.policy.depth_options == [1, 2, 3, 4]
    _, prompts, ar = small
    params = SamplingConfig(max_tokens=40)
    sampled = [SamplingConfig(max_tokens=40, temperature=0.8, top_k=50, seed=s) for s in range(len(prompts))]
    sampled_ar = [r.output_ids for r in generate(engine, prompts, sampled, mode="ar")]
    tokens_per_step = {}
    for depth in (1, 2, 3, 4):
        engine.policy.depth_options = [depth]
        seen = depths_drafted(engine)
        res = generate(engine, prompts, params, mode="redrafter")
        assert [r.output_ids for r in res] == ar, depth
        assert seen and set(seen) == {depth}, (depth, set(seen))
        assert sum(r.accepted_draft_tokens for r in res) > 0, depth
        tokens_per_step[depth] = sum(r.tokens_per_step for r in res) / len(res)
        assert [r.output_ids for r in generate(engine, prompts, sampled, mode="redrafter")] == sampled_ar, depth
        del engine.launcher.tree
    assert tokens_per_step[1] > 1.3 and tokens_per_step[1] < tokens_per_step[2] < tokens_per_step[4], tokens_per_step


@needs_small
def test_the_policy_chooses_draft_depths_and_keeps_ar_tokens(small):
    """`--speculate auto` with a cost model where each depth is dear: AR's tokens, and shallower trees drafted."""
    engine = load_engine(small[0], speculate="auto", kernels="torch")
    engine.policy.costs = depth_costs(draft_per_depth=2.5, P=engine.tree.max_tree_tokens, dl=4)
    seen = depths_drafted(engine)
    _, prompts, ar = small
    res = generate(engine, prompts, SamplingConfig(max_tokens=40))
    assert [r.output_ids for r in res] == ar
    assert sum(r.accepted_draft_tokens for r in res) > 0
    assert seen and min(seen) < 4, seen
