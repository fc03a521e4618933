"""In-flight batching: a request queue in front of the engine; new requests join running ones between steps.

Policy (first come, first served, no starvation):
  * Between steps, cancelled requests are finished and their KV blocks freed, then waiting requests are
    admitted in arrival order while the batch stays within `max_batch_size`, the step within `max_num_tokens`
    and the KV cache has the blocks their prompt needs. A request that does not fit blocks the ones behind it,
    so a long prompt is never overtaken indefinitely.
  * A step mixes the prompt processing of newly admitted requests with ReDrafter (or AR) steps of running ones.
  * If the KV cache runs out while running requests grow, the most recently admitted one is preempted: its
    blocks are freed and it re-queues at the front, to resume by recomputing its prompt + output (vLLM's
    recompute preemption). Tokens already streamed are never taken back.

With TP > 1 the scheduler runs on rank 0 and broadcasts each step's plan; `follow` runs the same steps on the
other ranks. The scheduler knows nothing about text or Triton: token ids in, callbacks out.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

from ..errors import ServerBusy, UserError
from ..log import get_logger
from .distributed import COLLECTIVE_TIMEOUT_S
from .engine import Engine
from .kv_cache import KVCacheFull
from .policy import AR_STEP, StepDecision
from .sequence import RequestSpec, Sequence

logger = get_logger(__name__)

# An idle driver pings its followers this often, well inside the collective timeout (distributed.py), so a TP > 1
# server with no traffic keeps its ranks.
HEARTBEAT_S = min(10.0, COLLECTIVE_TIMEOUT_S / 4)

OnTokens = Callable[["Request", list[int], bool], None]  # (request, new tokens, finished)


@dataclass
class PlannedRequest:
    """One request of a step plan: what a follower rank needs to make (or find) the same Sequence."""

    seq_id: Hashable  # the request's id
    spec: RequestSpec
    output: list[int]  # tokens emitted so far (a request re-admitted after preemption resumes from them)
    prefill_chunk: int = 0  # in its prompt phase: the tokens this step computes (0: the rest of its prompt)

    @classmethod
    def of(cls, s: Sequence) -> "PlannedRequest":
        return cls(s.seq_id, s.spec, s.output, s.prefill_chunk)


@dataclass
class StepPlan:
    """What rank 0 broadcasts before each step: the requests of the step, in batch order, and its speculation
    policy's decision for the step (every rank runs the same step: a policy fed by per-rank timings could not
    differ)."""

    requests: list[PlannedRequest]
    decision: StepDecision = field(default_factory=lambda: AR_STEP)


@dataclass
class Request:
    """A request in the scheduler: its spec, where its tokens go, and its place in the queue."""

    request_id: Hashable  # unique among the scheduler's requests (the Triton model's key, generate's index)
    spec: RequestSpec
    on_tokens: Optional[OnTokens] = None
    seq: Optional[Sequence] = None  # set on submission
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: Optional[str] = None  # why it is ended early: "cancelled" (its client went away) or "stopped" (a stop
    # request: it ends with the tokens it has, as TensorRT-LLM's early stopping does)
    scheduled_ns: Optional[int] = None  # wall clock (time.time_ns) when first admitted into the running batch
    kv_blocks: int = 0  # the most KV blocks the request held at once


@dataclass
class SchedulerMetrics:
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int
    finished: int
    accepted_draft_tokens: int
    generation_steps: int
    preemptions: int
    context_requests: int = 0  # running requests whose prompt has not been processed yet
    context_tokens: int = 0  # their prompt tokens
    max_batch_size: int = 0
    block_size: int = 0
    kv_blocks_reused: int = 0  # blocks requests took from the prefix cache, since the engine was loaded
    kv_blocks_cached: int = 0  # released keyed blocks kept for reuse (counted free: evicted when needed)
    kv_blocks_new: int = 0  # blocks requests were given fresh, since the engine was loaded

    @property
    def kv_cache_hit_rate(self) -> float:
        """Of the blocks requests needed since load, the share the prefix cache supplied."""
        n = self.kv_blocks_reused + self.kv_blocks_new
        return self.kv_blocks_reused / n if n else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Acceptance length: tokens a generation step emits on average (accepted drafts + 1)."""
        return 1.0 + self.accepted_draft_tokens / self.generation_steps if self.generation_steps else 0.0


class Scheduler:
    def __init__(self, engine: Engine, max_num_tokens: int | None = None, max_queue_size: int = 0):
        """max_queue_size: requests that may wait for a batch slot (not counting running ones) before `submit`
        refuses more with `ServerBusy` (TensorRT-LLM's `max_queue_size`); 0 = no limit."""
        if max_queue_size < 0:
            raise UserError(f"max_queue_size must be >= 0 (0: no limit), got {max_queue_size}.")
        self.engine = engine
        self.max_queue_size = max_queue_size
        self.max_batch_size = engine.build.max_batch_size
        self.max_num_tokens = (max_num_tokens or engine.runtime.max_num_tokens
                               or engine.build.resolved_max_num_tokens(engine.tree))
        self.chunked = engine.runtime.enable_chunked_context
        if self.chunked and self.max_num_tokens < engine.cache.block_size:
            raise UserError(f"max_num_tokens={self.max_num_tokens} is smaller than one KV block "
                            f"({engine.cache.block_size} tokens), too small a budget to prefill prompts in chunks; "
                            f"raise --max-num-tokens to at least {engine.cache.block_size}.")
        self._lock = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._by_id: dict[Hashable, Request] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._steps = self._finished = self._accepted = self._gen_steps = self._preemptions = 0

    # ---- client side (any thread) ----------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Validate and queue a request; raises UserError for a request the engine cannot serve."""
        return self.submit_all([req])[0]

    def submit_all(self, reqs: list[Request]) -> list[Request]:
        """Validate every request, then queue them all or none (one Triton request with a batch of prompts is
        answered as a whole); raises UserError naming the first request the engine cannot serve."""
        for req in reqs:
            req.seq = self.engine.new_sequence(req.spec, seq_id=req.request_id)
            n, max_tokens = len(req.spec.prompt), req.spec.params.max_tokens
            if n > self.max_num_tokens and not self.chunked:
                raise UserError(f"the prompt has {n} tokens but one step may hold at most "
                                f"max_num_tokens={self.max_num_tokens}; shorten it, raise --max-num-tokens or turn "
                                f"on --enable-chunked-context.")
            worst = n + max_tokens + self.engine.tree.max_tree_tokens
            if not self.engine.cache.can_fit(worst):
                raise UserError(f"a {n}-token prompt with max_tokens={max_tokens} needs more "
                                f"KV cache than the engine has ({self.engine.cache.num_blocks} blocks of "
                                f"{self.engine.cache.block_size} tokens); ask for fewer tokens or rebuild the engine "
                                f"with a larger --max-tokens-in-paged-kv-cache.")
        with self._lock:
            if self.max_queue_size and len(self._waiting) + len(reqs) > self.max_queue_size:
                raise ServerBusy(f"server busy: {len(self._waiting)} requests are already waiting for a batch slot "
                                 f"(max_queue_size={self.max_queue_size}); retry later.")
            ids = [r.request_id for r in reqs]
            if len(set(ids)) != len(ids) or any(i in self._by_id for i in ids):
                raise ValueError(f"a request id of {ids!r} is already in flight")
            for req in reqs:
                self._by_id[req.request_id] = req
                self._waiting.append(req)
            self._lock.notify_all()
        return reqs

    def cancel(self, request_id: Hashable, stop: bool = False) -> bool:
        """End a request before the next step (its KV blocks freed): cancelled, or with `stop` stopped (it finishes
        with finish_reason "stopped" and the tokens it has). False if unknown/finished."""
        with self._lock:
            req = self._by_id.get(request_id)
            if req is None:
                return False
            req.cancelled = "stopped" if stop else "cancelled"
            self._lock.notify_all()
            return True

    def cancel_all(self) -> None:
        with self._lock:
            for req in self._by_id.values():
                req.cancelled = "cancelled"
            self._lock.notify_all()

    def metrics(self) -> SchedulerMetrics:
        c = self.engine.cache
        with self._lock:
            context = [r for r in self._running if not r.seq.output]
            return SchedulerMetrics(len(self._waiting), len(self._running), c.used_blocks, c.num_blocks, self._steps,
                                    self._finished, self._accepted, self._gen_steps, self._preemptions,
                                    len(context), sum(len(r.spec.prompt) for r in context), self.max_batch_size,
                                    c.block_size, c.stats["reused_blocks"], c.cached_blocks, c.stats["new_blocks"])

    # ---- the loop (one thread) ---------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self.run_forever, name="trt-redrafter-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def run_forever(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._lock:
                while not self._stop and not self._waiting and not self._running and not self._any_cancelled():
                    self._lock.wait(timeout=1.0)
                    if time.monotonic() - idle_since > HEARTBEAT_S:
                        break
                if self._stop:
                    break
                idle = not self._waiting and not self._running and not self._any_cancelled()
            if idle:  # keep follower ranks' pending collective from timing out on an idle server
                self.engine.dist.broadcast_object(("ping", None))
            else:
                self.step_once()
            idle_since = time.monotonic()
        self.engine.dist.broadcast_object(None)  # tell followers to exit

    def run_until_idle(self) -> None:
        """Step until nothing is waiting or running (offline use and tests)."""
        while True:
            with self._lock:
                if not self._waiting and not self._running:
                    return
            self.step_once()

    def step_once(self) -> None:
        with self._lock:
            self._reap_cancelled()
            self._admit()
            batch = [r for r in self._running]
        if not batch:
            assert not self._waiting, "a waiting request cannot be admitted into an empty batch"
            return
        running = self._chunks(self._reserve())
        seqs = [r.seq for r in running]
        plan = StepPlan([PlannedRequest.of(s) for s in seqs], self.engine.decide(seqs))
        self.engine.dist.broadcast_object(("step", plan))
        events = self.engine.step(seqs, plan.decision)
        self._steps += 1
        for req, ev in zip(running, events):
            if req.on_tokens is not None:
                req.on_tokens(req, ev.new_tokens, ev.finished)
            if ev.finished:
                self._retire(req)

    # ---- internals (scheduler thread) --------------------------------------------------------------------
    def _any_cancelled(self) -> bool:
        return any(r.cancelled for r in self._by_id.values())

    def _reap_cancelled(self) -> None:
        for req in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(req)
            self._finish_cancelled(req)
        for req in [r for r in self._running if r.cancelled]:
            self._running.remove(req)
            self.engine.slots.release(req.seq)
            self._finish_cancelled(req)

    def _finish_cancelled(self, req: Request) -> None:
        req.seq.finish(req.cancelled or "cancelled")
        self._by_id.pop(req.request_id, None)
        self.engine.dist.broadcast_object(("free", req.seq.seq_id))
        if req.on_tokens is not None:
            req.on_tokens(req, [], True)
        req.done.set()

    def _step_tokens(self, seq: Sequence) -> int:
        return self.engine.slots.tokens_needed(seq) - seq.ctx_len

    def _chunks(self, running: list[Request]) -> list[Request]:
        """The requests of this step and, with chunked prefill, how much of each prompt it computes: decode steps
        first, then prompts in arrival order, each as much of its rest as the step's token budget leaves (the
        first one at least a block, so a prompt always advances). A prompt the budget leaves no room for sits the
        step out."""
        if not self.chunked:
            return running
        left = self.max_num_tokens - sum(self._step_tokens(r.seq) for r in running if not r.seq.in_prompt_phase)
        first, out = True, []
        for r in running:
            s = r.seq
            if s.in_prompt_phase:
                rest = len(s.prompt) + len(s.output) - s.prefix_len
                chunk = min(rest, max(left, self.engine.cache.block_size if first else 0))
                first = False
                if chunk <= 0:
                    continue
                s.prefill_chunk = 0 if chunk == rest else chunk
                left -= chunk
            out.append(r)
        return out

    def _admit(self) -> None:
        budget = self.max_num_tokens - sum(self._step_tokens(r.seq) for r in self._running)
        cache = self.engine.cache
        free = cache.free_blocks
        while self._waiting and len(self._running) < self.max_batch_size:
            req = self._waiting[0]
            need_tokens = self._step_tokens(req.seq)
            if self.chunked:  # a prompt joins as soon as the step has room for a chunk of it
                need_tokens = min(need_tokens, max(budget, 1))
            # the prompt, plus room for one draft tree so the request can take its first generation step
            need_blocks = cache.blocks_needed(req.seq.seq_id, self.engine.slots.tokens_needed(req.seq)
                                              + self.engine.tree.max_tree_tokens)
            if need_tokens > budget or need_blocks > free:
                break
            self._waiting.popleft()
            self._running.append(req)
            if req.scheduled_ns is None:
                req.scheduled_ns = time.time_ns()
            budget -= need_tokens
            free -= need_blocks

    def _reserve(self) -> list[Request]:
        """Reserve KV for every running request's next step, preempting the newest ones if the cache is full -> the
        requests of this step."""
        while True:
            try:
                for req in self._running:
                    self.engine.slots.reserve(req.seq)
                    req.kv_blocks = max(req.kv_blocks, len(self.engine.cache.blocks(req.seq.seq_id)))
                return list(self._running)
            except KVCacheFull:
                if len(self._running) == 1:
                    raise
                self._preempt(self._running[-1])

    def _preempt(self, req: Request) -> None:
        with self._lock:
            self._running.remove(req)
            self._waiting.appendleft(req)
            self._preemptions += 1
        self.engine.slots.release(req.seq)
        self.engine.dist.broadcast_object(("free", req.seq.seq_id))
        self.engine.slots.restart(req.seq)
        logger.info("preempted request %s (KV cache full); it will resume by recomputation", req.request_id)

    def _retire(self, req: Request) -> None:
        st = req.seq.stats
        with self._lock:
            self._running.remove(req)
            self._by_id.pop(req.request_id, None)
            self._finished += 1
            self._accepted += st.accepted_draft_tokens
            self._gen_steps += st.steps
        self.engine.slots.release(req.seq)
        req.done.set()


def follow(engine: Engine) -> None:
    """Non-driver ranks: mirror rank 0's scheduler, one broadcast plan at a time, until it says stop."""
    seqs: dict[Hashable, Sequence] = {}
    while True:
        msg = engine.dist.broadcast_object(None)
        if msg is None:
            return
        kind, body = msg
        if kind == "ping":
            continue
        if kind == "free":
            s = seqs.pop(body, None)
            if s is not None:
                engine.slots.release(s)
            continue
        batch = []
        for r in body.requests:
            s = seqs.get(r.seq_id)
            if s is None:  # newly admitted, or re-admitted after preemption (then it resumes from its output)
                s = engine.new_sequence(r.spec, seq_id=r.seq_id)
                s.output = list(r.output)
                seqs[r.seq_id] = s
            s.prefill_chunk = r.prefill_chunk
            batch.append(s)
        for ev in engine.step(batch, body.decision):
            if ev.finished:
                engine.slots.release(seqs.pop(ev.seq_id))
