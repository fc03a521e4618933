"""Learning-free proposers (runtime/ngram.py): context N-grams on hand-made contexts and against a rescan, the model
bigram table against Hugging Face, and engines drafting with them: greedy == AR == HF for every proposer and for
batches that mix proposers, an engine built without a drafter, and the refusals."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from engine_utils import _hf_model, build_tiny_engines, greedy, hf_greedy, load_engine, random_prompts, run_cli
from trt_redrafter.config import ProposerConfig, SamplingConfig
from trt_redrafter.decoding.tree import pack_beams
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.ngram import (CONTEXT_DECAY, MODEL_DECAY, MODEL_FIRST, NGRAMS_FILE, ContextNgrams,
                                         ModelNgrams, NgramProposer, fill_rows)
from trt_redrafter.runtime.sequence import Draft
from trt_redrafter.runtime.sequence import RequestSpec, Sequence
from trt_redrafter.runtime.step import SCORE_PAD, SCORE_SCALE


class index_of:
    """A context index of `tokens`; `continuations` without their shares (`test_context_draft_scores` checks them)."""

    def __init__(self, tokens, kmin=1, kmax=4):
        self.idx = ContextNgrams(kmin, kmax)
        self.idx.extend(tokens)

    def continuations(self, *args):
        return [c for c, _ in self.idx.continuations(*args)]


def seq_of(prompt, output) -> Sequence:
    return Sequence(0, RequestSpec(list(prompt), SamplingConfig()), 10_000, output=list(output))


# ---- context N-grams ------------------------------------------------------------------------------------------

def test_known_continuation_runs_past_the_end_periodically():
    # "1 2" occurred at positions 0-1; what followed it (3 4 1 2) is the period, guessed to repeat
    assert index_of([1, 2, 3, 4, 1, 2]).continuations(6, 4) == [[3, 4, 1, 2, 3, 4]]


def test_longest_match_comes_first():
    toks = [9, 5, 7, 1, 5, 8, 9, 5]  # "9 5" -> 7; "5" alone -> 7 (i=1) and 8 (i=4, more recent)
    assert index_of(toks, 1, 2).continuations(1, 3) == [[7], [8]]
    assert index_of(toks, 1, 1).continuations(1, 3) == [[8], [7]]  # k=1 only: recency decides


def test_ties_rank_by_count_then_recency():
    toks = [5, 7, 5, 8, 5, 7, 5, 9, 5]
    assert index_of(toks, 1, 1).continuations(1, 3) == [[7], [9], [8]]  # 7 twice; 9 more recent than 8
    assert index_of(toks, 1, 1).continuations(1, 2) == [[7], [9]]


def test_no_match_and_match_at_the_very_end():
    assert index_of([1, 2, 3, 4]).continuations(3, 4) == []
    assert index_of([]).continuations(3, 4) == []
    assert index_of([7]).continuations(3, 4) == []
    assert index_of([4, 3, 3]).continuations(3, 4) == [[3, 3, 3]]  # "3" just before the true token: period 1


def slow_continuations(toks, kmin, kmax, length, limit, window=8):
    """Rescan the whole context (reference for the incremental index)."""
    n, out = len(toks), []
    for k in range(min(kmax, n - 1), kmin - 1, -1):
        key = toks[n - k:]
        ends = [i for i in range(k - 1, n - 1) if toks[i - k + 1:i + 1] == key][-window:]
        ranked = {}
        for r, i in enumerate(reversed(ends)):
            p = n - 1 - i
            c = tuple(toks[i + 1 + j % p] for j in range(length))
            ranked.setdefault(c, [0, r])[0] += 1
        for c, _ in sorted(ranked.items(), key=lambda kv: (-kv[1][0], kv[1][1])):
            if list(c) not in out:
                out.append(list(c))
    return out[:limit]


def test_incremental_index_equals_a_rescan_of_the_context():
    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(300)]  # a small alphabet: many matches, ties and repeats
    idx = ContextNgrams(1, 3)
    for n in range(1, len(toks) + 1):
        idx.extend(toks[n - 1:n])
        assert [c for c, _ in idx.continuations(4, 5)] == slow_continuations(toks[:n], 1, 3, 4, 5), n


def test_sync_indexes_prompt_then_output_once():
    s = seq_of([1, 2, 3], [1, 2])
    prop = NgramProposer(3, 2, ProposerConfig(ngram_min=1, ngram_max=2))
    assert prop.context_drafts(s, 3) == [[2, 3, 1]]
    s.output += [3, 9]
    assert prop.context_drafts(s, 3) == []  # "3 9" / "9" never occurred before
    assert s.proposer_state.index.tokens == [1, 2, 3, 1, 2, 3, 9]


# ---- drafts, padding and tree lengths ------------------------------------------------------------------------

def table_of(successors) -> ModelNgrams:
    succ = torch.tensor(successors, dtype=torch.int32)
    return ModelNgrams(succ, torch.tensor([0, 1], dtype=torch.int32))


def test_drafts_fill_with_bigram_chains_after_context_matches():
    # successors: 0 -> 1, 1 -> 2, 2 -> 0, 3 -> 1; second choices 3, 0, 1, 2
    table = table_of([[1, 3], [2, 0], [0, 1], [1, 2]])
    prop = NgramProposer(4, 3, ProposerConfig(ngram_min=1, ngram_max=2), table)
    s = seq_of([3, 0, 2], [3])  # true token 3; context match "3" -> 0 2 3
    rows = prop.drafts(s)
    assert rows[0] == [3, 0, 2, 3]  # the context match
    assert rows[1] == [3, 1, 2, 0]  # 3's top successor 1, continued by the chain 1 -> 2 -> 0
    assert rows[2] == [3, 2, 0, 1]  # 3's second successor 2 -> 0 -> 1
    assert rows[3] == rows[0]  # unigram 0 and 1 start drafts already taken: padded with the first row
    assert all(len(r) == 4 and r[0] == 3 for r in rows)


def test_drafts_are_scored_by_how_often_their_continuation_followed():
    """A context draft claims count / (occurrences + 1) for its first token, CONTEXT_DECAY less per further token; a
    model draft MODEL_FIRST, MODEL_DECAY less per further token (what the speculation policy calibrates)."""
    table = table_of([[1, 3], [2, 0], [0, 1], [1, 2]])
    prop = NgramProposer(3, 2, ProposerConfig(ngram_min=1, ngram_max=1), table)
    s = seq_of([3, 0, 1, 3, 0, 2, 3, 0, 1], [3])  # "3" was followed by 0 three times: "0 1" twice, "0 2" once
    d = prop.compose(s)
    assert d.rows == [[3, 0, 1], [3, 0, 2], [3, 1, 2]]
    q = lambda p: round(math.log(p) * SCORE_SCALE)  # noqa: E731
    assert d.scores[0] == [q(2 / 4), q(2 / 4 * CONTEXT_DECAY)] and d.scores[1] == [q(1 / 4), q(1 / 4 * CONTEXT_DECAY)]
    assert d.scores[2] == [q(MODEL_FIRST), q(MODEL_FIRST * MODEL_DECAY)]
    matched = NgramProposer(3, 2, ProposerConfig(ngram_min=1, ngram_max=1), table, when="matched")
    assert matched.compose(s).rows == [[3, 0, 1], [3, 0, 2], [3, 0, 1]]  # no model drafts: padded with the first
    assert matched.compose(seq_of([1, 2], [3])) is None  # nothing to propose


def test_no_table_no_match_proposes_nothing():
    assert NgramProposer(3, 2, ProposerConfig()).drafts(seq_of([1, 2], [3])) is None


def test_host_tree_nodes_equal_the_step_s():
    """`Draft.nodes` (what the policy weighs a host-composed tree by) lists the nodes as the step numbers them:
    the packer's node count, and its scores and depths best first (`tree.node_scores` + `tree.order_by_score`)."""
    from trt_redrafter.decoding.tree import node_scores, order_by_score

    rng = random.Random(1)
    for _ in range(300):
        nb, dl = rng.randint(1, 5), rng.randint(1, 4)
        rows = [[7] + [rng.randrange(3) for _ in range(dl)] for _ in range(rng.randint(1, nb))]
        scores = [sorted((-rng.randrange(4) * 100 for _ in range(dl)), reverse=True) for _ in rows]
        if rng.random() < 0.3:  # a proposer whose scores for one prefix disagree between rows
            scores = [[-rng.randrange(4) * 100 for _ in range(dl)] for _ in rows]
        rows, scores = fill_rows(rows, nb, 7, dl, scores)
        packed = pack_beams(torch.tensor([rows]), pad_to=1 + nb * dl)
        ordered, node = order_by_score(packed, node_scores(packed, torch.tensor([scores]), SCORE_PAD))
        n = int(packed.lengths[0])
        got = Draft(rows, scores).nodes()
        got_scores, got_depths = got.scores, got.depths
        assert got_scores == node[0, :n].tolist() and got_depths == ordered.position_offsets[0, :n].tolist()
        assert ordered.tokens.gather(1, ordered.unpacker.flatten(1)).view(1, nb, dl + 1).tolist() == [rows]


# ---- engines ----------------------------------------------------------------------------------------------

MAX_NEW = 40


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny base + drafter: a ReDrafter engine and an engine built from the base alone. N-gram requests draft on
    every context match (`--ngram-when matched`) and verify every tree whole (`load_engine`'s default)."""
    root = tmp_path_factory.mktemp("ngram")
    base, engines = build_tiny_engines(root, seed=41, num_beams=4, draft_len=3, num_heads=4, num_kv_heads=2,
                                       rnn=True, build_args=("--ngram-when", "matched"))
    plain = root / "engine-ngram"
    run_cli("build-engine", "--base-model", base, "--output", plain, "--backend", "torch", "--dtype", "float32",
            "--num-beams", 4, "--draft-len-per-beam", 3, "--max-batch-size", 4, "--max-input-len", 64,
            "--max-seq-len", 160, "--ngram-when", "matched")
    prompts = random_prompts(384, [5, 11, 3, 8, 14], seed=41)
    prompts[0] = (prompts[0] * 5)[:24]  # repeated text: context matches from the first step
    ar = [r.output_ids for r in generate(load_engine(plain), prompts, greedy(MAX_NEW), "ar")]
    return base, engines[1], plain, prompts, ar


def test_an_engine_built_without_a_drafter_drafts_with_ngrams(pair):
    base, _, plain, prompts, ar = pair
    spec = json.loads((plain / "config.json").read_text())["build_config"]["speculation"]
    assert spec["proposer"] == "ngram" and (spec["num_beams"], spec["draft_len_per_beam"]) == (4, 3)
    assert (plain / NGRAMS_FILE).is_file()
    engine = load_engine(plain)
    assert engine.drafter is None and engine.ngram.table is not None
    res = generate(engine, prompts, greedy(MAX_NEW))
    assert [r.output_ids for r in res] == ar
    assert ar[:2] == [hf_greedy(base, p, MAX_NEW) for p in prompts[:2]]
    assert sum(r.accepted_draft_tokens for r in res) > 0 and engine.cache.used_blocks == 0


def test_the_tree_shape_is_stored_once(pair):
    """A ReDrafter engine's tree shape lives in pretrained_config (the checkpoint's redrafter_* keys) alone; a
    drafterless engine's in build_config.speculation; either is read back as the engine's tree."""
    from trt_redrafter.checkpoint.engine_config import load_engine_config
    _, engine_dir, plain, _, _ = pair
    raw = json.loads((engine_dir / "config.json").read_text())
    assert "num_beams" not in raw["build_config"]["speculation"]
    assert "draft_len_per_beam" not in raw["build_config"]["speculation"]
    cfg = load_engine_config(engine_dir)
    shape = (raw["pretrained_config"]["redrafter_num_beams"], raw["pretrained_config"]["redrafter_draft_len_per_beam"])
    assert (cfg.tree.num_beams, cfg.tree.draft_len_per_beam) == shape
    assert (load_engine_config(plain).tree.num_beams, load_engine_config(plain).tree.draft_len_per_beam) == (4, 3)


@pytest.mark.parametrize("proposer", ["redrafter", "ngram", "mixed"])
def test_greedy_equals_ar_for_each_proposer(pair, proposer):
    _, engine_dir, _, prompts, ar = pair
    engine = load_engine(engine_dir)
    res = generate(engine, prompts, greedy(MAX_NEW), proposer=proposer)
    assert [r.output_ids for r in res] == ar
    if proposer != "redrafter":  # the random drafter accepts ~nothing; the repeated prompt's matches do
        assert res[0].tokens_per_step > 1.3


def test_a_batch_mixing_proposers_equals_ar(pair):
    """Requests with different proposers share steps (the device drafts for some rows, the host for others)."""
    from trt_redrafter.runtime.scheduler import Request, Scheduler

    _, engine_dir, _, prompts, ar = pair
    engine = load_engine(engine_dir)
    sched = Scheduler(engine)
    kinds = ["ngram", "redrafter", "mixed", "ngram", "mixed"]
    reqs = [sched.submit(Request(i, RequestSpec(p, greedy(MAX_NEW), proposer=k))) for i, (p, k) in
            enumerate(zip(prompts, kinds))]
    sched.run_until_idle()
    assert [r.seq.output for r in reqs] == ar
    assert engine.step_times.steps["propose"] > 0


def test_mixed_keeps_the_drafters_best_beams(pair):
    """A mixed tree is the drafter's beams with context matches in place of its lowest-ranked ones only."""
    _, engine_dir, _, prompts, _ = pair
    engine = load_engine(engine_dir)
    seen = {}  # the drafter's beams (best first) as the step read them back
    compose = engine._compose_on_host
    engine._compose_on_host = lambda work: (seen.update({s.seq_id: h.device for s, h in work}), compose(work))
    s = engine.new_sequence(RequestSpec(prompts[0], greedy(MAX_NEW), proposer="mixed"))
    ctx = []
    while not ctx and not s.finished:
        engine.step([s])  # trees are composed on the host after each step
        ctx = engine.ngram.context_drafts(s, engine.cfg.proposer.ngram_beams)
    device = seen[s.seq_id]
    rows = s.pending.rows
    assert ctx and rows[:4 - len(ctx)] == device.rows[:4 - len(ctx)] and rows[4 - len(ctx):] == ctx
    assert s.pending.scores[:4 - len(ctx)] == device.scores[:4 - len(ctx)]
    engine.slots.release(s)


def test_refusals(pair):
    _, engine_dir, plain, prompts, _ = pair
    with pytest.raises(UserError, match="needs a drafter"):
        load_engine(plain).new_sequence(RequestSpec(prompts[0], greedy(4), proposer="mixed"))
    with pytest.raises(UserError, match="acceptance 'apple'"):
        load_engine(engine_dir).new_sequence(RequestSpec(prompts[0], SamplingConfig(acceptance="apple"),
                                                           proposer="ngram"))
    with pytest.raises(UserError, match="proposer must be one of"):
        load_engine(engine_dir).new_sequence(RequestSpec(prompts[0], greedy(4), proposer="eagle"))


def test_sampled_ngram_output_equals_sampled_ar(pair):
    _, _, plain, prompts, _ = pair
    engine = load_engine(plain)
    params = [SamplingConfig(max_tokens=30, temperature=0.8, top_k=50, seed=s) for s in range(len(prompts))]
    ar = [r.output_ids for r in generate(engine, prompts, params, "ar")]
    assert [r.output_ids for r in generate(engine, prompts, params)] == ar


# ---- the model's bigram table ---------------------------------------------------------------------------------

def test_model_table_equals_a_slow_reference(pair):
    """Every token alone through Hugging Face, one at a time: the table's successors are its top-K next tokens and
    the unigrams the top-K of the mean log-probability."""
    base, _, plain, _, _ = pair
    table = ModelNgrams.load(plain / NGRAMS_FILE, 384)
    hf = _hf_model(str(base))
    K = table.successors.shape[1]
    logp_sum = torch.zeros(384, dtype=torch.float64)
    with torch.no_grad():
        for t in range(384):
            logits = hf(torch.tensor([[t]])).logits[0, -1].float()
            want = logits.topk(K)
            got = logits[table.successors[t].long()]
            torch.testing.assert_close(got, want.values, rtol=0, atol=1e-4)  # same tokens up to exact ties
            logp_sum += torch.log_softmax(logits, -1).double()
    mean = logp_sum[table.unigrams.long()]
    torch.testing.assert_close(mean, logp_sum.topk(K).values, rtol=0, atol=1e-3)


def test_model_table_is_skipped_on_a_cpu_when_it_would_take_hours(pair, tmp_path, monkeypatch):
    from trt_redrafter.backends import torch_build

    base = pair[0]
    monkeypatch.setattr(torch_build, "CPU_TABLE_FLOPS", 1.0)  # as if this tiny model were a 7B one
    flags = ("--backend", "torch", "--dtype", "float32", "--max-input-len", 64, "--max-seq-len", 160)
    run_cli("build-engine", "--base-model", base, "--output", tmp_path / "auto", *flags)
    run_cli("build-engine", "--base-model", base, "--output", tmp_path / "on", "--model-ngrams", "on", *flags)
    assert not (tmp_path / "auto" / NGRAMS_FILE).exists() and (tmp_path / "on" / NGRAMS_FILE).is_file()
    engine = load_engine(tmp_path / "auto")  # drafts from the context alone
    assert engine.ngram.table is None
    prompts = pair[3]
    assert [r.output_ids for r in generate(engine, prompts, greedy(MAX_NEW))] == pair[4]


def test_without_a_context_match_a_request_steps_ar_or_verifies_bigrams(pair, tmp_path):
    """`--ngram-when matched`: a step with no context match is an AR step (no drafts); `always` proposes the model's
    bigram drafts on every step (verified whole here: `speculate full`). Both give AR's tokens."""
    base, _, plain, prompts, ar = pair
    engine = load_engine(plain)
    assert engine.ngram_when == "matched"
    res = generate(engine, prompts, greedy(MAX_NEW))
    assert [r.output_ids for r in res] == ar
    assert any(r.draft_tokens < 3 * r.steps for r in res)  # some steps had nothing to draft
    assert engine.step_times.steps["ar"] > 0
    always = tmp_path / "always"
    run_cli("build-engine", "--base-model", base, "--output", always, "--backend", "torch", "--dtype", "float32",
            "--num-beams", 4, "--draft-len-per-beam", 3, "--max-input-len", 64, "--max-seq-len", 160,
            "--ngram-when", "always")
    res = generate(load_engine(always), prompts, greedy(MAX_NEW))
    assert [r.output_ids for r in res] == ar
    assert all(r.draft_tokens == 3 * r.steps for r in res)  # every step verified a tree
