"""In-flight batching: joining mid-run, streaming callbacks, cancellation, FCFS admission and KV preemption never
change a request's greedy output."""

from __future__ import annotations

import pytest

from engine_utils import OracleProposer, build_tiny_engines, greedy, load_engine, random_prompts
from trt_redrafter.errors import ServerBusy, UserError
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.sequence import RequestSpec
from trt_redrafter.runtime.scheduler import Request, Scheduler

MAX_NEW = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, engines = build_tiny_engines(tmp_path_factory.mktemp("sched"), seed=8, num_beams=3, draft_len=3,
                                    max_batch_size=4, kv_block_size=8, num_heads=4, num_kv_heads=2, rnn=True)
    engine = load_engine(engines[1])
    prompts = random_prompts(engine.cfg.checkpoint.model.vocab_size, [6, 13, 4, 9, 11, 7], seed=2)
    ar = [r.output_ids for r in generate(engine, prompts, greedy(MAX_NEW), mode="ar")]
    return engines[1], prompts, ar


def _collect(sched, reqs):
    streamed = {r.request_id: [] for r in reqs}
    finals = {}

    def on_tokens(req, toks, finished):
        streamed[req.request_id] += toks
        if finished:
            finals[req.request_id] = finals.get(req.request_id, 0) + 1

    for r in reqs:
        r.on_tokens = on_tokens
    return streamed, finals


def test_requests_joining_mid_run_keep_their_greedy_output(tiny):
    engine_dir, prompts, ar = tiny
    engine = load_engine(engine_dir, OracleProposer(engine_dir, dict(enumerate(ar)), corrupt_every=3))
    sched = Scheduler(engine)
    reqs = [Request(i, RequestSpec(p, greedy(MAX_NEW))) for i, p in enumerate(prompts)]
    streamed, finals = _collect(sched, reqs)
    sched.submit(reqs[0])
    for _ in range(3):
        sched.step_once()  # request 0 is mid-generation when the others arrive (prefill mixed with drafts)
    for r in reqs[1:]:
        sched.submit(r)
    sched.run_until_idle()
    assert [streamed[r.request_id] for r in reqs] == ar
    assert [r.seq.output for r in reqs] == ar
    assert all(finals[r.request_id] == 1 for r in reqs)
    assert engine.cache.used_blocks == 0 and sched.metrics().running == 0


def test_cancellation_frees_kv_at_the_next_step_and_others_continue(tiny):
    engine_dir, prompts, ar = tiny
    engine = load_engine(engine_dir)
    sched = Scheduler(engine)
    reqs = [Request(str(i), RequestSpec(p, greedy(MAX_NEW))) for i, p in enumerate(prompts[:2])]
    streamed, finals = _collect(sched, reqs)
    for r in reqs:
        sched.submit(r)
    for _ in range(3):
        sched.step_once()
    held = engine.cache.used_blocks
    assert sched.cancel("0")
    sched.step_once()
    assert reqs[0].seq.finish_reason == "cancelled" and reqs[0].done.is_set() and finals["0"] == 1
    assert engine.cache.used_blocks < held and not engine.cache.has(reqs[0].seq.seq_id)
    sched.run_until_idle()
    assert streamed["1"] == ar[1] and engine.cache.used_blocks == 0
    assert not sched.cancel("1")  # finished requests are no longer known


def test_kv_preemption_recomputes_without_changing_outputs(tiny):
    engine_dir, prompts, ar = tiny
    # room for about two requests: the other four wait, and running ones get preempted as they grow
    engine = load_engine(engine_dir, kv_cache_tokens=2 * (13 + MAX_NEW + 10) + 64)
    sched = Scheduler(engine)
    reqs = [sched.submit(Request(i, RequestSpec(p, greedy(MAX_NEW)))) for i, p in enumerate(prompts)]
    streamed, _ = _collect(sched, reqs)
    sched.run_until_idle()
    assert sched.metrics().preemptions > 0
    assert [streamed[r.request_id] for r in reqs] == ar
    assert engine.cache.used_blocks == 0


def test_fcfs_admission_is_bounded_by_batch_size_and_token_budget(tiny):
    engine_dir, prompts, _ = tiny
    engine = load_engine(engine_dir, enable_chunked_context=False)  # whole prompts only (chunks: test_chunked_prefill)
    sched = Scheduler(engine, max_num_tokens=18)  # the 13-token prompt cannot join the 6-token one in a step
    for i, p in enumerate(prompts):
        sched.submit(Request(i, RequestSpec(p, greedy(4))))
    sched.step_once()
    m = sched.metrics()
    assert (m.running, m.waiting) == (1, 5)  # request 1 blocks the shorter ones behind it: no overtaking
    sched.run_until_idle()
    assert sched.metrics().finished == len(prompts)


def test_a_request_that_can_never_fit_the_kv_cache_is_refused(tiny):
    engine_dir, prompts, _ = tiny
    engine = load_engine(engine_dir, kv_cache_tokens=48)
    with pytest.raises(UserError, match="max-tokens-in-paged-kv-cache"):
        Scheduler(engine).submit(Request("x", RequestSpec(prompts[1], greedy(MAX_NEW))))


def test_one_id_names_a_request_from_the_client_to_the_kv_cache(tiny):
    """The scheduler admits a request under its own id: the engine's sequence, the TP plan and the KV cache's blocks
    are all keyed by Request.request_id (a Triton key here), not by a second, engine-made number."""
    engine_dir, prompts, _ = tiny
    engine = load_engine(engine_dir)
    sched = Scheduler(engine)
    reqs = [sched.submit(Request(f"triton-{i}", RequestSpec(p, greedy(4)))) for i, p in enumerate(prompts[:2])]
    sched.step_once()
    assert [r.seq.seq_id for r in reqs] == ["triton-0", "triton-1"]
    assert all(engine.cache.has(r.request_id) for r in reqs)
    with pytest.raises(ValueError, match="triton-0"):  # a second live sequence may not take an id in flight
        engine.new_sequence(RequestSpec(prompts[0], greedy(4)), seq_id="triton-0")
    sched.run_until_idle()
    assert not any(engine.cache.has(r.request_id) for r in reqs)


def test_max_queue_size_refuses_beyond_the_waiting_limit_and_serves_the_rest(tiny):
    """Requests waiting for a batch slot beyond max_queue_size are refused with ServerBusy at once (a batch of
    prompts as a whole); once the running batch takes the waiting ones, more are accepted; the accepted keep their
    greedy output."""
    engine_dir, prompts, ar = tiny
    engine = load_engine(engine_dir)
    sched = Scheduler(engine, max_queue_size=2)
    reqs = [Request(i, RequestSpec(p, greedy(MAX_NEW))) for i, p in enumerate(prompts)]
    sched.submit(reqs[0])
    with pytest.raises(ServerBusy, match=r"server busy: 1 requests .*max_queue_size=2"):
        sched.submit_all(reqs[1:3])  # 1 + 2 > 2: all or none
    sched.submit(reqs[1])
    with pytest.raises(ServerBusy, match="max_queue_size=2"):
        sched.submit(reqs[2])
    assert sched.metrics().waiting == 2
    sched.step_once()  # both waiting ones join the running batch (max_batch_size 4): the queue is empty again
    sched.submit_all(reqs[2:4])
    with pytest.raises(ServerBusy):
        sched.submit(reqs[4])
    sched.run_until_idle()
    assert [r.seq.output for r in reqs[:4]] == ar[:4]
    assert engine.cache.used_blocks == 0
