"""``pagedllm bench memory``: the PagedAttention paper's memory-waste analysis on our scheduler.

The simulator itself lives in :mod:`pagedllm.entrypoints.bench.memory_sim`; this module is its
command line, tables and plot (matplotlib is imported only for ``--plot``).
"""
from __future__ import annotations

import argparse
import sys

from pagedllm.entrypoints.bench import emit_json
from pagedllm.entrypoints.bench.memory_sim.benchmark import MemoryBenchConfig, TraceRun, run_benchmark
from pagedllm.entrypoints.bench.traces import TRACE_SPECS
from pagedllm.entrypoints.cli_args import SubParsers
from pagedllm.errors import ValidationError

PLOT_POINTS = 2000
"""Most points per plotted series (longer series are strided)."""


def format_tables(result: dict) -> str:
    """The scheme table and the sharing table."""
    cfg = result["config"]
    lines = [f"KV memory: {cfg['kv_slots']} token slots, block_size {cfg['block_size']}, max_model_len "
             f"{cfg['max_model_len']}, max_num_seqs {cfg['max_num_seqs']}, {cfg['num_requests']} requests, "
             f"seed {cfg['seed']}. % of memory in use or unusable, summed over busy steps."]
    for name, tr in result["traces"].items():
        lines.append(f"  {name}: mean input {tr['mean_input_len']:.1f}, mean output {tr['mean_output_len']:.1f}, "
                     f"{tr['request_rate_per_step']:.3f} requests/step")
    header = (f"{'trace':<9} {'scheme':<12} {'token states':>12} {'reserved':>9} {'internal':>9} {'external':>9} "
              f"{'mean batch':>10} {'busy steps':>10} {'held/pool':>9}")
    lines += ["", header, "-" * len(header)]
    for name, tr in result["traces"].items():
        for scheme, s in tr["schemes"].items():
            lines.append(f"{name:<9} {scheme:<12} {s['token_states_pct']:>11.1f}% {s['reserved_pct']:>8.1f}% "
                         f"{s['internal_pct']:>8.1f}% {s['external_pct']:>8.1f}% {s['mean_batch']:>10.1f} "
                         f"{s['busy_steps']:>10d} {s['held_pct_of_pool']:>8.1f}%")
    if result["sharing"]:
        lines += ["", f"Memory saved by block sharing (block_size {cfg['block_size']}, block-steps over each "
                      f"generation; beams diverge over the last {cfg['beam_divergence']} tokens)"]
        header = (f"{'trace':<9} {'mode':<18} {'n/k':>4} {'unshared':>12} {'shared':>12} {'saving':>8}  "
                  f"{'counted by'}")
        lines += [header, "-" * len(header)]
        for name, rows in result["sharing"].items():
            for row in rows:
                lines.append(f"{name:<9} {row['mode']:<18} {row['width']:>4d} {row['unshared_block_steps']:>12d} "
                             f"{row['shared_block_steps']:>12d} {row['saving_pct']:>7.1f}%  {row['method']}")
    return "\n".join(lines)


def write_plot(runs: list[TraceRun], kv_slots: int, path: str) -> None:
    """KV use over time: fraction of the pool holding token states (solid) and held (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        for color, (scheme, series) in zip(("C0", "C1", "C2", "C3"), run.series.items()):
            stride = max(1, len(series.steps) // PLOT_POINTS)
            steps = series.steps[::stride]
            ax.plot(steps, [v / kv_slots for v in series.token_states[::stride]], color=color, lw=1,
                    label=f"{scheme}: token states")
            ax.plot(steps, [v / kv_slots for v in series.held()[::stride]], color=color, lw=1, ls="--",
                    label=f"{scheme}: held")
        ax.set_title(f"{run.name} ({run.rate:.3f} requests/step)")
        ax.set_xlabel("step")
        ax.set_ylabel("fraction of KV memory")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------- CLI
HELP = """Reproduce the PagedAttention paper's KV-memory waste analysis on pagedllm's scheduler
and block manager (no model runs). Traces: sharegpt = input lognormal(mean 161, sigma 1.2),
output lognormal(mean 338, sigma 0.8); alpaca = input lognormal(mean 19, sigma 0.6), output
lognormal(mean 58, sigma 0.9); prompt clipped to [4, max_model_len - 4], output to
[4, max_model_len - prompt]. Poisson arrivals per scheduler step (default: the rate at which
the offered K/V equals the pool). Schemes: paged (the real Scheduler), orca-max / orca-pow2 /
orca-oracle (contiguous first-fit reservations of max_model_len / next power of two / exact
length). Percentages are sums over busy steps of each category (token states, reserved,
internal and external fragmentation) over their total; free slots nobody waits for are left
out. Sharing: block-steps held with vs without sharing for n parallel samples (the real
KVCacheManager's fork when it has one) and k beams (beams share all but the last
--beam-divergence tokens)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = MemoryBenchConfig()
    p.add_argument("--traces", nargs="+", choices=sorted(TRACE_SPECS), default=list(d.traces))
    p.add_argument("--num-requests", type=int, default=d.num_requests)
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals per scheduler step (default: each trace's saturating rate, "
                        "kv_slots / mean(output * (prompt + (output - 1) / 2)))")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--kv-tokens", type=int, default=d.kv_tokens,
                   help="token slots of the KV pool, the same for every scheme (paged: kv_tokens // block_size "
                        "blocks + the null block)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--sharing-traces", nargs="*", choices=sorted(TRACE_SPECS), default=list(d.sharing_traces))
    p.add_argument("--sharing-widths", nargs="+", type=int, default=list(d.sharing_widths),
                   help="parallel samples n and beam widths k")
    p.add_argument("--beam-divergence", type=int, default=d.beam_divergence,
                   help="beam model: beams share all but the last this-many tokens")
    p.add_argument("--output-json", default=None, help="also write the JSON result to this file")
    p.add_argument("--plot", default=None, help="write a PNG of KV use over time per scheme and trace")


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("memory", help="KV-memory waste of paged vs contiguous allocation (no model)",
                       description=HELP)
    add_arguments(p)
    p.set_defaults(func=run)


def config_from(ns: argparse.Namespace) -> MemoryBenchConfig:
    return MemoryBenchConfig(
        traces=tuple(ns.traces), num_requests=ns.num_requests, request_rate=ns.request_rate, seed=ns.seed,
        max_model_len=ns.max_model_len, block_size=ns.block_size, kv_tokens=ns.kv_tokens,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        sharing_traces=tuple(ns.sharing_traces), sharing_widths=tuple(ns.sharing_widths),
        beam_divergence=ns.beam_divergence)


def run(ns: argparse.Namespace) -> int:
    config = config_from(ns)
    result, runs = run_benchmark(config)
    print(format_tables(result))
    if ns.plot:
        write_plot(runs, config.kv_slots, ns.plot)
    emit_json(result, ns.output_json)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedllm.entrypoints.bench.memory``: the bench without the CLI's other commands."""
    parser = argparse.ArgumentParser(prog="pagedllm bench memory", description=HELP)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
