"""Prometheus metrics with vLLM's names under the ``pagedllm:`` prefix."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine.messages import EngineStats
from pagedllm.engine.output_processor import IterationStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """Updated by the front end (on the event loop) after every step; scraped at ``GET /metrics``. Each figure
    has vLLM's ``engine`` label: the data-parallel replica it comes from ("0" without data parallelism)."""

    def __init__(self, model_name: str, data_parallel_size: int = 1) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        r, m = self.registry, model_name
        engines = [str(i) for i in range(data_parallel_size)]

        def per_engine(kind: type, name: str, doc: str, **extra: object) -> list:
            metric = kind(f"pagedllm:{name}", doc, labels, registry=r, **extra)
            return [metric.labels(m, e) for e in engines]

        def gauge(name: str, doc: str) -> list:
            return per_engine(Gauge, name, doc)

        def counter(name: str, doc: str) -> list:
            return per_engine(Counter, name, doc)

        def histogram(name: str, doc: str) -> list:
            return per_engine(Histogram, name, doc, buckets=_LATENCY_BUCKETS)

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
        self.success = [{reason: success.labels(m, e, reason) for reason in FINISH_REASONS} for e in engines]
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a sequence.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        refused = Counter("pagedllm:requests_refused", "Requests the server shed: 'overloaded' (503, over "
                          "--max-waiting-requests) or aborted at --request-timeout ('timeout').",
                          ["model_name", "reason"], registry=r)
        self.refused = {reason: refused.labels(m, reason) for reason in ("overloaded", "timeout")}
        # speculative decoding, as vLLM's spec_decode_* counters (zero when it is off)
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft sequences verified.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_per_pos = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft.", labels + ["position"],
                                    registry=r)
        self._model_name = m
        self._last = [EngineStats() for _ in engines]

    def on_step(self, stats: EngineStats, iteration: IterationStats, engine: int = 0) -> None:
        """Event-loop callback after replica ``engine`` stepped: gauges set, counters advanced by the change since
        its last step; the front's timings of the outputs that step produced."""
        last, e = self._last[engine], engine
        if stats.num_steps < last.num_steps:  # a restarted replica counts from zero again
            last = EngineStats()
        self.running[e].set(stats.num_running)
        self.waiting[e].set(stats.num_waiting)
        self.kv_usage[e].set(stats.kv_cache_usage)
        self.prompt_tokens[e].inc(max(0, stats.num_prompt_tokens_computed - last.num_prompt_tokens_computed))
        self.generation_tokens[e].inc(max(0, stats.num_generated_tokens - last.num_generated_tokens))
        self.preemptions[e].inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.cache_queries[e].inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.cache_hits[e].inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.spec_drafts[e].inc(max(0, stats.spec_decode_num_drafts - last.spec_decode_num_drafts))
        self.spec_draft_tokens[e].inc(max(0, stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens))
        self.spec_accepted[e].inc(max(0, stats.spec_decode_num_accepted_tokens
                                      - last.spec_decode_num_accepted_tokens))
        before = last.spec_decode_num_accepted_tokens_per_pos
        for pos, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            new = count - (before[pos] if pos < len(before) else 0)
            if new > 0:
                self.spec_per_pos.labels(self._model_name, str(e), str(pos)).inc(new)
        self._last[engine] = stats
        for value in iteration.time_to_first_tokens:
            self.ttft[e].observe(value)
        for value in iteration.inter_token_latencies:
            self.itl[e].observe(value)
        for finished in iteration.finished:
            self.success[e][finished.finish_reason].inc()
            self.e2e[e].observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.queue_time[e].observe(finished.queue_time)

    def on_refused(self, reason: str) -> None:
        """A request shed by the server ("overloaded" or "timeout"; the event loop calls it)."""
        self.refused[reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
