"""Chunked prefill (RuntimeConfig.enable_chunked_context, max_num_tokens): a prompt longer than what a step's token
budget leaves is prefilled over several steps beside the running requests' decode steps. Outputs are the same at
any budget (greedy and seeded, AR, ReDrafter and N-gram, with prefix reuse on), a running stream gets a token every
step while a long prompt arrives, and a budget that cannot work is refused in one sentence."""

from __future__ import annotations

import shutil

import pytest

from engine_utils import build_tiny_engines, chunk_calls, decode_tp, greedy, load_engine, random_prompts
from trt_redrafter.config import SamplingConfig
from trt_redrafter.errors import UserError
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.scheduler import Request, Scheduler
from trt_redrafter.runtime.sequence import RequestSpec

BLOCK = 16
VOCAB = 512
PROMPTS = random_prompts(VOCAB, [60, 9, 45, 3], seed=2)
SAMPLED = SamplingConfig(max_tokens=24, temperature=0.8, top_k=50, seed=7)


@pytest.fixture(scope="module")
def tiny_tp(tmp_path_factory):
    return build_tiny_engines(tmp_path_factory.mktemp("chunked-tp"), seed=5, num_beams=4, draft_len=3,
                              vocab_size=VOCAB, max_seq_len=320, kv_block_size=BLOCK, max_batch_size=4,
                              tps=(1, 2))[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, engines = build_tiny_engines(tmp_path_factory.mktemp("chunked"), seed=5, num_beams=4, draft_len=3,
                                    vocab_size=VOCAB, max_seq_len=320, kv_block_size=BLOCK, max_batch_size=4)
    return engines[1]


@pytest.mark.core
@pytest.mark.parametrize("mode,params,proposer", [("ar", greedy(24), None), ("redrafter", greedy(24), None),
                                                  ("redrafter", greedy(24), "ngram"), ("redrafter", SAMPLED, None)])
def test_outputs_are_the_same_at_any_budget(tiny, mode, params, proposer):
    want = [r.output_ids for r in generate(load_engine(tiny, enable_chunked_context=False), PROMPTS, params, mode,
                                           proposer=proposer)]
    for budget in (BLOCK, 40, 64):
        engine = load_engine(tiny, max_num_tokens=budget)
        chunks = chunk_calls(engine)
        res = generate(engine, PROMPTS, params, mode, proposer=proposer)
        assert [r.output_ids for r in res] == want, budget
        assert chunks and max(chunks) <= max(budget, BLOCK), (budget, chunks)  # prompts were cut into chunks
        assert engine.cache.used_blocks == 0
        if mode == "redrafter":
            assert sum(r.draft_tokens for r in res) > 0


def test_a_running_stream_gets_a_token_every_step_while_a_long_prompt_arrives(tiny):
    engine = load_engine(tiny, max_num_tokens=32, speculate="1")
    sched = Scheduler(engine)
    running = sched.submit(Request("a", RequestSpec(PROMPTS[3], greedy(40), mode="ar")))
    for _ in range(3):
        sched.step_once()
    long = sched.submit(Request("b", RequestSpec(PROMPTS[0], greedy(8), mode="ar")))
    before, steps_to_first = len(running.seq.output), 0
    while not long.seq.output:
        sched.step_once()
        steps_to_first += 1
        assert len(running.seq.output) == before + steps_to_first  # one token each step: never held up
    assert steps_to_first >= 2  # the 60-token prompt took several steps (32 tokens each, a decode beside it)
    sched.run_until_idle()
    alone = generate(load_engine(tiny, enable_chunked_context=False), [PROMPTS[0], PROMPTS[3]], greedy(8), "ar")
    assert long.seq.output == alone[0].output_ids and running.seq.output[:8] == alone[1].output_ids


def test_refusals(tiny):
    with pytest.raises(UserError, match="smaller than one KV block"):
        Scheduler(load_engine(tiny, max_num_tokens=BLOCK - 1))
    sched = Scheduler(load_engine(tiny, max_num_tokens=32, enable_chunked_context=False))
    with pytest.raises(UserError, match="turn on --enable-chunked-context"):
        sched.submit(Request("x", RequestSpec(PROMPTS[0], greedy(4))))


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_tp2_ranks_follow_rank0s_chunks(tiny_tp, tmp_path):
    """Under TP 2 rank 0's scheduler cuts the prompts and its step plans carry the chunks: TP 2 chunked == TP 1
    unchunked, AR and ReDrafter."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")
    runs = {"ar": {"prompts": PROMPTS, "mode": "ar", "max_new": 16},
            "redrafter": {"prompts": PROMPTS, "max_new": 16}}
    want = decode_tp(tiny_tp[1], runs, 1, tmp_path)
    got = decode_tp(tiny_tp[2], {k: {**r, "max_num_tokens": BLOCK} for k, r in runs.items()}, 2, tmp_path)
    for k in runs:
        assert got[k]["output_ids"] == want[k]["output_ids"], k
    assert all(n > 0 for n in got["redrafter"]["draft_tokens"])
