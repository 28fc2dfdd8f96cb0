"""`pagedllm bench memory`: the paper's KV-waste analysis on our scheduler vs contiguous baselines."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.entrypoints.bench.memory_sim.benchmark import SCHEMES, MemoryBenchConfig, run_benchmark
from pagedllm.entrypoints.bench.memory_sim.contiguous import ORCA_SCHEMES, ContiguousAllocator, simulate_contiguous
from pagedllm.entrypoints.bench.memory_sim.series import PoolLimits
from pagedllm.entrypoints.bench.memory_sim.sharing import beam_search_blocks, parallel_sampling_blocks, sharing_savings
from pagedllm.entrypoints.bench.traces import TRACE_SPECS, TraceRequest, draw_lengths
from pagedllm.errors import ValidationError

NUM_REQUESTS = 200


@pytest.fixture(scope="module")
def result() -> dict:
    return run_benchmark(MemoryBenchConfig(num_requests=NUM_REQUESTS))[0]


def _token_share(result: dict, trace: str, scheme: str) -> float:
    return result["traces"][trace]["schemes"][scheme]["token_states_pct"]


def test_every_scheme_is_measured_and_the_categories_add_up(result: dict) -> None:
    for trace in ("sharegpt", "alpaca"):
        schemes = result["traces"][trace]["schemes"]
        assert set(schemes) == set(SCHEMES)
        for s in schemes.values():
            total = s["token_states_pct"] + s["reserved_pct"] + s["internal_pct"] + s["external_pct"]
            assert total == pytest.approx(100.0)
            assert 0 < s["mean_batch"] <= 256 and s["busy_steps"] > 0
        paged = schemes["paged"]
        assert paged["reserved_pct"] == 0 and paged["external_pct"] == 0  # paging reserves nothing
        assert schemes["orca-oracle"]["internal_pct"] == 0  # exact reservations pad nothing
        assert schemes["orca-max"]["external_pct"] == 0  # 32768 slots = 16 extents of 2048, no holes
    sharegpt = result["traces"]["sharegpt"]["schemes"]  # variable-size extents leave holes
    assert sharegpt["orca-pow2"]["external_pct"] > 0 and sharegpt["orca-oracle"]["external_pct"] > 0


def test_paged_wastes_little_and_every_contiguous_scheme_more(result: dict) -> None:
    assert result["traces"]["sharegpt"]["schemes"]["paged"]["waste_pct"] < 4.0
    # Alpaca sequences hold ~60 tokens: the half-empty last block of 16 costs ~10%, which is
    # still far below every baseline (the < 4% bound at this length needs smaller blocks, below).
    assert result["traces"]["alpaca"]["schemes"]["paged"]["waste_pct"] < 15.0
    for trace in ("sharegpt", "alpaca"):
        paged = _token_share(result, trace, "paged")
        for scheme in ORCA_SCHEMES:
            assert _token_share(result, trace, scheme) < paged - 20, (trace, scheme)
        max_, pow2, oracle = (_token_share(result, trace, s) for s in ORCA_SCHEMES)
        assert oracle >= pow2 >= max_, (trace, max_, pow2, oracle)


def test_paged_waste_is_the_last_block_tail() -> None:
    small = run_benchmark(MemoryBenchConfig(traces=("alpaca",), num_requests=NUM_REQUESTS, block_size=4,
                                            sharing_traces=()))[0]
    assert small["traces"]["alpaca"]["schemes"]["paged"]["waste_pct"] < 4.0
    exact = run_benchmark(MemoryBenchConfig(traces=("alpaca",), num_requests=NUM_REQUESTS, block_size=1,
                                            sharing_traces=()))[0]
    assert exact["traces"]["alpaca"]["schemes"]["paged"]["waste_pct"] == 0.0


def test_sharing_saves_more_for_beams_than_for_samples(result: dict) -> None:
    rows = {(r["mode"], r["width"]): r["saving_pct"] for r in result["sharing"]["alpaca"]}
    assert set(rows) == {(m, w) for m in ("parallel_sampling", "beam_search") for w in (2, 4, 6)}
    for width in (2, 4, 6):
        assert 0 < rows["parallel_sampling", width] < rows["beam_search", width]
    for mode in ("parallel_sampling", "beam_search"):
        assert rows[mode, 2] < rows[mode, 4] < rows[mode, 6]


def test_sharing_block_counts_by_hand() -> None:
    # prompt 20 tokens (1 full block + 4), 3 steps of 20, 21, 22 tokens = 2 blocks each, n = 2
    assert parallel_sampling_blocks(20, 3, 2, 16) == (12, 2 + 3 + 3)
    # prompt of exactly one block: at 16 tokens one copy; at 17 the prompt block + 3 own blocks
    assert beam_search_blocks(16, 2, 3, 16, divergence=1) == (3 + 6, 1 + 4)
    # divergence longer than the generation: only the prompt's full blocks are shared
    assert beam_search_blocks(20, 3, 2, 16, divergence=64) == parallel_sampling_blocks(20, 3, 2, 16)


def test_forked_samples_on_the_real_manager_match_the_count() -> None:
    trace = [TraceRequest(i, 0, p, o) for i, (p, o) in enumerate([(20, 3), (16, 40), (33, 17), (5, 60), (48, 1)])]
    rows = sharing_savings(trace, 16, 2048, (2, 3), divergence=32, use_manager=True)
    counted = sharing_savings(trace, 16, 2048, (2, 3), divergence=32, use_manager=False)
    for row, ref in zip(rows, counted):
        assert row["method"] == ("KVCacheManager.fork" if row["mode"] == "parallel_sampling" else "analytic")
        assert row["shared_block_steps"] == ref["shared_block_steps"], (row, ref)


def test_contiguous_allocator_first_fit_and_merge() -> None:
    alloc = ContiguousAllocator(100)
    assert [alloc.allocate(n) for n in (30, 30, 30)] == [0, 30, 60]
    assert alloc.allocate(11) is None and alloc.largest_free() == 10
    alloc.release(0, 30)
    alloc.release(60, 30)
    assert alloc.largest_free() == 40 and alloc.num_free == 70
    assert alloc.allocate(20) == 0  # first fit: the lowest extent that is large enough
    alloc.release(30, 30)
    assert alloc.starts == [20] and alloc.lengths == [80]  # merged with both neighbours


def test_external_fragmentation_is_counted_while_the_head_cannot_fit() -> None:
    # 100 slots: a takes [0, 60) and b [60, 90) at step 0; c needs 50 and waits while 10 slots
    # (then 40, once b finished after step 4) lie free, until a finishes after step 9.
    trace = [TraceRequest(0, 0, 50, 10), TraceRequest(1, 0, 25, 5), TraceRequest(2, 0, 40, 10)]
    limits = PoolLimits(kv_slots=100, block_size=4, max_model_len=64, max_num_seqs=8,
                        max_num_batched_tokens=1000)
    series = simulate_contiguous(trace, limits, "orca-oracle")
    assert series.steps == list(range(20))  # c runs steps 10 .. 19
    assert (series.token_states[0], series.reserved[0], series.internal[0]) == (75, 15, 0)
    assert series.external[:5] == [10] * 5 and series.external[5:10] == [40] * 5 and series.external[10:] == [0] * 10
    assert series.token_states[4] == 75 + 2 * 4 and series.token_states[9] == 59
    assert series.token_states[10] == 40 and series.token_states[19] == 49 and series.batch[10:] == [1] * 10


def test_trace_lengths_follow_the_documented_distributions() -> None:
    for name, spec in TRACE_SPECS.items():
        pairs = draw_lengths(spec, 4000, 2048, seed=0)
        assert all(4 <= p and 4 <= o and p + o <= 2048 for p, o in pairs)
        assert sum(p for p, _ in pairs) / len(pairs) == pytest.approx(spec.mean_input, rel=0.15), name
        assert sum(o for _, o in pairs) / len(pairs) == pytest.approx(spec.mean_output, rel=0.15), name
        assert draw_lengths(spec, 50, 2048, seed=0) == pairs[:50] != draw_lengths(spec, 50, 2048, seed=1)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValidationError, match="kv_tokens"):
        MemoryBenchConfig(kv_tokens=1000)
    with pytest.raises(ValidationError, match="request_rate"):
        MemoryBenchConfig(request_rate=0.0)


def test_cli_prints_tables_json_and_writes_the_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "memory.json", tmp_path / "memory.png"
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "memory", "--num-requests", str(NUM_REQUESTS),
         "--output-json", str(out), "--plot", str(png)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    assert "orca-pow2" in proc.stdout and "beam_search" in proc.stdout
    assert set(result["traces"]) == {"sharegpt", "alpaca"} and result["config"]["num_requests"] == NUM_REQUESTS
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_bench_loads_no_torch(tmp_path: Path) -> None:
    code = ("import sys; from pagedllm.entrypoints.bench import memory; "
            f"rc = memory.main(['--num-requests', '50', '--plot', {str(tmp_path / 'p.png')!r}]); "
            "assert rc == 0 and 'torch' not in sys.modules, 'torch loaded'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    bad = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.bench.memory", "--kv-tokens", "100"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "kv_tokens" in bad.stderr and "Traceback" not in bad.stderr
