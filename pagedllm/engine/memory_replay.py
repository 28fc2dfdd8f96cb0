"""``pagedllm bench memory``: the PagedAttention paper's KV-memory waste analysis, without a model.

It replays seeded synthetic traces through the real ``Scheduler`` / ``KVCacheManager`` (with a
fake model runner that emits one token per request that needs a sample) and through three
contiguous-reservation baselines of the same KV memory, and reports where the memory goes.

Traces (``--seed``, default 0; each length is drawn from a lognormal with the given mean and
log-space standard deviation sigma, rounded, then clipped: prompt to [4, max_model_len - 4],
output to [4, max_model_len - prompt], so ``prompt + output <= max_model_len``):

- ``sharegpt`` (ShareGPT-like): input mean 161 tokens, sigma 1.2; output mean 338, sigma 0.8.
- ``alpaca``: input mean 19 tokens, sigma 0.6; output mean 58, sigma 0.9.

The means are those the paper gives for its datasets (before clipping; the table prints the
drawn means). Arrivals are a Poisson process in *steps* (one step = one scheduler iteration =
one model forward): request i arrives at step floor(t_i), with exponential gaps of mean
1 / ``--request-rate``. The default rate is per trace the *saturating* rate
``kv_slots / mean(output * (prompt + (output - 1) / 2))``: by Little's law the K/V the
arriving requests hold on average then equals the whole pool, so the pool is under pressure
(for Alpaca the ``max_num_seqs`` limit binds first). Each request produces exactly its
output length (``ignore_eos``).

Schemes, all with ``kv_slots = (kv_tokens // block_size) * block_size`` token slots and the
same ``max_num_seqs`` / ``max_num_batched_tokens`` limits:

- ``paged``: the real scheduler with ``CacheConfig(block_size)`` and
  ``kv_tokens // block_size + 1`` blocks (block 0 is the null block). Prompts are chunked
  under the token budget, preemption is by recompute, exactly as in the engine.
- ``orca-max`` / ``orca-pow2`` / ``orca-oracle``: each request reserves, at admission, one
  contiguous extent of max_model_len slots / the next power of two >= prompt + output
  (at most max_model_len) / exactly prompt + output. Extents are taken first-fit from the
  free extents of [0, kv_slots) and returned (and merged) when the request finishes.
  Admission is iteration-level and FCFS: the head of the queue joins when an extent fits,
  fewer than max_num_seqs run, and its whole prompt fits the step's token budget (running
  requests take one token each first; a prompt larger than the whole budget runs alone).
  The whole prompt is computed in its first step, then one token per step.

Accounting: K/V is sampled once per step, after the step's tokens are computed and before
finished requests are freed. The slots of the pool are split into

- token states: K/V actually held (the sum of ``num_computed_tokens`` of running requests);
- reserved: slots held for future tokens a running request will still produce;
- internal fragmentation: slots held beyond what a request will ever use (paged: the
  unfilled tail of each request's last block; Orca: padding of the reservation beyond
  prompt + output);
- external fragmentation: free slots while the FCFS head of the queue waits because its
  reservation is larger than the largest free extent (never for paged: any free block fits);
- unused: all other free slots (nothing waits, or only max_num_seqs / the token budget
  blocks admission). Unused slots are not waste and are left out of the percentages.

Each percentage is a ratio of sums over the busy steps (those that compute something):
``sum(category) / sum(token states + reserved + internal + external)``, so the four columns
add up to 100% and nearly empty steps weigh little. Paged waste is ``1 - token states``.

Sharing (``--sharing-traces``, default alpaca): for each request of the trace, blocks held
at every generation step (K/V of prompt + g tokens, g = 0 .. output - 1) with and without
sharing, summed over steps and requests; saving = 1 - shared / unshared.

- Parallel sampling, n samples: without sharing every sample holds its own copy of the
  prompt; with sharing the prompt's full blocks are held once, the last partial prompt
  block is shared until the first write (copy-on-write, then one copy per sample), and
  generated tokens' blocks are per sample. All samples have the request's output length.
  When ``KVCacheManager`` has ``fork`` this is measured on the real manager (the prompt is
  allocated once, the samples forked from it, each grown by ``allocate_slots``); otherwise
  it is counted with the rule above (the two agree exactly; the tests check it).
- Beam search, width k (a model, not a search): the k beams share the prompt and all
  generated tokens more than ``--beam-divergence`` tokens (default 32) behind the newest
  position; the blocks holding the last ``--beam-divergence`` tokens are per beam. The
  savings depend on this assumption.

The module is pure Python (no torch); matplotlib is imported only for ``--plot``.
"""
from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.errors import ValidationError
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

PAGED = "paged"
ORCA_SCHEMES = ("orca-max", "orca-pow2", "orca-oracle")
SCHEMES = (PAGED, *ORCA_SCHEMES)
CATEGORIES = ("token_states", "reserved", "internal", "external")
SAMPLE_TOKEN_BASE = 1_000_000
"""Token id that sample i generates is SAMPLE_TOKEN_BASE + i (prompt tokens are smaller)."""
PLOT_POINTS = 2000
"""Most points per plotted series (longer series are strided)."""


# --------------------------------------------------------------------------------- traces
@dataclass(frozen=True)
class TraceSpec:
    """Lognormal length distributions of one synthetic trace."""

    name: str
    mean_input: float
    sigma_input: float
    mean_output: float
    sigma_output: float

    def describe(self) -> str:
        return (f"{self.name}: input lognormal(mean {self.mean_input:g}, sigma {self.sigma_input:g}), "
                f"output lognormal(mean {self.mean_output:g}, sigma {self.sigma_output:g})")


TRACE_SPECS = {
    "sharegpt": TraceSpec("sharegpt", mean_input=161, sigma_input=1.2, mean_output=338, sigma_output=0.8),
    "alpaca": TraceSpec("alpaca", mean_input=19, sigma_input=0.6, mean_output=58, sigma_output=0.9),
}


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives and how long it is."""

    index: int
    arrival_step: int
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def lognormal_length(rng: random.Random, mean: float, sigma: float) -> int:
    """A rounded lognormal draw whose (unclipped) mean is ``mean``."""
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2)
    return round(rng.lognormvariate(mu, sigma))


def draw_lengths(spec: TraceSpec, num: int, max_model_len: int, seed: int) -> list[tuple[int, int]]:
    """``num`` (prompt, output) pairs, clipped so that 4 <= each and prompt + output <= max_model_len."""
    rng = random.Random(f"{seed}-{spec.name}-lengths")
    pairs = []
    for _ in range(num):
        prompt = min(max(lognormal_length(rng, spec.mean_input, spec.sigma_input), 4), max_model_len - 4)
        output = min(max(lognormal_length(rng, spec.mean_output, spec.sigma_output), 4), max_model_len - prompt)
        pairs.append((prompt, output))
    return pairs


def saturating_rate(lengths: Iterable[tuple[int, int]], kv_slots: int) -> float:
    """Arrivals per step at which the offered K/V (Little's law) equals the pool."""
    lengths = list(lengths)
    token_steps = sum(out * (prompt + (out - 1) / 2) for prompt, out in lengths) / len(lengths)
    return kv_slots / token_steps


def poisson_steps(num: int, rate: float, seed: int, name: str) -> list[int]:
    """Arrival steps of a Poisson process with ``rate`` arrivals per step."""
    rng = random.Random(f"{seed}-{name}-arrivals")
    now, steps = 0.0, []
    for _ in range(num):
        now += rng.expovariate(rate)
        steps.append(int(now))
    return steps


def make_trace(lengths: list[tuple[int, int]], arrivals: list[int]) -> list[TraceRequest]:
    return [TraceRequest(i, step, prompt, out) for i, (step, (prompt, out)) in enumerate(zip(arrivals, lengths))]


# ------------------------------------------------------------------------ per-step series
@dataclass
class StepSeries:
    """Slots per category at every busy step of one scheme's run."""

    steps: list[int] = field(default_factory=list)
    token_states: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    internal: list[int] = field(default_factory=list)
    external: list[int] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)

    def add(self, step: int, token_states: int, reserved: int, internal: int, external: int, batch: int) -> None:
        assert min(token_states, reserved, internal, external) >= 0 and batch > 0, (
            step, token_states, reserved, internal, external, batch)
        self.steps.append(step)
        self.token_states.append(token_states)
        self.reserved.append(reserved)
        self.internal.append(internal)
        self.external.append(external)
        self.batch.append(batch)

    def held(self) -> list[int]:
        """Slots allocated or reserved to requests at each step."""
        return [t + r + i for t, r, i in zip(self.token_states, self.reserved, self.internal)]


def summarize(series: StepSeries, kv_slots: int) -> dict[str, float]:
    """Percentages of the non-unused memory (ratio of sums over busy steps), mean batch, steps."""
    totals = {c: sum(getattr(series, c)) for c in CATEGORIES}
    denom = sum(totals.values())
    assert denom > 0 and series.steps, "no busy step"
    summary = {f"{c}_pct": 100.0 * totals[c] / denom for c in CATEGORIES}
    summary["waste_pct"] = 100.0 - summary["token_states_pct"]
    summary["held_pct_of_pool"] = 100.0 * sum(series.held()) / (kv_slots * len(series.steps))
    summary["mean_batch"] = sum(series.batch) / len(series.batch)
    summary["busy_steps"] = len(series.steps)
    summary["last_step"] = series.steps[-1]
    return summary


# ------------------------------------------------------------------------------ paged run
@dataclass(frozen=True)
class PoolLimits:
    """The KV pool and per-step limits every scheme shares."""

    kv_slots: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


def make_request(item: TraceRequest, trace_name: str) -> Request:
    """A request whose prompt tokens are unique to it (so prefix caching could never hit)."""
    params = SamplingParams(max_tokens=item.output_len, ignore_eos=True)
    prompt = [item.index + 1] * item.prompt_len
    return Request(f"{trace_name}-{item.index}", prompt, params, eos_token_ids=None,
                   max_tokens=item.output_len, arrival_time=float(item.arrival_step))


def fake_model(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Token 1 for each request whose K/V caught up with its tokens; nothing for a prompt chunk."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append([1] if request.num_computed_tokens == request.num_tokens else [])
    return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))


def sample_paged(scheduler: Scheduler, out: SchedulerOutput, step: int, series: StepSeries) -> None:
    """Record the K/V held (token states) and the slots of blocks in use after ``schedule()``."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    stored = sum(r.num_computed_tokens for r in scheduler.running)
    held = (pool.num_usable_blocks - pool.num_free_blocks) * kv.block_size
    series.add(step, stored, 0, held - stored, 0, len(out.num_scheduled_tokens))


def simulate_paged(trace: list[TraceRequest], limits: PoolLimits, trace_name: str) -> tuple[StepSeries, int]:
    """Replay ``trace`` through the real scheduler; returns the series and the number of preemptions."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
                        max_model_len=limits.max_model_len),
        CacheConfig(block_size=limits.block_size), num_kv_blocks=limits.kv_slots // limits.block_size + 1)
    pending, series, step = deque(trace), StepSeries(), 0
    while pending or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            step = max(step, pending[0].arrival_step)
        while pending and pending[0].arrival_step <= step:
            scheduler.add_request(make_request(pending.popleft(), trace_name))
        out = scheduler.schedule()
        assert out.num_scheduled_tokens, f"step {step}: nothing scheduled with requests waiting"
        sample_paged(scheduler, out, step, series)
        scheduler.update_from_output(out, fake_model(scheduler, out))
        step += 1
    return series, scheduler.stats.num_preemptions


# ------------------------------------------------------------------ contiguous baselines
class ContiguousAllocator:
    """First-fit allocation of contiguous extents of [0, size); freed extents are merged."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.starts: list[int] = [0]
        self.lengths: list[int] = [size]
        self._largest: int | None = size

    def allocate(self, length: int) -> int | None:
        """Start of the first free extent with room for ``length`` slots, or None."""
        for i, free_len in enumerate(self.lengths):
            if free_len >= length:
                start = self.starts[i]
                if free_len == length:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i] += length
                    self.lengths[i] -= length
                self._largest = None
                return start
        return None

    def release(self, start: int, length: int) -> None:
        """Return [start, start + length), merging it with free neighbours."""
        i = bisect_left(self.starts, start)
        assert i == len(self.starts) or start + length <= self.starts[i], "double free"
        assert i == 0 or self.starts[i - 1] + self.lengths[i - 1] <= start, "double free"
        self.starts.insert(i, start)
        self.lengths.insert(i, length)
        if i + 1 < len(self.starts) and start + length == self.starts[i + 1]:
            self.lengths[i] += self.lengths.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.lengths[i - 1] == start:
            self.lengths[i - 1] += self.lengths.pop(i)
            self.starts.pop(i)
        self._largest = None

    def largest_free(self) -> int:
        if self._largest is None:
            self._largest = max(self.lengths, default=0)
        return self._largest

    @property
    def num_free(self) -> int:
        return sum(self.lengths)


def reservation_policy(scheme: str, max_model_len: int) -> Callable[[TraceRequest], int]:
    """Slots a request reserves at admission under an Orca scheme."""
    if scheme == "orca-max":
        return lambda item: max_model_len
    if scheme == "orca-pow2":
        return lambda item: min(1 << (item.total_len - 1).bit_length(), max_model_len)
    assert scheme == "orca-oracle", scheme
    return lambda item: item.total_len


@dataclass
class _Running:
    """Running contiguous requests as sums, so that a step costs O(1) besides events."""

    count: int = 0
    sum_prompt: int = 0
    sum_admit_step: int = 0
    sum_final_len: int = 0
    sum_reserved: int = 0

    def add(self, item: TraceRequest, step: int, reserved: int, sign: int = 1) -> None:
        self.count += sign
        self.sum_prompt += sign * item.prompt_len
        self.sum_admit_step += sign * step
        self.sum_final_len += sign * item.total_len
        self.sum_reserved += sign * reserved

    def stored(self, step: int) -> int:
        """K/V held at ``step``: prompt + (step - admit_step) tokens per request."""
        return self.sum_prompt + self.count * step - self.sum_admit_step


class ContiguousSimulator:
    """Iteration-level FCFS serving where each request reserves one contiguous extent."""

    def __init__(self, limits: PoolLimits, reserve: Callable[[TraceRequest], int]) -> None:
        self.limits = limits
        self.reserve = reserve
        self.allocator = ContiguousAllocator(limits.kv_slots)
        self.running = _Running()
        self.waiting: deque[TraceRequest] = deque()
        self.finishes: list[tuple[int, int, int, int, int]] = []
        """Heap of (finish step, index, start, reserved, admit step)."""
        self._items: dict[int, TraceRequest] = {}

    def run(self, trace: list[TraceRequest]) -> StepSeries:
        pending, series, step = deque(trace), StepSeries(), 0
        while pending or self.waiting or self.running.count:
            if not self.waiting and not self.running.count:
                step = max(step, pending[0].arrival_step)
            while pending and pending[0].arrival_step <= step:
                self.waiting.append(pending.popleft())
            admitted = self._admit(step)
            self._sample(step, series, admitted)
            self._finish(step)
            step += 1
        return series

    def _admit(self, step: int) -> int:
        """Admit FCFS while an extent, the batch limit and the token budget allow."""
        budget = self.limits.max_num_batched_tokens - self.running.count  # one decode token each
        admitted = 0
        while self.waiting and self.running.count < self.limits.max_num_seqs:
            item = self.waiting[0]
            alone = self.running.count == 0  # a prompt larger than the whole budget runs alone
            if item.prompt_len > budget and not alone:
                break
            reserved = self.reserve(item)
            start = self.allocator.allocate(reserved)
            if start is None:
                break
            self.waiting.popleft()
            self.running.add(item, step, reserved)
            self._items[item.index] = item
            heapq.heappush(self.finishes, (step + item.output_len - 1, item.index, start, reserved, step))
            budget -= item.prompt_len
            admitted += 1
        return admitted

    def _sample(self, step: int, series: StepSeries, admitted: int) -> None:
        running = self.running
        assert running.count > 0, f"step {step}: nothing runs"
        stored = running.stored(step)
        free = self.limits.kv_slots - running.sum_reserved
        assert free == self.allocator.num_free, (free, self.allocator.num_free)
        head_blocked = bool(self.waiting) and self.reserve(self.waiting[0]) > self.allocator.largest_free()
        series.add(step, stored, running.sum_final_len - stored, running.sum_reserved - running.sum_final_len,
                   free if head_blocked else 0, running.count)

    def _finish(self, step: int) -> None:
        """Free the requests that sampled their last token this step."""
        while self.finishes and self.finishes[0][0] == step:
            _, index, start, reserved, admit_step = heapq.heappop(self.finishes)
            self.running.add(self._items.pop(index), admit_step, reserved, sign=-1)
            self.allocator.release(start, reserved)


def simulate_contiguous(trace: list[TraceRequest], limits: PoolLimits, scheme: str) -> StepSeries:
    return ContiguousSimulator(limits, reservation_policy(scheme, limits.max_model_len)).run(trace)


# -------------------------------------------------------------------------------- sharing
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def parallel_sampling_blocks(prompt_len: int, output_len: int, n: int, block_size: int) -> tuple[int, int]:
    """(unshared, shared) block-steps of one request with n parallel samples."""
    shared_prompt = prompt_len // block_size
    unshared = shared = 0
    for num_tokens in range(prompt_len, prompt_len + output_len):
        blocks = cdiv(num_tokens, block_size)
        unshared += n * blocks
        shared += blocks if num_tokens == prompt_len else shared_prompt + n * (blocks - shared_prompt)
    return unshared, shared


def beam_search_blocks(prompt_len: int, output_len: int, width: int, block_size: int,
                       divergence: int) -> tuple[int, int]:
    """(unshared, shared) block-steps of one request under the beam model (module docstring)."""
    unshared = shared = 0
    for num_tokens in range(prompt_len, prompt_len + output_len):
        blocks = cdiv(num_tokens, block_size)
        common = max(prompt_len, num_tokens - divergence) // block_size  # full blocks all beams share
        unshared += width * blocks
        shared += blocks if num_tokens == prompt_len else common + width * (blocks - common)
    return unshared, shared


def forked_sampling_block_steps(manager: KVCacheManager, item: TraceRequest, n: int) -> int:
    """Shared block-steps of one request with n samples, measured on the real KVCacheManager.

    The prompt is allocated once, n - 1 samples are forked from it (``fork``), then every
    sample grows a block at a time; the manager copies the shared partial block on write.
    Blocks in use only change at block boundaries, so each sample advances to the end of
    its current block in one ``allocate_slots`` call and the count is weighted by the tokens.
    """
    pool, bs = manager.block_pool, manager.block_size
    prompt, last = [item.index + 1] * item.prompt_len, item.total_len - 1
    params = SamplingParams(max_tokens=item.output_len, ignore_eos=True)
    samples = [Request(f"{item.index}.{i}", prompt, params, None, item.output_len) for i in range(n)]
    assert manager.allocate_slots(samples[0], item.prompt_len) is not None, "pool sized for the request"
    for child in samples[1:]:
        manager.fork(samples[0], child)
    for sample in samples:
        sample.num_computed_tokens = item.prompt_len
    in_use = pool.num_usable_blocks - pool.num_free_blocks
    block_steps, stored = in_use, item.prompt_len  # the step that computed the prompt
    while stored < last:
        end = min(last, cdiv(stored + 1, bs) * bs)  # K/V of stored + 1 .. end lie in the same blocks
        for i, sample in enumerate(samples):
            for _ in range(end - stored):
                sample.append_output_token(SAMPLE_TOKEN_BASE + i)  # distinct per sample: no shared cache hits
            assert manager.allocate_slots(sample, end - stored) is not None, "pool sized for the request"
            sample.num_computed_tokens = end
        block_steps += (pool.num_usable_blocks - pool.num_free_blocks) * (end - stored)
        stored = end
    for sample in samples:
        manager.free(sample)
    return block_steps


def sharing_savings(trace: list[TraceRequest], block_size: int, max_model_len: int, widths: Iterable[int],
                    divergence: int, use_manager: bool) -> list[dict[str, float | int | str]]:
    """Saving by block sharing for parallel sampling and beam search at each width.

    Parallel sampling is measured on the real KVCacheManager when ``use_manager`` (and it can
    fork), else counted by ``parallel_sampling_blocks``; beam search is always the model.
    """
    rows = []
    for mode in ("parallel_sampling", "beam_search"):
        for width in widths:
            method = "KVCacheManager.fork" if use_manager and mode == "parallel_sampling" else "analytic"
            manager = KVCacheManager(width * cdiv(max_model_len, block_size) + 1, block_size) if (
                method != "analytic") else None
            unshared = shared = 0
            for item in trace:
                if mode == "beam_search":
                    u, s = beam_search_blocks(item.prompt_len, item.output_len, width, block_size, divergence)
                else:
                    u, s = parallel_sampling_blocks(item.prompt_len, item.output_len, width, block_size)
                    if manager is not None:
                        s = forked_sampling_block_steps(manager, item, width)
                unshared, shared = unshared + u, shared + s
            rows.append({"mode": mode, "width": width, "method": method, "unshared_block_steps": unshared,
                         "shared_block_steps": shared, "saving_pct": 100.0 * (1 - shared / unshared)})
    return rows


# ------------------------------------------------------------------------------ the bench
@dataclass(frozen=True)
class MemoryBenchConfig:
    """Options of ``pagedllm bench memory`` (see the module docstring)."""

    traces: tuple[str, ...] = ("sharegpt", "alpaca")
    num_requests: int = 1000
    request_rate: float | None = None
    """Arrivals per step; None: each trace's saturating rate."""
    seed: int = 0
    max_model_len: int = 2048
    block_size: int = 16
    kv_tokens: int = 32768
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    sharing_traces: tuple[str, ...] = ("alpaca",)
    sharing_widths: tuple[int, ...] = (2, 4, 6)
    beam_divergence: int = 32

    def __post_init__(self) -> None:
        bad = ValidationError.bad_value
        for name in ("traces", "sharing_traces"):
            unknown = [t for t in getattr(self, name) if t not in TRACE_SPECS]
            if unknown:
                raise bad(name, unknown, f"names among {sorted(TRACE_SPECS)}")
        for name in ("num_requests", "block_size", "max_num_seqs", "max_num_batched_tokens", "beam_divergence"):
            if getattr(self, name) < 1:
                raise bad(name, getattr(self, name), "a positive integer")
        if self.max_model_len < 8:
            raise bad("max_model_len", self.max_model_len, ">= 8")
        if self.request_rate is not None and not 0 < self.request_rate < math.inf:
            raise bad("request_rate", self.request_rate, "a positive finite number")
        if self.kv_slots < self.max_model_len:
            raise bad("kv_tokens", self.kv_tokens, f"at least max_model_len ({self.max_model_len}) slots")
        if any(w < 1 for w in self.sharing_widths):
            raise bad("sharing_widths", self.sharing_widths, "positive integers")

    @property
    def kv_slots(self) -> int:
        """Token slots of the pool: whole blocks only, the same for every scheme."""
        return self.kv_tokens // self.block_size * self.block_size

    def limits(self) -> PoolLimits:
        return PoolLimits(self.kv_slots, self.block_size, self.max_model_len, self.max_num_seqs,
                          self.max_num_batched_tokens)


@dataclass
class TraceRun:
    """Everything measured on one trace."""

    name: str
    rate: float
    trace: list[TraceRequest]
    series: dict[str, StepSeries] = field(default_factory=dict)
    summary: dict[str, dict[str, float]] = field(default_factory=dict)


def build_trace(config: MemoryBenchConfig, name: str) -> tuple[list[TraceRequest], float]:
    """The seeded trace of ``name`` and the arrival rate used."""
    lengths = draw_lengths(TRACE_SPECS[name], config.num_requests, config.max_model_len, config.seed)
    rate = config.request_rate or saturating_rate(lengths, config.kv_slots)
    return make_trace(lengths, poisson_steps(config.num_requests, rate, config.seed, name)), rate


def run_trace(config: MemoryBenchConfig, name: str) -> TraceRun:
    """Run every scheme on one trace."""
    trace, rate = build_trace(config, name)
    run = TraceRun(name, rate, trace)
    limits = config.limits()
    run.series[PAGED], preemptions = simulate_paged(trace, limits, name)
    for scheme in ORCA_SCHEMES:
        run.series[scheme] = simulate_contiguous(trace, limits, scheme)
    for scheme, series in run.series.items():
        run.summary[scheme] = summarize(series, config.kv_slots)
    run.summary[PAGED]["num_preemptions"] = preemptions
    return run


def run_benchmark(config: MemoryBenchConfig) -> tuple[dict, list[TraceRun]]:
    """The JSON-able result and the per-trace runs (for plotting)."""
    runs = [run_trace(config, name) for name in config.traces]
    sharing = {}
    for name in config.sharing_traces:
        trace = next((r.trace for r in runs if r.name == name), None) or build_trace(config, name)[0]
        sharing[name] = sharing_savings(trace, config.block_size, config.max_model_len, config.sharing_widths,
                                        config.beam_divergence, use_manager=True)
    result = {
        "config": {**asdict(config), "kv_slots": config.kv_slots},
        "traces": {r.name: trace_result(r) for r in runs},
        "sharing": sharing,
    }
    return result, runs


def trace_result(run: TraceRun) -> dict:
    return {
        "distribution": TRACE_SPECS[run.name].describe(),
        "mean_input_len": sum(r.prompt_len for r in run.trace) / len(run.trace),
        "mean_output_len": sum(r.output_len for r in run.trace) / len(run.trace),
        "request_rate_per_step": run.rate,
        "schemes": run.summary,
    }


# ------------------------------------------------------------------------------- output
