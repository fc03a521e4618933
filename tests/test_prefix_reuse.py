"""Prefix reuse of the KV cache (runtime/kv_cache.py, RuntimeConfig.kv_cache_reuse): full blocks of committed tokens
are kept, keyed by the hash chain of their tokens, and a request whose text starts with them prefills only the rest.
Outputs are the same with reuse on and off (greedy and seeded sampling, AR and ReDrafter, shared system prompts,
a conversation's second turn over the first turn's answer, eviction, preemption), nothing leaks between requests
that share a prefix, and each request reports what it reused."""

from __future__ import annotations

import pytest
import torch

from engine_utils import build_tiny_engines, greedy, load_engine, random_prompts
from trt_redrafter.config import SamplingConfig
from trt_redrafter.runtime.generate import generate
from trt_redrafter.runtime.kv_cache import KVCacheFull, PagedKVCache
from trt_redrafter.runtime.scheduler import Request, Scheduler
from trt_redrafter.runtime.sequence import RequestSpec

BLOCK = 16
VOCAB = 512


def _cache(num_blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(1, num_blocks, 4, 1, 2, torch.float32, torch.device("cpu"), max_slots=4, max_blocks_per_seq=8,
                        reuse=True)


def test_the_cache_keys_full_blocks_and_hands_them_to_a_request_that_starts_alike():
    c = _cache()
    text = list(range(10))  # blocks [0-3], [4-7] full, [8, 9] partial
    assert c.claim_prefix("a", text) == 0
    c.reserve("a", 10)
    c.commit("a", text)
    b_text = text[:8] + [99, 98, 97]
    assert c.claim_prefix("b", b_text) == 8  # both full blocks, the partial one not
    assert c.blocks("b") == c.blocks("a")[:2] and c.stats["reused_blocks"] == 2
    c.reserve("b", len(b_text))
    assert c.blocks("b")[2] != c.blocks("a")[2]  # its own block from the first new position
    other = [1] + text[1:8]  # a different first block: the chain differs from the start
    assert c.claim_prefix("c", other) == 0
    c.free("c")


def test_a_prompt_ending_on_a_block_boundary_keeps_its_last_token_to_compute():
    c = _cache()
    text = list(range(8))  # exactly two blocks
    c.claim_prefix("a", text)
    c.reserve("a", 8)
    c.commit("a", text)
    c.free("a")
    assert c.claim_prefix("b", text) == 4  # the second block holds the last token, whose logits the step needs
    assert c.claim_prefix("c", text + [8]) == 8


def test_a_cache_salt_shares_blocks_only_with_requests_of_the_same_salt():
    c = _cache()
    text = list(range(9))
    for sid, salt in (("a", ""), ("b", "tenant-1")):
        assert c.claim_prefix(sid, text, salt=salt) == 0
        c.reserve(sid, 9)
        c.commit(sid, text)  # under the salt it claimed with
    assert c.claim_prefix("c", text, salt="tenant-2") == 0  # another salt: nothing
    assert c.claim_prefix("d", text, salt="tenant-1") == 8 and c.blocks("d") == c.blocks("b")[:2]
    assert c.claim_prefix("e", text) == 8 and c.blocks("e") == c.blocks("a")[:2]  # no salt: the unsalted blocks


def test_released_blocks_stay_cached_until_evicted_least_recently_released_first():
    c = _cache(num_blocks=4)
    for sid, first in (("a", 0), ("b", 100)):
        text = list(range(first, first + 8))
        c.claim_prefix(sid, text)
        c.reserve(sid, 8)
        c.commit(sid, text)
        c.free(sid)  # a's two blocks released first, then b's
    assert c.used_blocks == 0 and c.cached_blocks == 4 and c.free_blocks == 4
    c.reserve("x", 4)  # no free block left: the least recently released goes (a's last block: a's tail first)
    assert c.stats["evicted_blocks"] == 1
    assert c.claim_prefix("a2", list(range(9))) == 4  # a's first block survives, its second was evicted
    assert c.claim_prefix("b2", list(range(100, 109))) == 8
    with pytest.raises(KVCacheFull):
        c.reserve("y", 4 * 4)


def test_a_shared_block_is_held_until_its_last_holder_releases_it():
    c = _cache(num_blocks=3)
    text = list(range(5))
    c.claim_prefix("a", text)
    c.reserve("a", 5)
    c.commit("a", text)
    assert c.claim_prefix("b", text) == 4
    c.reserve("b", 5)
    c.free("a")
    assert c.used_blocks == 2  # b's own block and the shared one, still held by b
    c.reserve("c", 4)  # the last block: a's released own block, not the shared one
    assert c.claim_prefix("d", text) == 4
    c.free("b")
    c.free("d")
    assert c.cached_blocks == 1 and c.used_blocks == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, engines = build_tiny_engines(tmp_path_factory.mktemp("reuse"), seed=5, num_beams=4, draft_len=3,
                                    vocab_size=VOCAB, max_seq_len=320, kv_block_size=BLOCK, max_batch_size=4)
    return engines[1]


SYSTEM = random_prompts(VOCAB, [37], seed=9)[0]  # a shared "system prompt" of 2 full blocks and change
USERS = random_prompts(VOCAB, [5, 9, 16, 3], seed=2)
SAMPLED = SamplingConfig(max_tokens=24, temperature=0.8, top_k=50, seed=7)


def _conversation(engine, mode: str, params, proposer=None) -> list[list[int]]:
    """Four requests over one system prompt (one at a time, then three together), then a second turn over the
    first one's answer -> every output."""
    first = generate(engine, [SYSTEM + USERS[0]], params, mode, proposer=proposer)
    rest = generate(engine, [SYSTEM + u for u in USERS[1:]], params, mode, proposer=proposer)
    history = SYSTEM + USERS[0] + first[0].output_ids[:18] + [7, 8, 9]
    second = generate(engine, [history], params, mode, proposer=proposer)
    return [r.output_ids for r in first + rest + second], [r.cached_tokens for r in first + rest + second]


@pytest.mark.core
@pytest.mark.parametrize("mode,params,proposer", [("ar", greedy(24), None), ("redrafter", greedy(24), None),
                                                  ("redrafter", greedy(24), "ngram"), ("ar", SAMPLED, None),
                                                  ("redrafter", SAMPLED, None)])
def test_outputs_are_the_same_with_reuse_on_and_off(tiny, mode, params, proposer):
    off, cached_off = _conversation(load_engine(tiny, kv_cache_reuse=False), mode, params, proposer)
    on_engine = load_engine(tiny)
    on, cached = _conversation(on_engine, mode, params, proposer)
    assert on == off
    assert cached_off == [0] * 5
    # the system prompt's two full blocks for every later request; the second turn also reuses the first turn's
    # answer, written by decode steps (a cold run computes those positions in its prompt step)
    assert cached[0] == 0 and cached[1:4] == [2 * BLOCK] * 3 and cached[4] == 3 * BLOCK
    assert on_engine.cache.stats["reused_blocks"] == 2 * 3 + 3 and on_engine.cache.used_blocks == 0


def test_a_request_with_its_own_salt_reuses_nothing_and_decodes_the_same(tiny):
    """A unique `cache_salt` is how one request opts out of reuse (vLLM's isolation between tenants)."""
    engine = load_engine(tiny)
    prompt = SYSTEM + USERS[0]

    def run(salt: str):
        sched = Scheduler(engine)
        req = sched.submit(Request(salt or "none", RequestSpec(prompt, greedy(8), "redrafter", cache_salt=salt)))
        sched.run_until_idle()
        return req.seq.output, req.seq.stats.cached_tokens

    first = run("")
    assert run("tenant-a") == (first[0], 0)  # another salt: a cold prefill, the same tokens
    assert run("tenant-a")[1] == 2 * BLOCK  # the same salt again: its own blocks
    assert run("")[1] == 2 * BLOCK


@pytest.mark.core
def test_requests_sharing_a_prefix_get_what_each_gets_alone(tiny):
    """Concurrent requests over one cached prefix, each with its own continuation: no request sees another's K/V."""
    alone = [generate(load_engine(tiny, kv_cache_reuse=False), [SYSTEM + u], greedy(24), "redrafter")[0].output_ids
             for u in USERS]
    engine = load_engine(tiny)
    generate(engine, [SYSTEM + [11]], greedy(4), "ar")  # puts the system prompt's blocks in the cache
    together = generate(engine, [SYSTEM + u for u in USERS], greedy(24), "redrafter")
    assert [r.output_ids for r in together] == alone
    assert all(r.cached_tokens == 2 * BLOCK for r in together)
    assert sum(r.accepted_draft_tokens for r in together) >= 0 and sum(r.draft_tokens for r in together) > 0


def test_eviction_and_preemption_under_a_small_cache_keep_the_outputs(tiny):
    """A cache of 10 blocks for 4 requests of ~4 blocks: cached blocks are evicted, running requests preempted and
    recomputed (reusing what is still cached), and every output is the uncontended one."""
    prompts = [SYSTEM + u for u in USERS]
    want = [r.output_ids for r in generate(load_engine(tiny, kv_cache_reuse=False), prompts, greedy(24), "ar")]
    engine = load_engine(tiny, kv_cache_tokens=10 * BLOCK)
    sched = Scheduler(engine)
    for round_ in range(2):  # twice: the second round finds some of the first round's blocks cached, others evicted
        reqs = [sched.submit(Request((round_, i), RequestSpec(p, greedy(24)))) for i, p in enumerate(prompts)]
        sched.run_until_idle()
        assert [r.seq.output for r in reqs] == want
    assert sched.metrics().preemptions > 0
    assert engine.cache.stats["evicted_blocks"] > 0 and engine.cache.stats["reused_blocks"] > 0
    assert engine.cache.used_blocks == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_outputs_are_the_same_with_reuse_on_and_off(tiny):
    """Reused blocks written by compiled decode steps (inductor) against a cold run's eager prompt step."""
    torch._dynamo.reset()
    off, _ = _conversation(load_engine(tiny, kv_cache_reuse=False), "redrafter", greedy(24))
    on, cached = _conversation(load_engine(tiny, compile="inductor"), "redrafter", greedy(24))
    assert on == off and cached[4] == 3 * BLOCK


def test_reuse_is_off_where_it_cannot_hold(tiny):
    from trt_redrafter.runtime.loading import prefix_reuse

    assert prefix_reuse(True, 1, False, False) and not prefix_reuse(False, 1, False, False)
    assert not prefix_reuse(True, 2, False, False)  # TP: not yet
    assert not prefix_reuse(True, 1, True, False)  # dynamic-NTK RoPE rotates a prompt by its length
    assert not prefix_reuse(True, 1, False, True)  # the trainer records every prompt token's hidden state
    assert load_engine(tiny).cache.reuse and not load_engine(tiny, kv_cache_reuse=False).cache.reuse


@pytest.mark.server
def test_bench_reuse_replays_conversations_and_a_shared_prompt_with_reuse_on_and_off(tmp_path):
    """`trt-redrafter bench-reuse` as a user runs it: two real servers (reuse on and off), the openai client, MT-Bench
    conversations (turn 2 over turn 1's answer) and requests sharing a system prompt. Turn 2 and the shared prompt
    find cached tokens only with reuse on, and the outputs are the same on both servers."""
    import json
    import subprocess
    import sys

    from trt_redrafter.serving.launcher import find_tritonserver, package_env

    pytest.importorskip("openai")
    try:
        find_tritonserver()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no tritonserver binary: {e}")
    _, engines = build_tiny_engines(tmp_path / "e", seed=5, num_beams=2, draft_len=2, vocab_size=VOCAB,
                                    max_seq_len=320, kv_block_size=BLOCK, max_batch_size=4,
                                    build_args=("--max-input-len", 300))
    engine = engines[1]
    dataset = tmp_path / "questions.jsonl"  # MT-Bench's layout, short enough for the tiny engine's 300 tokens
    dataset.write_text("".join(json.dumps({"turns": [f"Question {i}: name a colour.", "And another one?"]}) + "\n"
                               for i in range(4)))
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "trt_redrafter", "bench-reuse", "--engine", str(engine),
                           "--dataset", str(dataset),
                           "--conversations", "2", "--max-tokens", "24", "--shared-requests", "4",
                           "--shared-tokens", "60", "--concurrency", "2", "--compile", "off", "--output", str(out)],
                          capture_output=True, text=True, timeout=600, env=package_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    conv, shared = doc["conversation"], doc["shared_prefix"]
    assert conv["identical_outputs"] and shared["identical_outputs"]
    assert "Outputs identical with and without reuse: yes" in proc.stdout
    cached = {(r["mode"], r["turn"], r["server"]): r["cached_share"] for r in conv["rows"]}
    assert all(cached[(m, "turn2", "reuse")] > 0 and cached[(m, "turn2", "no-reuse")] == 0 for m in ("ar", "redrafter"))
    assert len(conv["requests"]) == 2 * 2 * 2 * 2  # conversations x modes x servers x turns
    rows = {(r["mode"], r["server"]): r for r in shared["rows"]}
    assert all(rows[(m, "reuse")]["cached_share"] > 0 and rows[(m, "no-reuse")]["cached_share"] == 0
               for m in ("ar", "redrafter"))
