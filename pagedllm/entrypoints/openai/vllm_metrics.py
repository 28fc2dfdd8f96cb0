"""vLLM's metric names (``vllm:*``) in the same ``/metrics`` scrape, read from the ``pagedllm:*`` figures.

Nothing here counts anything: ``VllmNames`` is a Prometheus collector that, at scrape time, shows the
``pagedllm:`` metrics it was given again under ``vllm:`` (same type, labels, buckets and values), and derives the
few vLLM figures whose label sets differ from ours (``vllm:prompt_tokens``, ``vllm:prompt_tokens_cached``,
``vllm:prompt_tokens_cached_by_source``, ``vllm:admission_rejections``). So the engine's step updates one family
and a scrape renders both; vLLM's Grafana dashboards, its production-stack router and autoscaling rules on
``vllm:num_requests_waiting`` read a pagedllm server unchanged. docs/METRICS.md lists both families.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

OURS, THEIRS = "pagedllm:", "vllm:"

ADMISSION_REASONS = {"overloaded": "max_num_queued_reqs"}
"""Our refusal reasons that are vLLM admission rejections (its --max-num-queued-reqs is our
--max-waiting-requests); a request aborted at --request-timeout is no admission rejection."""


def vllm_name(name: str) -> str:
    """``pagedllm:x`` -> ``vllm:x``."""
    assert name.startswith(OURS), name
    return THEIRS + name[len(OURS):]


def _renamed(family: Metric) -> Metric:
    """One collected family under its vLLM name: the samples (``_total``, ``_bucket``...) keep their suffixes."""
    name = vllm_name(family.name)
    out = Metric(name, family.documentation, family.type, family.unit)
    cut = len(family.name)
    out.samples = [s._replace(name=name + s.name[cut:]) for s in family.samples]
    return out


def _totals(metric: MetricWrapperBase) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of a counter's ``_total`` samples."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                yield sample.labels, sample.value


class VllmNames(Collector):
    """Renders ``mirrored`` (``pagedllm:`` metrics) as ``vllm:`` metrics, plus the derived figures."""

    def __init__(self, mirrored: list[MetricWrapperBase], *, prompt_tokens_by_source: MetricWrapperBase,
                 prefix_cache_hits: MetricWrapperBase, refused: MetricWrapperBase) -> None:
        self.mirrored = mirrored
        """(The owner's list: a metric it appends later is shown too.)"""
        self.prompt_tokens_by_source = prompt_tokens_by_source
        self.prefix_cache_hits = prefix_cache_hits
        self.refused = refused

    def describe(self) -> list[Metric]:
        """Nothing to check at registration (the names are ours with another prefix)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Every mirrored family renamed, then the derived ones."""
        for metric in self.mirrored:
            for family in metric.collect():
                yield _renamed(family)
        yield from self._prompt_tokens()
        yield self._cached_by_source()
        yield self._admission_rejections()

    def _prompt_tokens(self) -> Iterator[Metric]:
        """vllm:prompt_tokens (every source summed) and vllm:prompt_tokens_cached (the prefix cache's share)."""
        total: dict[tuple[str, str], float] = {}
        cached: dict[tuple[str, str], float] = {}
        for labels, value in _totals(self.prompt_tokens_by_source):
            key = (labels["model_name"], labels["engine"])
            total[key] = total.get(key, 0.0) + value
            cached.setdefault(key, 0.0)
            if labels["source"] == "local_cache_hit":
                cached[key] += value
        for name, doc, values in (
                ("prompt_tokens", "Prompt tokens of the requests that got their first token (computed or found in "
                                  "the prefix cache).", total),
                ("prompt_tokens_cached", "Of those, the prompt tokens found in the prefix cache.", cached)):
            family = CounterMetricFamily(THEIRS + name, doc, labels=["model_name", "engine"])
            for key, value in values.items():
                family.add_metric(list(key), value)
            yield family

    def _cached_by_source(self) -> Metric:
        """vllm:prompt_tokens_cached_by_source: prefix-cache hits, all from the device's own pool here."""
        family = CounterMetricFamily(THEIRS + "prompt_tokens_cached_by_source",
                                     "Prefix-cache hit tokens by the tier that held them (only 'device' here).",
                                     labels=["model_name", "engine", "source"])
        for labels, value in _totals(self.prefix_cache_hits):
            family.add_metric([labels["model_name"], labels["engine"], "device"], value)
        return family

    def _admission_rejections(self) -> Metric:
        """vllm:admission_rejections{reason="max_num_queued_reqs"}: our 'overloaded' refusals."""
        family = CounterMetricFamily(THEIRS + "admission_rejections",
                                     "Requests refused at admission by a queue limit, by the limit.",
                                     labels=["model_name", "reason"])
        for labels, value in _totals(self.refused):
            if labels["reason"] in ADMISSION_REASONS:
                family.add_metric([labels["model_name"], ADMISSION_REASONS[labels["reason"]]], value)
        return family
