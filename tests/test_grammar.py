"""Structured output (runtime/grammar.py, decoding/bitmask.py): grammars through AR steps and draft trees.

The reference is constrained AR decoding, the grammar's mask applied to the logits at every position. Constrained
ReDrafter must give its tokens exactly (greedy and sampled, every proposer, eager and compiled) with drafts made and
accepted, and the output must follow the grammar. The API surfaces (Triton, OpenAI, CLI) have their tests in
test_serving_modes.py, test_openai.py and test_build_and_run_cli.py.
"""

from __future__ import annotations

import inspect

import json
import re

import jsonschema
import pytest
import torch
import xgrammar

from engine_utils import OracleProposer, build_tiny_engines, load_engine, random_prompts
from trt_redrafter.config import Guide, GuideType, SamplingConfig
from trt_redrafter.decoding import bitmask
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.grammar import Grammars
from trt_redrafter.runtime.step import node_rows

VOCAB = 512
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,5}\."
GUIDES = {"regex": Guide(GuideType.REGEX, REGEX), "schema": Guide(GuideType.JSON_SCHEMA, json.dumps(SCHEMA)),
          "ebnf": Guide(GuideType.EBNF, 'root ::= "(" word ("," word)? ")"\nword ::= [a-z] [a-z]? [a-z]?')}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base, engines = build_tiny_engines(tmp_path_factory.mktemp("grammar"), seed=3, num_beams=4, draft_len=3,
                                       vocab_size=VOCAB, max_seq_len=200, kv_block_size=16)
    from transformers import AutoTokenizer

    return engines[1], AutoTokenizer.from_pretrained(str(engines[1] / "tokenizer"))


PROMPTS = random_prompts(VOCAB, [7, 20], seed=1)


def _run(engine_dir, tok, guide, mode="ar", proposer=None, params=None, **runtime):
    params = params or SamplingConfig(max_tokens=60)
    return generate(load_engine(engine_dir, proposer, **runtime), PROMPTS, params, mode, guide=guide,
                    stop_ids=(tok.eos_token_id,))


def _follows(guide: Guide, text: str) -> bool:
    if guide.kind is GuideType.REGEX:
        return re.fullmatch(REGEX, text) is not None
    if guide.kind is GuideType.JSON_SCHEMA:
        # strict=False: xgrammar's JSON strings admit raw control characters (a tab), which strict JSON escapes
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
        return True
    return re.fullmatch(r"\([a-z]{1,3}(,[a-z]{1,3})?\)", text) is not None


# ---- the pieces ---------------------------------------------------------------------------------------------------

def test_bitmask_apply_is_xgrammars():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 100, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (3, 5, bitmask.words(100)), dtype=torch.int32, generator=g)
    want = logits.clone().view(15, 100)
    xgrammar.apply_token_bitmask_inplace(want, mask.view(15, -1))
    torch.testing.assert_close(bitmask.apply(logits, mask), want.view(3, 5, 100))
    assert bitmask.allowed(bitmask.full(2, bitmask.words(70)), 70).all()


def test_node_rows_give_each_node_the_row_of_its_beam_positions():
    # two beams sharing their first draft: packed nodes 0 (root), 1 (shared), 2, 3 (beam 0), 4 (beam 1)
    unpacker = torch.tensor([[[0, 1, 2, 3], [0, 1, 4, 5]]])
    rows = unpacker * 10  # a beam position's row names its node
    assert node_rows(rows, unpacker, 6).tolist() == [[0, 10, 20, 30, 40, 50]]
    assert node_rows(rows, unpacker, 3).tolist() == [[0, 10, 20]]  # nodes past T are dropped


def test_tree_masks_are_the_masks_along_each_beam(tiny):
    engine_dir, tok = tiny
    grammars = Grammars(engine_dir / "tokenizer", VOCAB)
    state = grammars.start(GUIDES["schema"], [tok.eos_token_id])
    state.accept(tok.encode('{"name"', add_special_tokens=False))
    good = tok.encode(': "ab', add_special_tokens=False)
    beams = [[7] + good[:3] + [0] * (3 - len(good[:3])), [7] + tok.encode("}}}", add_special_tokens=False)[:3]]
    beams = [b + [0] * (4 - len(b)) for b in beams]
    state.beams = beams
    masks = state.tree_masks(2, 4, fresh=True)
    for b, beam in enumerate(beams):
        m = xgrammar.GrammarMatcher(grammars.compile(GUIDES["schema"]))
        m.accept_string('{"name"')
        for j in range(4):
            want = xgrammar.allocate_token_bitmask(1, VOCAB)
            m.fill_next_token_bitmask(want)
            if j and not ok:
                break  # below a forbidden draft: never accepted, its rows allow everything
            assert torch.equal(masks[b, j], want[0]), (b, j)
            ok = j + 1 < 4 and m.accept_token(beam[j + 1])
        else:
            continue
        assert (masks[b, j:] == -1).all()
    assert not masks.eq(-1).all()


# ---- the engine ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(GUIDES))
def test_constrained_ar_follows_the_grammar(tiny, name):
    engine_dir, tok = tiny
    for r in _run(engine_dir, tok, GUIDES[name]):
        assert r.finish_reason == "stop" and r.output_ids[-1] == tok.eos_token_id
        assert _follows(GUIDES[name], tok.decode(r.output_ids[:-1]))
    free = _run(engine_dir, tok, None)
    assert not any(_follows(GUIDES["regex"], tok.decode(r.output_ids)) for r in free)  # the model alone does not


@pytest.mark.parametrize("name", ["regex", "schema"])
def test_constrained_redrafter_gives_constrained_ar_tokens(tiny, name):
    """Drafting the constrained continuation is accepted; drafting the unconstrained one (tokens the grammar forbids,
    which the unmasked argmax would accept) is not, and the output is still constrained AR's."""
    engine_dir, tok = tiny
    guide = GUIDES[name]
    ar = _run(engine_dir, tok, guide)
    free = _run(engine_dir, tok, None)
    for continuations, corrupt, accepted in [(ar, 2, True), (free, 0, False)]:
        oracle = OracleProposer(engine_dir, {i: r.output_ids for i, r in enumerate(continuations)},
                                corrupt_every=corrupt)
        rd = _run(engine_dir, tok, guide, "redrafter", oracle)
        assert [r.output_ids for r in rd] == [r.output_ids for r in ar]
        assert all(r.draft_tokens > 0 for r in rd)
        if accepted:
            assert all(r.accepted_draft_tokens > 0 and r.steps < len(r.output_ids) - 1 for r in rd)


def test_constrained_sampling_is_constrained_ar_sampling(tiny):
    engine_dir, tok = tiny
    params = SamplingConfig(max_tokens=60, temperature=1.0, top_k=50, seed=11)
    ar = _run(engine_dir, tok, GUIDES["schema"], params=params)
    oracle = OracleProposer(engine_dir, {i: r.output_ids for i, r in enumerate(ar)}, corrupt_every=3)
    rd = _run(engine_dir, tok, GUIDES["schema"], "redrafter", oracle, params=params)
    assert [r.output_ids for r in rd] == [r.output_ids for r in ar]
    assert all(r.accepted_draft_tokens > 0 for r in rd)
    for r in ar:
        assert r.finish_reason == "length" or _follows(GUIDES["schema"], tok.decode(r.output_ids[:-1]))


def test_the_device_drafter_and_ngram_trees_under_a_grammar(tiny):
    """The tiny engine's own drafter (its beams come back to the host, which masks the tree they make) and the N-gram
    proposer, with the policy choosing widths: constrained AR's tokens."""
    engine_dir, tok = tiny
    ar = _run(engine_dir, tok, GUIDES["schema"])
    for proposer in ("redrafter", "ngram", "mixed"):
        rd = generate(load_engine(engine_dir, speculate="full"), PROMPTS, SamplingConfig(max_tokens=60), "redrafter",
                      proposer=proposer, guide=GUIDES["schema"], stop_ids=(tok.eos_token_id,))
        assert [r.output_ids for r in rd] == [r.output_ids for r in ar], proposer
        assert sum(r.draft_tokens for r in rd) > 0, proposer


def test_guides_mixed_with_free_requests_in_one_batch(tiny):
    engine_dir, tok = tiny
    guides = [GUIDES["regex"], None]
    one = [_run(engine_dir, tok, g)[i].output_ids for i, g in enumerate(guides)]
    both = generate(load_engine(engine_dir), PROMPTS, SamplingConfig(max_tokens=60), "ar", guide=guides,
                    stop_ids=(tok.eos_token_id,))
    assert [r.output_ids for r in both] == one


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor compiles the steps: minutes on 2 cores shared with another worker (CI's -n 2)
def test_constrained_redrafter_compiled_gives_eager_tokens(tiny):
    engine_dir, tok = tiny
    from trt_redrafter.config import RuntimeConfig
    from trt_redrafter.runtime.distributed import Dist
    from trt_redrafter.runtime.engine import Engine

    ar = _run(engine_dir, tok, GUIDES["schema"])
    oracle = OracleProposer(engine_dir, {i: r.output_ids for i, r in enumerate(ar)}, corrupt_every=2)
    # no warm-up: only the variants with grammars compile, when first launched
    engine = Engine.load(engine_dir, Dist(0, 1, torch.device("cpu")),
                         RuntimeConfig(compile="inductor", speculate="full"), proposer=oracle, warmup=False)
    rd = generate(engine, PROMPTS, SamplingConfig(max_tokens=60), "redrafter", guide=GUIDES["schema"],
                  stop_ids=(tok.eos_token_id,))
    assert engine.compiler.mode == "inductor"
    assert [r.output_ids for r in rd] == [r.output_ids for r in ar]
    assert all(r.accepted_draft_tokens > 0 for r in rd)


# ---- refusals -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("guide, words", [
    (Guide(GuideType.JSON_SCHEMA, '{"type": "objec"}'), "invalid json_schema guide"),
    (Guide(GuideType.JSON_SCHEMA, "{not json"), "not JSON"),
    (Guide(GuideType.JSON_SCHEMA, '{"type": "object", "required": "name"}'), "is not of type 'array'"),
    (Guide(GuideType.REGEX, "[a-"), "invalid regex guide"),
    (Guide(GuideType.EBNF, 'root ::= "a" |'), "invalid ebnf_grammar guide"),
])
def test_a_bad_guide_is_refused_in_one_sentence(tiny, guide, words):
    engine_dir, tok = tiny
    with pytest.raises(UserError, match=re.escape(words)):
        _run(engine_dir, tok, guide)


def test_guides_refused_where_they_cannot_hold(tiny, tmp_path):
    engine_dir, tok = tiny
    with pytest.raises(UserError, match="apple"):
        _run(engine_dir, tok, GUIDES["regex"], "redrafter", params=SamplingConfig(temperature=1.0, acceptance="apple"))
    with pytest.raises(UserError, match="guided decoding type must be one of json, json_schema"):
        Guide.parse("xml", "<a/>")
    with pytest.raises(UserError, match="needs its source"):
        Guide.parse("regex", " ")
    assert Grammars(None, VOCAB).words == bitmask.words(VOCAB)
    with pytest.raises(UserError, match="rebuild the engine with build-engine --tokenizer"):
        Grammars(tmp_path / "none", VOCAB).compile(GUIDES["regex"])


def test_a_grammars_end_ends_the_request_even_with_eos_ignored(tiny):
    """With no stop ids (eos ignored, Triton's end_id -1) the grammar still ends the output at its stop token."""
    engine_dir, tok = tiny
    guide = GUIDES["regex"]
    for mode in ("ar", "redrafter"):
        [r] = generate(load_engine(engine_dir), PROMPTS[:1], SamplingConfig(max_tokens=60), mode, guide=guide)
        assert r.finish_reason == "stop" and r.output_ids[-1] == tok.eos_token_id
        assert _follows(guide, tok.decode(r.output_ids[:-1]))


@pytest.mark.mpi
def test_tp2_constrained_gives_the_tp1_tokens(tiny, tmp_path_factory):
    """`trt-redrafter run --regex` under real mpirun at TP 2 against TP 1 (in process), with the tiny drafter."""
    from engine_utils import run_json

    _, engines = build_tiny_engines(tmp_path_factory.mktemp("grammar-tp"), seed=3, num_beams=4, draft_len=3,
                                    vocab_size=VOCAB, max_seq_len=200, kv_block_size=16, tps=(1, 2))
    one = generate(load_engine(engines[1], speculate="full"), PROMPTS, SamplingConfig(max_tokens=30), "redrafter",
                   guide=GUIDES["schema"])
    two = run_json(engines[2], PROMPTS, "redrafter", ("--json-schema", str(_schema_file(tmp_path_factory)),
                                                      "--speculate", "full"), max_new=30, full=True)
    assert [d["output_ids"] for d in two] == [r.output_ids for r in one]
    assert sum(d["draft_tokens"] for d in two) > 0


def _schema_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("schema") / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return path


def test_structural_tags_in_tensorrt_llms_and_xgrammars_forms(tiny):
    """TensorRT-LLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers"}) and xgrammar's own
    format compile, and their matchers take a tool call and refuse a broken one."""
    engine_dir, _ = tiny
    grammars = Grammars(engine_dir / "tokenizer", VOCAB)
    args = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    trtllm = {"structures": [{"begin": "<call>", "schema": args, "end": "</call>"}], "triggers": ["<call>"]}
    own = {"type": "structural_tag", "format": {"type": "tag", "begin": "<call>", "content": {
        "type": "json_schema", "json_schema": args}, "end": "</call>"}}
    for tag in (trtllm, own):
        compiled = grammars.compile(Guide(GuideType.STRUCTURAL_TAG, json.dumps(tag)))
        good, bad = xgrammar.GrammarMatcher(compiled), xgrammar.GrammarMatcher(compiled)
        assert good.accept_string('<call>{"city": "Oslo"}</call>')
        assert not bad.accept_string('<call>{"town": 1}')
    with pytest.raises(UserError, match="invalid structural_tag guide"):
        grammars.compile(Guide(GuideType.STRUCTURAL_TAG, "{not json"))


def test_constrained_requests_with_chunked_prefill_and_prefix_reuse(tiny):
    """Prompts cut into chunks (a request in its prompt phase has no token yet, so no grammar work), and a prompt
    whose prefix comes from the cache: constrained AR's tokens."""
    engine_dir, tok = tiny
    long_prompts = [p * 3 for p in PROMPTS]  # 21 and 60 tokens: several 16-token chunks
    want = [r.output_ids for r in generate(load_engine(engine_dir, enable_chunked_context=False), long_prompts,
                                           SamplingConfig(max_tokens=60), "ar", guide=GUIDES["schema"],
                                           stop_ids=(tok.eos_token_id,))]
    engine = load_engine(engine_dir, max_num_tokens=16)
    for _ in range(2):  # the second time the prompts' blocks are cached
        res = generate(engine, long_prompts, SamplingConfig(max_tokens=60), "redrafter", guide=GUIDES["schema"],
                       stop_ids=(tok.eos_token_id,))
        assert [r.output_ids for r in res] == want
    assert sum(r.cached_tokens for r in res) > 0


def test_constrained_requests_preempted_under_a_small_cache_keep_their_tokens(tiny):
    """A KV cache too small for the batch: requests are preempted and recompute their prompt and output, their
    grammars' state kept; every output is the uncontended constrained one."""
    from trt_redrafter.runtime.scheduler import Request, Scheduler
    from trt_redrafter.runtime.sequence import RequestSpec

    engine_dir, tok = tiny
    prompts = [p * 3 for p in PROMPTS] * 2
    params, stop = SamplingConfig(max_tokens=60), (tok.eos_token_id,)
    want = [r.output_ids for r in generate(load_engine(engine_dir), prompts, params, "ar", stop_ids=stop,
                                           guide=GUIDES["schema"])]
    engine = load_engine(engine_dir, kv_cache_tokens=14 * 16)
    sched = Scheduler(engine)
    reqs = [sched.submit(Request(i, RequestSpec(p, params, stop_ids=stop, guide=GUIDES["schema"])))
            for i, p in enumerate(prompts)]
    sched.run_until_idle()
    assert [r.seq.output for r in reqs] == want
    assert sched.metrics().preemptions > 0 and sum(r.seq.stats.accepted_draft_tokens for r in reqs) > 0


def test_the_warm_up_runs_the_guided_steps_where_asked(tiny):
    """`warmup_guided`: the warm-up launches the AR and tree steps with token bitmasks too (what a constrained request
    would otherwise compile on arrival). Eager here, so the launches are seen, not timed."""
    engine_dir, _ = tiny
    for guided in (False, True):
        engine = load_engine(engine_dir, warmup_guided=guided)  # eager: nothing warmed up at load
        seen = set()
        for name in ("ar_step", "redrafter_step"):
            def spy(*args, _orig=getattr(engine.steps, name), _name=name, **kw):
                bound = inspect.signature(_orig).bind(*args, **kw)
                seen.add((_name, bound.arguments.get("grammar") is not None))  # the bitmasks
                return _orig(*args, **kw)
            setattr(engine.steps, name, spy)
        engine.warmup()
        assert seen == {("ar_step", False), ("redrafter_step", False)} | (
            {("ar_step", True), ("redrafter_step", True)} if guided else set()), guided
