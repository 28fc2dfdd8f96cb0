"""/metrics under vLLM's own names: after real requests through the openai SDK the scrape has every vllm:* metric we
export, with vLLM's label names and values that agree with our pagedllm:* family and with the replies; the Grafana
dashboard in docs/ asks only for names the server exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.messages import EngineStats
from pagedllm.engine.output_processor import FinishedRequestStats, IterationStats
from pagedllm.entrypoints.openai.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
    orca_header,
)

MODEL = "tiny"
DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana_dashboard.json"
NOT_MIRRORED = {"pagedllm:prompt_tokens_total", "pagedllm:prompt_tokens_created", "pagedllm:requests_refused_total",
                "pagedllm:requests_refused_created"}
"""Our samples whose vllm:* namesake means another figure, or that vLLM lacks."""


SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def _scrape(text: str) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted labels: value}."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _get(server) -> dict[str, dict[tuple, float]]:
    return _scrape(httpx.get(f"{server.url}/metrics", timeout=10).text)


def _value(scrape: dict, name: str, **labels: str) -> float:
    """The one sample of ``name`` with these labels (besides model_name="tiny", engine="0")."""
    want = {"model_name": MODEL, "engine": "0", **labels}
    found = [v for key, v in scrape.get(name, {}).items() if dict(key) == want]
    assert len(found) == 1, (name, want, scrape.get(name))
    return found[0]


def test_vllm_names_after_sdk_requests(server, client: openai.OpenAI) -> None:
    server.wait_idle()
    before = _get(server)
    two = client.completions.create(model=MODEL, prompt="Count with me: one two", max_tokens=5, n=2,
                                    extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    chat_usage = chunks[-1].usage
    assert two.usage.completion_tokens == 10 and chat_usage.completion_tokens == 4
    server.wait_idle()
    after = _get(server)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - (_value(before, name, **labels) if name in before else 0.0)

    # vLLM's label names, and every mirrored vllm:* sample equal to its pagedllm:* one in the same scrape
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert _value(after, name) == 0.0
    assert {dict(k)["finished_reason"] for k in after["vllm:request_success_total"]} == \
        {"stop", "length", "abort", "error", "repetition"}
    mirrored = 0
    for name, samples in after.items():
        if name.startswith("pagedllm:") and name not in NOT_MIRRORED:
            assert after["vllm:" + name[9:]] == samples, name
            mirrored += 1
    assert mirrored > 60
    # counts: three sequences of 5, 5 and 4 tokens, each ended by its length; two requests (n = 2 and 1)
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:generation_tokens_total") == 14 == delta("pagedllm:generation_tokens_total")
    prompts = 2 * two.usage.prompt_tokens + chat_usage.prompt_tokens  # (vLLM counts each sample's prompt)
    assert delta("vllm:prompt_tokens_total") == prompts == delta("vllm:request_prompt_tokens_sum")
    assert delta("vllm:prompt_tokens_total") == sum(delta("vllm:prompt_tokens_by_source_total", source=s)
                                                    for s in ("local_compute", "local_cache_hit"))
    assert delta("vllm:prompt_tokens_cached_total") == delta("vllm:prompt_tokens_by_source_total",
                                                             source="local_cache_hit")
    assert delta("vllm:prompt_tokens_cached_by_source_total", source="device") == \
        delta("vllm:prefix_cache_hits_total")
    assert delta("vllm:request_generation_tokens_sum") == 14 and delta("vllm:request_generation_tokens_count") == 3
    assert delta("vllm:request_params_max_tokens_sum") == 14
    assert (delta("vllm:request_params_n_count"), delta("vllm:request_params_n_sum")) == (2, 3)
    assert (delta("vllm:request_max_num_generation_tokens_count"),
            delta("vllm:request_max_num_generation_tokens_sum")) == (2, 9)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prefill_kv_computed_tokens"):
        assert delta(f"vllm:{name}_count") == 3, name
    assert delta("vllm:inter_token_latency_seconds_count") == 4 + 4 + 3  # one per token after the first
    e2e, inference = delta("vllm:e2e_request_latency_seconds_sum"), delta("vllm:request_inference_time_seconds_sum")
    assert 0 < delta("vllm:request_decode_time_seconds_sum") <= inference <= e2e
    assert delta("vllm:iteration_tokens_total_count") > 0
    assert delta("vllm:iteration_tokens_total_sum") == delta("pagedllm:prompt_tokens_total") + 14
    # vLLM's buckets
    les = sorted(float(dict(k)["le"]) for k in after["vllm:time_to_first_token_seconds_bucket"])
    assert les[:-1] == list(TTFT_BUCKETS)
    assert sorted(float(dict(k)["le"]) for k in after["vllm:inter_token_latency_seconds_bucket"])[:-1] == \
        list(ITL_BUCKETS)
    assert sorted(float(dict(k)["le"]) for k in after["vllm:e2e_request_latency_seconds_bucket"])[:-1] == \
        list(REQUEST_LATENCY_BUCKETS)
    assert sorted(float(dict(k)["le"]) for k in after["vllm:request_prompt_tokens_bucket"])[:3] == [1, 2, 5]
    (info,) = after["vllm:cache_config_info"]
    info = dict(info)
    assert info["engine"] == "0" and int(info["block_size"]) > 0 and int(info["num_gpu_blocks"]) > 0
    assert info["enable_prefix_caching"] in ("True", "False")


def test_admission_rejections_and_no_double_counting() -> None:
    """Our 'overloaded' refusals are vLLM's max_num_queued_reqs admission rejections; a timeout is none; two
    engines keep their own samples under both names."""
    metrics = ServerMetrics(MODEL, data_parallel_size=2)
    metrics.engine_ready(100, {"block_size": 16, "num_gpu_blocks": 8})
    for reason in ("overloaded", "overloaded", "timeout"):
        metrics.on_refused(reason)
    done = FinishedRequestStats("stop", 1.0, 0.1, 7, 3, 2, 0.2, 0.3, 0.5, 0.15, 16, 1, 3)
    metrics.on_step(EngineStats(num_steps=1, num_prompt_tokens_computed=5, num_generated_tokens=3),
                    IterationStats([0.3], [0.1, 0.2], [done], 7, 2), 1)
    scrape = _scrape(metrics.render().decode())
    assert scrape["vllm:admission_rejections_total"] == {(("model_name", MODEL), ("reason", "max_num_queued_reqs")): 2}
    assert _value(scrape, "vllm:prompt_tokens_total", engine="1") == 7
    assert _value(scrape, "vllm:prompt_tokens_total", engine="0") == 0
    assert _value(scrape, "vllm:request_success_total", engine="1", finished_reason="stop") == 1
    assert _value(scrape, "vllm:iteration_tokens_total_sum", engine="1") == 8
    assert _value(scrape, "vllm:request_prefill_kv_computed_tokens_sum", engine="1") == 5
    assert {dict(k)["engine"] for k in scrape["vllm:cache_config_info"]} == {"0", "1"}


def _exprs(node: object) -> list[str]:
    """Every PromQL string of a Grafana dashboard: targets' expr and template variables' queries."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query", "definition") and isinstance(value, str):
                found.append(value)
            elif isinstance(value, dict) and key == "query" and isinstance(value.get("query"), str):
                found.append(value["query"])
            else:
                found += _exprs(value)
    elif isinstance(node, list):
        for item in node:
            found += _exprs(item)
    return found


def test_dashboard_asks_only_for_exported_names(server) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dashboard)
    assert len(exprs) >= 10
    names = {name for expr in exprs for name in re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+", expr)}
    assert names and all(n.startswith("vllm:") for n in names), names
    exported = set()  # every family's sample names, also of one with no sample yet (per draft position)
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text):
        exported |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    missing = sorted(n for n in names if n not in exported)
    assert not missing, f"the dashboard asks for metrics the server does not export: {missing}"
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
            "vllm:request_success_total"} <= names


LOAD_FORMAT = "endpoint-load-metrics-format"
TEXT_REPORT = re.compile(r"TEXT named_metrics\.kv_cache_usage_perc=(\S+), named_metrics\.num_requests_waiting=(\S+)")


def _report(headers: httpx.Headers) -> dict[str, float]:
    """The named metrics of a JSON ORCA load report."""
    kind, body = headers["endpoint-load-metrics"].split(" ", 1)
    assert kind == "JSON"
    return json.loads(body)["named_metrics"]


def test_orca_load_report_figures_are_the_engines() -> None:
    """ORCA's load report reads the last step's figures: KV usage (the replicas' mean) and requests waiting
    (their sum), in vLLM's TEXT and JSON forms; another format gets none."""
    metrics = ServerMetrics(MODEL, data_parallel_size=2)
    assert metrics.load_figures() == [("kv_cache_usage_perc", 0.0), ("num_requests_waiting", 0.0)]
    metrics.on_step(EngineStats(num_steps=1, num_waiting=3, kv_cache_usage=0.5), IterationStats(), 0)
    metrics.on_step(EngineStats(num_steps=1, num_waiting=1, kv_cache_usage=0.25), IterationStats(), 1)
    figures = metrics.load_figures()
    assert figures == [("kv_cache_usage_perc", 0.375), ("num_requests_waiting", 4.0)]
    assert orca_header("TEXT", figures) == \
        "TEXT named_metrics.kv_cache_usage_perc=0.375, named_metrics.num_requests_waiting=4.0"
    assert orca_header("json", figures) == \
        'JSON {"named_metrics": {"kv_cache_usage_perc": 0.375, "num_requests_waiting": 4.0}}'
    assert orca_header("BIN", figures) is None


def test_orca_load_report_header(server, client: openai.OpenAI) -> None:
    """vLLM's test_orca_metrics.py: chat and completions with endpoint-load-metrics-format get the engine's load
    in endpoint-load-metrics (the SDK's raw response, as there); none unasked or in an unknown format; while a
    long stream holds KV blocks, the report shows them (the figures are live, not constants)."""
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "what is 1+1?"}], max_tokens=2,
        extra_headers={LOAD_FORMAT: "TEXT"})
    assert TEXT_REPORT.fullmatch(chat.http_response.headers["endpoint-load-metrics"])
    assert chat.parse().choices[0].message is not None
    completion = client.completions.with_raw_response.create(model=MODEL, prompt="Hello, my name is", max_tokens=2,
                                                             extra_headers={LOAD_FORMAT: "json"})
    figures = _report(completion.http_response.headers)
    assert set(figures) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert all(isinstance(v, float) and v >= 0 for v in figures.values())
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert "endpoint-load-metrics" not in httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).headers
    unknown = httpx.post(f"{server.url}/v1/completions", json=body, headers={LOAD_FORMAT: "BIN"}, timeout=30)
    assert unknown.status_code == 200 and "endpoint-load-metrics" not in unknown.headers
    server.wait_idle()
    long = {"model": MODEL, "prompt": "Count with me:", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=long, headers={LOAD_FORMAT: "json"},
                      timeout=60) as stream:
        assert _report(stream.headers)["kv_cache_usage_perc"] >= 0  # (streams get one too: the load as they start)
        lines = stream.iter_lines()  # (kept: a dropped iterator closes the stream, and the server aborts it)
        next(lines)  # its first chunk: the long request holds KV blocks
        during = httpx.post(f"{server.url}/v1/completions", json=body, headers={LOAD_FORMAT: "json"}, timeout=30)
        assert _report(during.headers)["kv_cache_usage_perc"] > 0
        assert _report(during.headers)["kv_cache_usage_perc"] <= 1
    server.wait_idle()  # (the long stream, closed, is aborted)
