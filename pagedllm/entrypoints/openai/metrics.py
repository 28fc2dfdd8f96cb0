"""Prometheus metrics with vLLM's names under the ``pagedllm:`` prefix."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine.messages import EngineStats
from pagedllm.engine.output_processor import IterationStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """Updated by the front end (on the event loop) after every step; scraped at ``GET /metrics``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r, m = self.registry, model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=r).labels(m)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:{name}", doc, labels, registry=r).labels(m)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(m)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (recomputation included).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter("pagedllm:request_success", "Finished sequences by finish reason.",
                          labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(m, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a sequence.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        refused = Counter("pagedllm:requests_refused", "Requests the server shed: 'overloaded' (503, over "
                          "--max-waiting-requests) or aborted at --request-timeout ('timeout').",
                          labels + ["reason"], registry=r)
        self.refused = {reason: refused.labels(m, reason) for reason in ("overloaded", "timeout")}
        # speculative decoding, as vLLM's spec_decode_* counters (zero when it is off)
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft sequences verified.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_per_pos = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft.", labels + ["position"],
                                    registry=r)
        self._model_name = m
        self._last = EngineStats()

    def on_step(self, stats: EngineStats, iteration: IterationStats) -> None:
        """Engine-thread callback: gauges set, counters advanced by the change since the last call."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prompt_tokens.inc(stats.num_prompt_tokens_computed - self._last.num_prompt_tokens_computed)
        self.generation_tokens.inc(stats.num_generated_tokens - self._last.num_generated_tokens)
        self.preemptions.inc(stats.num_preemptions - self._last.num_preemptions)
        self.cache_queries.inc(stats.prefix_cache_queries - self._last.prefix_cache_queries)
        self.cache_hits.inc(stats.prefix_cache_hits - self._last.prefix_cache_hits)
        self.spec_drafts.inc(stats.spec_decode_num_drafts - self._last.spec_decode_num_drafts)
        self.spec_draft_tokens.inc(stats.spec_decode_num_draft_tokens - self._last.spec_decode_num_draft_tokens)
        self.spec_accepted.inc(stats.spec_decode_num_accepted_tokens - self._last.spec_decode_num_accepted_tokens)
        before = self._last.spec_decode_num_accepted_tokens_per_pos
        for pos, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            new = count - (before[pos] if pos < len(before) else 0)
            if new:
                self.spec_per_pos.labels(self._model_name, str(pos)).inc(new)
        self._last = stats
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
        for finished in iteration.finished:
            self.success[finished.finish_reason].inc()
            self.e2e.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.queue_time.observe(finished.queue_time)

    def on_refused(self, reason: str) -> None:
        """A request shed by the server ("overloaded" or "timeout"; the event loop calls it)."""
        self.refused[reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
