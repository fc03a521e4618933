"""The engine model's Prometheus metrics (Triton custom metrics, next to `nv_inference_*` on /metrics).

    trt_redrafter_active_requests       gauge      requests in the running batch
    trt_redrafter_waiting_requests      gauge      requests queued for admission
    trt_redrafter_kv_blocks_used        gauge      paged KV-cache blocks in use
    trt_redrafter_kv_blocks_total       gauge      paged KV-cache blocks in all
    trt_redrafter_kv_blocks_cached      gauge      released blocks kept for prefix reuse (free: evicted when needed)
    trt_redrafter_kv_cache_hit_rate     gauge      of the blocks requests needed since load, the share reused
    trt_redrafter_tokens_per_step       histogram  acceptance length: tokens one generation step emitted
    trt_redrafter_mean_tokens_per_step  gauge      the same, averaged over finished requests
    trt_redrafter_requests_total        counter    finished requests by outcome (completed|cancelled|rejected|busy)
    trt_redrafter_generated_tokens_total counter   tokens streamed to clients

Next to them, the families TensorRT-LLM's backend exports, with its names, help texts and labels (`model`,
`version`, and the family's category label; tensorrtllm_backend custom_metrics_reporter.cc @ c1e1963), so dashboards
built on the stock backend read this server too:

    nv_trt_llm_request_metrics{request_type=active|max|scheduled|context|waiting}          gauge
    nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max|free|used|tokens_per|reused|fraction}  gauge
    nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric=total_context_tokens|generation_requests|
                                        micro_batch_id|paused_requests}                   gauge
    nv_trt_llm_general_metrics{general_type=timestamp|iteration_counter}                  gauge
    nv_llm_input_token_len{response_metric_type=total_input_tokens}                      histogram, per request
    nv_llm_output_token_len{response_metric_type=total_output_tokens}                    histogram, per request

(`nv_trt_llm_runtime_memory_metrics` and the disaggregated-serving family are not exported: this runtime has no
TensorRT memory pools and no disaggregated serving.)

`ServingMetrics` takes the metric-family class as an argument (`pb_utils.MetricFamily` inside Triton, a fake in
unit tests), so it imports without Triton. `scrape` reads the endpoint back for tests and load tests.
"""

from __future__ import annotations

import gc
import re
import time
import urllib.request

PREFIX = "trt_redrafter_"
OUTCOMES = ("completed", "cancelled", "rejected", "busy")  # busy: refused by max_queue_size


class ServingMetrics:
    def __init__(self, family_cls, labels: dict[str, str], max_tokens_per_step: int):
        self._families = []  # Triton requires a family to outlive its metrics

        def fam(name, desc, kind):
            self._families.append(family_cls(name=PREFIX + name, description=desc, kind=kind))
            return self._families[-1]

        g, c, h = family_cls.GAUGE, family_cls.COUNTER, family_cls.HISTOGRAM
        self.active = fam("active_requests", "requests in the running batch", g).Metric(labels=labels)
        self.waiting = fam("waiting_requests", "requests queued for admission", g).Metric(labels=labels)
        self.kv_used = fam("kv_blocks_used", "paged KV-cache blocks in use", g).Metric(labels=labels)
        self.kv_total = fam("kv_blocks_total", "paged KV-cache blocks in all", g).Metric(labels=labels)
        self.kv_cached = fam("kv_blocks_cached", "released KV blocks kept for prefix reuse (free: evicted when "
                             "needed)", g).Metric(labels=labels)
        self.kv_hit_rate = fam("kv_cache_hit_rate", "of the KV blocks requests needed since load, the share the "
                               "prefix cache supplied", g).Metric(labels=labels)
        self.mean_tps = fam("mean_tokens_per_step", "mean tokens per generation step (acceptance length) over "
                            "finished requests", g).Metric(labels=labels)
        # one bucket per possible acceptance length: 1 (nothing accepted) .. dl + 1 (a whole beam accepted)
        buckets = [float(b) for b in range(1, max_tokens_per_step + 1)]
        self.tokens_per_step = fam("tokens_per_step", "tokens one generation step emitted for a request "
                                   "(acceptance length)", h).Metric(labels=labels, buckets=buckets)
        requests = fam("requests_total", "finished requests by outcome", c)
        self.outcomes = {o: requests.Metric(labels={**labels, "outcome": o}) for o in OUTCOMES}
        self.generated = fam("generated_tokens_total", "tokens streamed to clients", c).Metric(labels=labels)

        # TensorRT-LLM's families: same names, help texts, kinds and labels
        stock = {**labels, "version": labels.get("version", "1")}

        def stock_fam(name, desc, kind, label, values, **kw):
            f = family_cls(name=name, description=desc, kind=kind)
            self._families.append(f)
            return {v: f.Metric(labels={**stock, label: v}, **kw) for v in values}

        self.trt_requests = stock_fam("nv_trt_llm_request_metrics", "TRT LLM request metrics", g, "request_type",
                                      ("active", "max", "scheduled", "context", "waiting"))
        self.trt_kv = stock_fam("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics", g,
                                "kv_cache_block_type", ("max", "free", "used", "tokens_per", "reused", "fraction"))
        self.trt_ifb = stock_fam("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific metrics",
                                 g, "inflight_batcher_specific_metric",
                                 ("total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests"))
        self.trt_general = stock_fam("nv_trt_llm_general_metrics", "General TRT LLM metrics", g, "general_type",
                                     ("timestamp", "iteration_counter"))
        token_buckets = [10.0, 50.0, 100.0, 500.0, 1000.0]
        self.trt_input_len = stock_fam("nv_llm_input_token_len", "TRT LLM response metrics", h,
                                       "response_metric_type", ("total_input_tokens",),
                                       buckets=token_buckets)["total_input_tokens"]
        self.trt_output_len = stock_fam("nv_llm_output_token_len", "TRT LLM response metrics", h,
                                        "response_metric_type", ("total_output_tokens",),
                                        buckets=token_buckets)["total_output_tokens"]

    def update_scheduler(self, m) -> None:
        """From `Scheduler.metrics()` (a `SchedulerMetrics`)."""
        self.active.set(m.running)
        self.waiting.set(m.waiting)
        self.kv_used.set(m.kv_blocks_used)
        self.kv_total.set(m.kv_blocks_total)
        self.kv_cached.set(m.kv_blocks_cached)
        self.kv_hit_rate.set(m.kv_cache_hit_rate)
        self.mean_tps.set(m.mean_tokens_per_step)
        for k, v in (("active", m.running + m.waiting), ("max", m.max_batch_size), ("scheduled", m.running),
                     ("context", m.context_requests), ("waiting", m.waiting)):
            self.trt_requests[k].set(v)
        for k, v in (("max", m.kv_blocks_total), ("free", m.kv_blocks_total - m.kv_blocks_used),
                     ("used", m.kv_blocks_used), ("tokens_per", m.block_size), ("reused", m.kv_blocks_reused),
                     ("fraction", m.kv_blocks_used / m.kv_blocks_total if m.kv_blocks_total else 0.0)):
            self.trt_kv[k].set(v)
        for k, v in (("total_context_tokens", m.context_tokens), ("generation_requests", m.running - m.context_requests),
                     ("micro_batch_id", 0), ("paused_requests", 0)):
            self.trt_ifb[k].set(v)
        self.trt_general["timestamp"].set(time.time_ns() // 1000)  # microseconds since the epoch
        self.trt_general["iteration_counter"].set(m.steps)

    def request_tokens(self, input_tokens: int, output_tokens: int) -> None:
        """A finished request's token counts (TensorRT-LLM's per-response histograms)."""
        self.trt_input_len.observe(input_tokens)
        self.trt_output_len.observe(output_tokens)

    def step(self, new_tokens: int, generation_step: bool) -> None:
        self.generated.increment(new_tokens)
        if generation_step and new_tokens:
            self.tokens_per_step.observe(new_tokens)

    def finished(self, outcome: str) -> None:
        self.outcomes[outcome].increment(1)

    def release(self) -> None:
        """Destroy every metric, then every family, now. Call it from the model's `finalize()`: a family still
        alive when the Python-backend stub tears itself down unregisters through the half-destroyed stub and
        segfaults it (python_backend PR #429, not in the Triton 2.51 stub nvidia-pytriton bundles:
        `Metric::SaveToSharedMemory` from `~MetricFamily` in `Stub::~Stub`, seen in the kernel log at every
        shutdown). Unusable afterwards."""
        families = self._families
        self.__dict__.clear()  # the metrics go first (a family must outlive its metrics) ...
        gc.collect()
        families.clear()  # ... then the families, while the stub can still unregister them
        gc.collect()


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str, prefix: str = PREFIX) -> dict[str, float]:
    """`name{labels} value` lines whose name starts with `prefix` -> {"name{labels}": value}; labels sorted,
    so `metric_key("trt_redrafter_kv_blocks_used", model="tensorrt_llm")` finds a value."""
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or not m.group(1).startswith(prefix):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[metric_key(m.group(1), **labels)] = float(m.group(3))
    return out


def metric_key(name: str, **labels: str) -> str:
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Read `trt_redrafter_*` metrics from a Triton metrics endpoint (http://host:port/metrics)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse_prometheus(r.read().decode())


def sum_metric(metrics: dict[str, float], name: str) -> float:
    """Total of one metric over all its label sets (e.g. KV blocks over model instances)."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))
