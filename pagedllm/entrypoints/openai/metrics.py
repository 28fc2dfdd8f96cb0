"""Prometheus metrics at ``GET /metrics``: vLLM's names under the ``pagedllm:`` prefix, and again under vLLM's own
``vllm:`` prefix (see vllm_metrics.py): one set of figures, updated once per step, two names in the scrape."""
from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from pagedllm.config import EngineConfig
from pagedllm.engine.messages import EngineStats
from pagedllm.engine.output_processor import FinishedRequestStats, IterationStats
from pagedllm.entrypoints.openai.vllm_metrics import VllmNames

# vLLM's default histogram buckets (vllm/v1/metrics/buckets.py), so that both families' quantiles read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM's finish reasons (we never finish by 'repetition': it stays 0)."""
PROMPT_SOURCES = ("local_compute", "local_cache_hit")


ORCA_FORMATS = ("text", "json")
"""The ``endpoint-load-metrics-format`` values that get a load report (any case; vLLM's two)."""


def orca_header(metrics_format: str, figures: list[tuple[str, float]]) -> str | None:
    """The ``endpoint-load-metrics`` response header (ORCA's load report, as vLLM writes it) for a request's
    ``endpoint-load-metrics-format``: ``TEXT named_metrics.<name>=<value>, ...`` or ``JSON {"named_metrics":
    {...}}``; None for any other format (ORCA's binary one, say), which gets no header, as in vLLM."""
    kind = metrics_format.strip().lower()
    if kind == "text":
        return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in figures)
    if kind == "json":
        return "JSON " + json.dumps({"named_metrics": dict(figures)})
    return None


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """Buckets for per-request token counts: 1, 2, 5, 10, 20, 50 ... up to ``max_model_len`` (vLLM's)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
"""vllm:engine_sleep_state's states: awake, asleep at level 1 (vLLM offloads the weights), at level 2."""


class ServerMetrics:
    """Updated by the front end (on the event loop) after every step; scraped at ``GET /metrics``. Each figure
    has vLLM's ``engine`` label: the data-parallel replica it comes from ("0" without data parallelism).
    ``engine_ready`` adds what needs the loaded engine (per-request token histograms, cache_config_info)."""

    def __init__(self, model_name: str, data_parallel_size: int = 1) -> None:
        self.registry = CollectorRegistry()
        self._labels = ["model_name", "engine"]
        self._model_name = model_name
        self._engines = [str(i) for i in range(data_parallel_size)]
        self._mirrored: list[MetricWrapperBase] = []
        """Our metrics that are also vLLM's (shown again as vllm:*)."""
        self._by_name: dict[str, MetricWrapperBase] = {}
        self._token_histograms: dict[str, list] | None = None
        """Per-request token counts, made by engine_ready (their buckets go up to max_model_len)."""
        by_source = self._add_step_counts(model_name)
        self._add_latencies()
        refused = self._add_refusals_speculation_sleep(model_name)
        self.record_sleep_state(False)
        self._last = [EngineStats() for _ in self._engines]
        self.registry.register(VllmNames(self._mirrored, prompt_tokens_by_source=by_source,
                                         prefix_cache_hits=self._by_name["prefix_cache_hits"], refused=refused))

    def _add_step_counts(self, model_name: str) -> Counter:
        """The batch's gauges and the token, preemption, prefix-cache and finish counters (returns the prompt
        tokens by source, which vLLM's names sum)."""
        gauge, counter = self._gauge, self._counter
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (recomputation included; the "
                                     "vllm:prompt_tokens figure is prompt_tokens_by_source summed).", mirror=False)
        by_source = Counter("pagedllm:prompt_tokens_by_source", "Prompt tokens of the requests that got their "
                            "first token, by where their K/V came from.", self._labels + ["source"],
                            registry=self.registry)
        self._mirrored.append(by_source)
        self.prompt_by_source = [{src: by_source.labels(model_name, e, src) for src in PROMPT_SOURCES}
                                 for e in self._engines]
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter("pagedllm:request_success", "Finished sequences by finish reason.",
                          self._labels + ["finished_reason"], registry=self.registry)
        self._mirrored.append(success)
        self.success = [{reason: success.labels(model_name, e, reason) for reason in FINISH_REASONS}
                        for e in self._engines]
        return by_source

    def _add_latencies(self) -> None:
        """The per-request latency histograms (vLLM's), tokens per step and n per request."""
        histogram = self._histogram
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive outputs of a sequence.",
                             ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Per sequence: first to last token over "
                              "the tokens after the first.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last token.",
                                        REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens (prompt and generated) per engine "
                                          "step.", ITERATION_TOKENS_BUCKETS)
        self.params_n = histogram("request_params_n", "The n of each finished request.", PARAMS_N_BUCKETS)

    def _add_refusals_speculation_sleep(self, model_name: str) -> Counter:
        """Requests the server shed (returned: vLLM's names show it too), speculative decoding's counters (zero
        when it is off) and the sleep state."""
        counter = self._counter
        refused = Counter("pagedllm:requests_refused", "Requests the server shed: 'overloaded' (503, over "
                          "--max-waiting-requests) or aborted at --request-timeout ('timeout').",
                          ["model_name", "reason"], registry=self.registry)
        self.refused = {reason: refused.labels(model_name, reason) for reason in ("overloaded", "timeout")}
        # speculative decoding, as vLLM's spec_decode_* counters (zero when it is off)
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft sequences verified.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_per_pos = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft.", self._labels + ["position"],
                                    registry=self.registry)
        self._mirrored.append(self.spec_per_pos)
        sleep_state = Gauge("pagedllm:engine_sleep_state", "Sleep state (one of three is 1): awake; "
                            "weights_offloaded (level 1); discard_all (level 2).", self._labels + ["sleep_state"],
                            registry=self.registry)
        self._mirrored.append(sleep_state)
        self.sleep_state = [{state: sleep_state.labels(model_name, e, state) for state in SLEEP_STATES}
                            for e in self._engines]
        return refused

    # ------------------------------------------------------------------ construction helpers
    def _per_engine(self, kind: type, name: str, doc: str, mirror: bool = True, **extra: Any) -> list:
        metric = kind(f"pagedllm:{name}", doc, self._labels, registry=self.registry, **extra)
        if mirror:
            self._mirrored.append(metric)
        self._by_name[name] = metric
        return [metric.labels(self._model_name, e) for e in self._engines]

    def _gauge(self, name: str, doc: str) -> list:
        return self._per_engine(Gauge, name, doc)

    def _counter(self, name: str, doc: str, mirror: bool = True) -> list:
        return self._per_engine(Counter, name, doc, mirror)

    def _histogram(self, name: str, doc: str, buckets: tuple | list) -> list:
        return self._per_engine(Histogram, name, doc, buckets=buckets)

    def engine_ready(self, max_model_len: int, cache_info: dict[str, object]) -> None:
        """With the loaded engine: the per-request token histograms (buckets 1, 2, 5 ... up to
        ``max_model_len``) and ``cache_config_info`` (1, its labels the KV cache's settings in vLLM's names,
        e.g. block_size, num_gpu_blocks). Called once, before the first step."""
        if self._token_histograms is not None:
            return
        buckets = request_tokens_buckets(max_model_len)
        self._token_histograms = {name: self._histogram(name, doc, buckets) for name, doc in (
            ("request_prompt_tokens", "Prompt tokens of each finished sequence."),
            ("request_generation_tokens", "Tokens generated by each finished sequence."),
            ("request_prefill_kv_computed_tokens", "Prompt tokens of each finished sequence not found in the "
                                                   "prefix cache."),
            ("request_params_max_tokens", "The max_tokens of each finished sequence."),
            ("request_max_num_generation_tokens", "Per finished request: the most tokens one of its samples "
                                                  "generated."))}
        self._cache_config_info(cache_info)

    def _cache_config_info(self, cache_info: dict[str, object]) -> None:
        """``cache_config_info``: 1, its labels the KV cache's settings (per engine)."""
        info = {key: str(value) for key, value in cache_info.items()}
        gauge = Gauge("pagedllm:cache_config_info", "The KV cache's settings (labels; the value is 1).",
                      [*info, "engine"], registry=self.registry)
        self._mirrored.append(gauge)
        for e in self._engines:
            gauge.labels(*info.values(), e).set(1)

    def engine_loaded(self, config: EngineConfig, num_kv_blocks: int) -> None:
        """``engine_ready`` from the loaded engine's config and its KV pool (``num_kv_blocks``: all replicas')."""
        cache = config.cache
        self.engine_ready(config.model.max_model_len, {
            "block_size": cache.block_size, "num_gpu_blocks": num_kv_blocks // max(1, len(self._engines)),
            "cache_dtype": cache.cache_dtype, "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.gpu_memory_utilization, "sliding_window": cache.sliding_window,
            "kv_cache_memory_bytes": cache.kv_cache_memory})

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
        if stats.num_steps > last.num_steps:
            self.iteration_tokens[e].observe(max(0, stats.num_prompt_tokens_computed - last.num_prompt_tokens_computed
                                                 + stats.num_generated_tokens - last.num_generated_tokens))
        self._last[engine] = stats
        if iteration.num_prompt_tokens:
            by_source = self.prompt_by_source[e]
            by_source["local_compute"].inc(iteration.num_prompt_tokens - iteration.num_cached_prompt_tokens)
            by_source["local_cache_hit"].inc(iteration.num_cached_prompt_tokens)
        for value in iteration.time_to_first_tokens:
            self.ttft[e].observe(value)
        for value in iteration.inter_token_latencies:
            self.itl[e].observe(value)
        for finished in iteration.finished:
            self._on_finished(finished, e)

    def _on_finished(self, finished: FinishedRequestStats, e: int) -> None:
        """One finished sequence (and, with its last sample, its request): a few observations."""
        self.success[e][finished.finish_reason].inc()
        self.e2e[e].observe(finished.e2e_latency)
        if finished.queue_time is not None:
            self.queue_time[e].observe(finished.queue_time)
        if finished.decode_time is not None:
            self.decode_time[e].observe(finished.decode_time)
            self.tpot[e].observe(finished.time_per_output_token)
        if finished.prefill_time is not None:
            self.prefill_time[e].observe(finished.prefill_time)
            self.inference_time[e].observe(finished.inference_time)
        if finished.request_n is not None:
            self.params_n[e].observe(finished.request_n)
        tokens = self._token_histograms
        if tokens is None:  # no engine_ready (an app tested without an engine)
            return
        tokens["request_prompt_tokens"][e].observe(finished.num_prompt_tokens)
        tokens["request_generation_tokens"][e].observe(finished.num_generation_tokens)
        tokens["request_prefill_kv_computed_tokens"][e].observe(
            max(0, finished.num_prompt_tokens - finished.num_cached_tokens))
        if finished.max_tokens:
            tokens["request_params_max_tokens"][e].observe(finished.max_tokens)
        if finished.request_max_generation_tokens is not None:
            tokens["request_max_num_generation_tokens"][e].observe(finished.request_max_generation_tokens)

    def load_figures(self) -> list[tuple[str, float]]:
        """The engine's load as of its last step, for ORCA's load report (orca_header): vLLM's two named metrics,
        ``kv_cache_usage_perc`` (the replicas' mean) and ``num_requests_waiting`` (their sum), the figures the
        ``vllm:`` gauges of the same names show."""
        usage = sum(stats.kv_cache_usage for stats in self._last) / len(self._last)
        return [("kv_cache_usage_perc", float(usage)),
                ("num_requests_waiting", float(sum(stats.num_waiting for stats in self._last)))]

    def record_sleep_state(self, sleeping: bool, level: int = 0) -> None:
        """The engine's sleep state (vLLM's gauge): awake, or asleep at ``level`` (level 0: every state 0)."""
        state = "awake" if not sleeping else {1: "weights_offloaded", 2: "discard_all"}.get(level)
        for gauges in self.sleep_state:
            for name, gauge in gauges.items():
                gauge.set(1 if name == state else 0)

    def on_refused(self, reason: str) -> None:
        """A request shed by the server ("overloaded" or "timeout"; the event loop calls it)."""
        self.refused[reason].inc()

    def render(self) -> bytes:
        """The scrape: both families (Prometheus text format)."""
        return generate_latest(self.registry)
