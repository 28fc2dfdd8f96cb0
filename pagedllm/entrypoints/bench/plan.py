"""``pagedllm plan``: a capacity planner. A trace (the datasets of ``pagedllm bench serve``: a ShareGPT file,
a synthetic trace, random lengths, or a recorded request log) is replayed at a sweep of Poisson request
rates through the real ``Scheduler`` and KV cache manager with a fake model whose step time comes from a
cost model measured on this machine. It predicts what ``pagedllm bench serve`` would measure (throughput,
TTFT / TPOT percentiles) plus preemptions and KV usage, and recommends max_num_seqs and the highest rate
for a latency target.

The cost model: step seconds = c0 + c1 * tokens + c2 * sequences + c3 * attended positions (thousands), a
least-squares fit of timed steps of the real engine (``pagedllm plan --calibrate --cost-model FILE``, about
a minute: requests of mixed lengths at several concurrencies). Attended positions: for each scheduled
token, the positions it attends to (a decode token its whole context).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections import deque
from typing import Any

import numpy as np

from pagedllm import platform
from pagedllm.config import CacheConfig, SchedulerConfig, default_kv_budget
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.bench.cluster import add_cluster_args, run_cluster
from pagedllm.entrypoints.bench.datasets import (
    BenchRequest,
    add_dataset_args,
    check_dataset_args,
    dataset_seed,
    requests_from_args,
)
from pagedllm.entrypoints.bench.memory_sim.paged import fake_model
from pagedllm.entrypoints.cli_args import SubParsers, add_engine_args, engine_args_from
from pagedllm.errors import ValidationError
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


@dataclasses.dataclass
class CostModel:
    """Predicted seconds of one engine step from its features (Scheduler.step_features)."""

    coef: list[float]
    machine: str = ""
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    samples: int = 0
    median_error: float = 0.0
    """Median |predicted - measured| / measured over the calibration steps."""

    def predict(self, features: list[float]) -> float:
        return max(1e-5, float(np.dot(self.coef, features)))

    @classmethod
    def fit(cls, features: list[list[float]], seconds: list[float], **facts: Any) -> CostModel:
        """Least squares with non-negative coefficients (a coefficient that fits negative is dropped)."""
        x, y = np.asarray(features), np.asarray(seconds)
        keep = list(range(x.shape[1]))
        while True:
            coef, *_ = np.linalg.lstsq(x[:, keep] / y[:, None], np.ones_like(y), rcond=None)  # relative errors
            if (coef >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(coef)))
        full = np.zeros(x.shape[1])
        full[keep] = np.clip(coef, 0, None)
        error = float(np.median(np.abs(x @ full - y) / y))
        return cls([float(c) for c in full], samples=len(y), median_error=error, **facts)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> CostModel:
        try:
            with open(path) as f:
                return cls(**json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise ValidationError(f"cost_model: cannot read {path!r} ({e}); make one with `pagedllm plan "
                                  "--calibrate --cost-model FILE`", param="cost_model", value=path) from None


def calibrate(args: EngineArgs, seconds: float = 60.0, seed: int = 0) -> CostModel:
    """Time steps of the real engine on requests of mixed lengths at several concurrencies; fit the model."""
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**dataclasses.asdict(args))
    engine, rng = llm.llm_engine, random.Random(seed)
    features, times = [], []
    vocab = engine.processor.vocab_size
    max_len = engine.config.model.max_model_len
    levels = [c for c in (1, 4, 16, 64, 256) if c <= engine.config.scheduler.max_num_seqs]
    deadline = time.monotonic() + seconds
    try:
        for n, concurrency in enumerate(levels):
            stop = time.monotonic() + (deadline - time.monotonic()) / (len(levels) - n)
            for i in range(concurrency):
                prompt_len = min(rng.randint(16, 512), max_len // 2)
                params = SamplingParams(max_tokens=min(rng.randint(16, 160), max_len - prompt_len), ignore_eos=True)
                engine.add_request(f"cal-{n}-{i}", {"prompt_token_ids": [rng.randrange(vocab)
                                                                        for _ in range(prompt_len)]}, params)
            warm = 3
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - start
                if warm <= 0 and engine.engine_core.core.last_step_features[1] > 0:
                    features.append(engine.engine_core.core.last_step_features)
                    times.append(elapsed)
                warm -= 1
                if time.monotonic() > stop:
                    engine.abort_request(list(engine.output_processor.requests))
                    break
    finally:
        llm.shutdown()
    if len(times) < 8:
        raise ValidationError(f"calibration timed only {len(times)} steps: give it more time", param="calibrate")
    config = engine.config
    return CostModel.fit(features, times, machine=platform.describe(config.model.dtype),
                         engine={"model": config.model.model, "dtype": config.model.dtype,
                                 "quantization": config.model.quantization, "kv_cache_dtype": config.cache.cache_dtype,
                                 "max_num_batched_tokens": config.scheduler.max_num_batched_tokens})


def fit_step_log(path: str) -> CostModel:
    """The cost model of a `pagedllm serve --step-log` file (JSON lines of features and seconds)."""
    try:
        with open(path) as f:
            steps = [json.loads(line) for line in f if line.strip()]
        features, seconds = [s["features"] for s in steps], [s["seconds"] for s in steps]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValidationError(f"calibrate_from: cannot read {path!r} ({e})", param="calibrate_from") from None
    if len(seconds) < 8:
        raise ValidationError(f"calibrate_from: {path!r} holds {len(seconds)} steps; serve some load first",
                              param="calibrate_from")
    return CostModel.fit(features, seconds, machine=platform.describe("bfloat16"), engine={"step_log": path})


@dataclasses.dataclass
class Prediction:
    """What the replay predicts at one request rate (the fields of `pagedllm bench serve`'s summary)."""

    request_rate: float | None
    """The Poisson rate replayed (None: a recorded log's own arrival times)."""
    requests_per_second: float
    output_tokens_per_second: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    num_preemptions: int
    mean_kv_usage: float
    max_kv_usage: float
    max_num_running: int
    num_steps: int
    refused: int
    """Requests the pool could never hold (the server refuses them with a 400)."""


def _stats(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values or [0.0]) * 1000
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """`pagedllm bench serve`'s arrivals: request i after i exponential gaps of numpy's generator (seed)."""
    rng, t, out = np.random.default_rng(seed), 0.0, []
    for _ in range(num):
        out.append(t)
        if rate != float("inf"):
            t += float(rng.exponential(1.0 / rate))
    return out


def replay(requests: list[BenchRequest], arrivals: list[float], cost: CostModel, num_blocks: int,
           block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
           enable_prefix_caching: bool = False, replicas: int = 1) -> Prediction:
    """Run the requests through the real scheduler on a virtual clock: each step lasts what ``cost`` says. A
    request the pool could never hold is refused (as the server answers it with a 400) and counted. With
    ``replicas`` > 1 (data parallelism), request i goes to replica i % replicas, each its own scheduler, KV pool
    and clock (each replica is one machine like the one the cost model was measured on); the figures are of
    all of them together."""
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    arrived: dict[str, float] = {}
    usage: list[float] = []
    totals = {"num_preemptions": 0, "max_kv_cache_usage": 0.0, "max_num_running": 0, "num_steps": 0, "refused": 0}
    for replica in range(replicas):
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                              max_model_len=max_model_len),
                              CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
                              num_kv_blocks=num_blocks)
        pending = deque(sorted((at, i) for i, at in enumerate(arrivals) if i % replicas == replica))
        now = 0.0
        while pending or scheduler.has_unfinished_requests():
            if not scheduler.has_unfinished_requests():
                now = max(now, pending[0][0])
            while pending and pending[0][0] <= now:
                at, i = pending.popleft()
                r = requests[i]
                req_id = f"r{i}"
                try:
                    scheduler.add_request(Request(req_id, [i + 1] * r.prompt_len, SamplingParams(
                        max_tokens=r.output_len, ignore_eos=True), eos_token_ids=None, max_tokens=r.output_len,
                        arrival_time=at))
                except ValidationError:
                    totals["refused"] += 1
                    continue
                arrived[req_id] = at
            out = scheduler.schedule()
            if not out.num_scheduled_tokens:  # waiting for blocks with nothing running cannot happen; be safe
                now = pending[0][0] if pending else now + 1e-3
                continue
            now += cost.predict(scheduler.step_features(out))
            usage.append(scheduler.kv_cache_manager.usage())
            for output in scheduler.update_from_output(fake_model(scheduler, out)):
                if output.new_token_ids:
                    first.setdefault(output.request_id, now)
                if output.finish_reason is not None:
                    done[output.request_id] = now
        stats = scheduler.stats
        totals["num_preemptions"] += stats.num_preemptions
        totals["max_kv_cache_usage"] = max(totals["max_kv_cache_usage"], stats.max_kv_cache_usage)
        totals["max_num_running"] += stats.max_num_running
        totals["num_steps"] += stats.num_steps
    lengths = {f"r{i}": r.output_len for i, r in enumerate(requests)}
    elapsed = max(done.values()) if done else 1e-9
    tpot = [(done[r] - first[r]) / (lengths[r] - 1) for r in done if lengths[r] > 1]
    return Prediction(request_rate=0.0, requests_per_second=len(done) / elapsed,
                      output_tokens_per_second=sum(lengths[r] for r in done) / elapsed,
                      ttft_ms=_stats([first[r] - arrived[r] for r in first]), tpot_ms=_stats(tpot),
                      num_preemptions=int(totals["num_preemptions"]), mean_kv_usage=float(np.mean(usage or [0.0])),
                      max_kv_usage=float(totals["max_kv_cache_usage"]), max_num_running=int(totals["max_num_running"]),
                      num_steps=int(totals["num_steps"]), refused=int(totals["refused"]))


def kv_blocks(args: EngineArgs) -> tuple[int, int]:
    """(KV blocks of the pool the options give, max_model_len), as the engine would size them (one rank)."""

    config, arch = args.create_engine_config()
    parallel = config.parallel
    if parallel.world_size != 1 or not platform.is_cpu(config.device.device):
        param = "pipeline_parallel_size" if parallel.pipeline_parallel_size != 1 else "tensor_parallel_size"
        raise ValidationError("pagedllm plan models one CPU rank: tensor_parallel_size and pipeline_parallel_size 1 "
                              "on the CPU (--machines plans a model over several machines, on paper)", param=param,
                              value=getattr(parallel, param))
    if config.scheduler.preemption_mode != "recompute":
        raise ValidationError("pagedllm plan models preemption by recompute only", param="preemption_mode",
                              value=config.scheduler.preemption_mode)
    cache, sched = config.cache, config.scheduler
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks, config.model.max_model_len
    value_bytes = 1 if cache.cache_dtype == "int8" else {"float32": 4, "bfloat16": 2, "float16": 2}[config.model.dtype]
    head = cache.block_size * (arch.head_dim + 2 if cache.cache_dtype == "int8" else arch.head_dim) * value_bytes
    block_bytes = 2 * arch.num_layers * arch.num_kv_heads * head  # K and V of every layer, as the worker sizes them
    budget = cache.kv_cache_memory or default_kv_budget(block_bytes, cache.block_size, sched.max_num_seqs,
                                                        sched.max_model_len)
    return budget // block_bytes, config.model.max_model_len


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("plan", help="capacity planner: replay a trace through the scheduler with a measured step-time "
                                    "model; predicted throughput, TTFT/TPOT, preemptions, KV usage per request rate")
    p.add_argument("model_tag", nargs="?", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    actions = add_engine_args(p)
    actions["seed"].help = "seed of the arrivals and the dataset, as `pagedllm bench serve`'s --seed (default: 0)"
    add_dataset_args(p)
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="a ShareGPT-format JSON file (as --dataset-name sharegpt --dataset-path FILE) or a recorded "
                        "request log (JSON lines with prompt_len, output_len and optionally arrival_time, seconds)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4, 8], help="requests/s to predict")
    p.add_argument("--cost-model", default="cost_model.json", help="the step-time model (default: %(default)s)")
    p.add_argument("--calibrate", action="store_true", help="measure the step-time model on this machine first (about "
                   "--calibrate-seconds) and save it to --cost-model")
    p.add_argument("--calibrate-seconds", type=float, default=60.0)
    p.add_argument("--calibrate-from", default=None, metavar="FILE",
                   help="fit the step-time model on a server's steps as served (`pagedllm serve --step-log FILE` "
                        "under load: HTTP and clients share the machine) and save it to --cost-model")
    p.add_argument("--target-tpot-ms", type=float, default=None, help="latency target: p50 time per output token")
    p.add_argument("--target-ttft-ms", type=float, default=None, help="latency target: p99 time to first token")
    p.add_argument("--max-num-seqs-options", type=int, nargs="+", default=[16, 32, 64, 128, 256],
                   help="max_num_seqs values the recommendation compares")
    p.add_argument("--output-json", default=None)
    add_cluster_args(p)
    p.set_defaults(func=run)


def _read_log(path: str) -> tuple[list[BenchRequest], list[float] | None]:
    """A recorded request log: one JSON object per line with prompt_len, output_len (and arrival_time)."""
    requests, arrivals, n = [], [], 0
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):  # noqa: B007 (n names the failing line in the error below)
                if line.strip():
                    entry = json.loads(line)
                    requests.append(BenchRequest([], int(entry["prompt_len"]), int(entry["output_len"])))
                    arrivals.append(entry.get("arrival_time"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValidationError(f"trace: {path!r} line {n}: {e}", param="trace", value=path) from None
    if not requests:
        raise ValidationError(f"trace: {path!r} holds no request", param="trace", value=path)
    return requests, None if None in arrivals else [float(a) - float(arrivals[0]) for a in arrivals]


def _meets(p: Prediction, ns: argparse.Namespace) -> bool:
    return ((ns.target_tpot_ms is None or p.tpot_ms["p50"] <= ns.target_tpot_ms)
            and (ns.target_ttft_ms is None or p.ttft_ms["p99"] <= ns.target_ttft_ms))


def _cost_model(ns: argparse.Namespace, args: EngineArgs) -> CostModel:
    """The step-cost model: fitted on a server's step log (--calibrate-from), measured here (--calibrate) and
    saved, or read from --cost-model."""
    if ns.calibrate_from:
        cost = fit_step_log(ns.calibrate_from)
        cost.save(ns.cost_model)
        print(f"cost model: {cost.coef} from {cost.samples} served steps, median error {cost.median_error:.1%} "
              f"-> {ns.cost_model}")
    elif ns.calibrate:
        cost = calibrate(args, ns.calibrate_seconds, ns.seed)
        cost.save(ns.cost_model)
        print(f"cost model: {cost.coef} from {cost.samples} steps, median error {cost.median_error:.1%} "
              f"-> {ns.cost_model}")
    else:
        cost = CostModel.load(ns.cost_model)
    return cost


def _recommend(ns: argparse.Namespace, requests: list[BenchRequest], cost: CostModel,
               sched: dict[str, Any]) -> dict[str, float] | None:
    """The --max-num-seqs option that meets the latency targets at the highest of the rates (None: none does)."""
    best: tuple[float, int] | None = None
    for seqs in sorted(set(ns.max_num_seqs_options)):
        ok = [r for r in ns.rates if _meets(replay(requests, arrival_times(len(requests), r, ns.seed), cost,
                                                   max_num_seqs=seqs, **sched), ns)]
        if ok and (best is None or max(ok) > best[0]):
            best = (max(ok), seqs)
    print("recommendation: " + ("no setting meets the target at these rates" if best is None else
                                f"--max-num-seqs {best[1]}: up to {best[0]} req/s within the target"))
    return None if best is None else {"max_num_seqs": best[1], "max_request_rate": best[0]}


def run(ns: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import get_tokenizer

    args = engine_args_from(ns)
    if ns.machines:  # the on-paper plan of a model over machines (entrypoints/bench/cluster.py)
        return run_cluster(ns, args)
    cost = _cost_model(ns, args)
    num_blocks, max_model_len = kv_blocks(args)
    recorded = None
    if ns.trace is not None and not ns.trace.endswith(".json"):
        requests, recorded = _read_log(ns.trace)
    else:
        if ns.trace is not None:
            ns.dataset_name, ns.dataset_path = "sharegpt", ns.trace
        check_dataset_args(ns)
        tokenizer = get_tokenizer(args.model)
        requests = requests_from_args(ns, len(tokenizer), tokenizer, dataset_seed(ns))
    fits = [r.prompt_len + r.output_len <= max_model_len for r in requests]  # the others the server refuses
    requests = [r for r, ok in zip(requests, fits) if ok]
    if recorded is not None:
        recorded = [t for t, ok in zip(recorded, fits) if ok]
    sched = {"block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
             "max_model_len": max_model_len, "num_blocks": num_blocks,
             "enable_prefix_caching": args.enable_prefix_caching, "replicas": args.data_parallel_size}
    rates = ["recorded"] if recorded is not None else ns.rates
    table = []
    for rate in rates:
        arrivals = recorded if rate == "recorded" else arrival_times(len(requests), rate, ns.seed)
        p = replay(requests, arrivals, cost, max_num_seqs=args.max_num_seqs, **sched)
        p.request_rate = None if rate == "recorded" else rate  # type: ignore[assignment]
        table.append(p)
        print(f"rate {rate:>8}: {p.requests_per_second:6.2f} req/s {p.output_tokens_per_second:8.1f} out tok/s  "
              f"TTFT p50 {p.ttft_ms['p50']:8.1f} p99 {p.ttft_ms['p99']:8.1f} ms  TPOT p50 {p.tpot_ms['p50']:7.1f} "
              f"p99 {p.tpot_ms['p99']:7.1f} ms  preemptions {p.num_preemptions:4d}  KV mean {p.mean_kv_usage:.0%} "
              f"max {p.max_kv_usage:.0%}")
    result: dict[str, Any] = {"num_blocks": num_blocks, "requests": len(requests),
                              "cost_model": dataclasses.asdict(cost),
                              "predictions": [dataclasses.asdict(p) for p in table]}
    if (ns.target_tpot_ms or ns.target_ttft_ms) and recorded is None:
        result["recommendation"] = _recommend(ns, requests, cost, sched)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f)
    return 0
