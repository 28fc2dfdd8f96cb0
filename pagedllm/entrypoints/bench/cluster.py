"""``pagedllm plan --machines N ...``: a model over N machines on paper, from its config alone (no weight is read,
nothing is timed). For each tensor x pipeline layout with one rank per machine (tensor_parallel_size x
pipeline_parallel_size = N), what each rank holds (worker/memory_plan.py: the engine's own per-rank figures), the
batch its KV room allows, and a decode step's time from the machines' read bandwidth and matrix throughput and
the links' bandwidth and latency; with the bytes each link carries per generated token.

The step model, per stage and its tensor-parallel rank: max(bytes read / bandwidth, flops / throughput) (the
weights but the embedding table, and the batch's KV, read once a step; 2 flops a weight a token, 4 a context
position a token and width), plus two ring all-reduces a layer over the stage's ranks (2 (t - 1) latencies +
2 (t - 1) / t of the activations over the link) and the vocabulary-parallel head's all-gather; between stages
one message of the hidden states and residual.
One batch in flight (how stages run today): the stages one after another. ``p`` micro-batches in flight (vLLM's
batch queue): every stage busy, a token for each micro-batch every ``p`` stage periods.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from pagedllm.config import parse_memory
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.errors import ValidationError

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Machines:
    """The machines and the network between them (the planner's parameters)."""

    memory: int
    """Bytes each machine gives its rank (weights + KV): its memory less what the OS and the runtime keep."""
    read_gbs: float
    """Memory read bandwidth, GB/s."""
    tflops: float
    """Matrix throughput in the model's dtype, TFLOP/s."""
    link_gbps: float
    """Network bandwidth between two machines, Gb/s."""
    latency_us: float
    """One message's latency, microseconds."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the step model needs of the model and of one layout."""

    ranks: list[Any]
    """Each rank's bytes (EngineArgs.rank_memory_plan: weights, kv, layers)."""
    kv_token: list[int]
    """Bytes of KV one token takes on each rank."""
    hidden: int
    vocab: int
    itemsize: int
    tp: int
    pp: int
    table: int
    """Bytes of the embedding table a first-stage rank holds but does not read in a decode step (a row a token),
    unless it is the head's too (tied, one stage)."""


def layout_shape(args: EngineArgs, tp: int, pp: int) -> Shape:
    """The engine's per-rank plan of ``args`` split tp x pp (two KV blocks each: the batch is the planner's)."""
    staged = dataclasses.replace(args, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_kv_blocks=2,
                                 distributed_executor_backend="ray" if tp * pp > 1 else "uni")
    config, arch = staged.create_engine_config()
    ranks = staged.rank_memory_plan()
    kv_token = [r.kv // 2 // config.cache.block_size for r in ranks]  # (2 blocks asked: num_kv_blocks above)
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[config.model.dtype]
    table = 0 if arch.tie_word_embeddings and pp == 1 else -(-arch.vocab_size // tp) * arch.hidden_size * itemsize
    return Shape(ranks, kv_token, arch.hidden_size, arch.vocab_size, itemsize, tp, pp, table)


def _allreduce_s(nbytes: float, t: int, m: Machines) -> float:
    """A ring all-reduce of ``nbytes`` over ``t`` machines: 2 (t - 1) messages, 2 (t - 1) / t of the bytes each."""
    return 0.0 if t == 1 else 2 * (t - 1) * m.latency_us * 1e-6 + 2 * (t - 1) / t * nbytes * 8 / (m.link_gbps * 1e9)


def _stage_s(shape: Shape, m: Machines, stage: int, batch: float, context: int) -> float:
    """One stage's decode step for ``batch`` sequences of ``context`` tokens: its slowest rank's reads or flops,
    then its all-reduces (two a layer, the embedding's on the first stage) and the head's all-gather (the last)."""
    tp, ranks = shape.tp, shape.ranks[stage * shape.tp:(stage + 1) * shape.tp]
    layers = ranks[0].layers[1] - ranks[0].layers[0]
    compute = 0.0
    for i, rank in enumerate(ranks):
        read = rank.weights - (stage == 0) * shape.table + batch * context * shape.kv_token[stage * tp + i]
        flops = 2 * rank.weights / shape.itemsize * batch + 4 * batch * context * shape.hidden / tp * layers
        compute = max(compute, read / (m.read_gbs * 1e9), flops / (m.tflops * 1e12))
    reduces = 2 * layers + (stage == 0)
    comm = reduces * _allreduce_s(batch * shape.hidden * shape.itemsize, tp, m)
    if stage == shape.pp - 1 and tp > 1:  # every rank's share of the logits (float32) to every rank
        comm += (tp - 1) * m.latency_us * 1e-6 + (tp - 1) / tp * batch * shape.vocab * 4 * 8 / (m.link_gbps * 1e9)
    return compute + comm


def _hop_s(shape: Shape, m: Machines, batch: float) -> float:
    """The hidden states and residual of ``batch`` tokens from one stage to the next."""
    return m.latency_us * 1e-6 + 2 * batch * shape.hidden * shape.itemsize * 8 / (m.link_gbps * 1e9)


def decode_step(shape: Shape, m: Machines, batch: int, context: int) -> dict[str, float]:
    """Seconds of one decode step of ``batch`` sequences with one batch in flight, and tokens/s with one and with
    pipeline_parallel_size micro-batches in flight."""
    pp = shape.pp
    one = sum(_stage_s(shape, m, s, batch, context) for s in range(pp))
    one += (pp - 1) * _hop_s(shape, m, batch) + (pp > 1) * m.latency_us * 1e-6  # (the sampled tokens, back)
    micro = -(-batch // pp)  # sequences of a micro-batch: at most pp of them, none empty
    period = max(_stage_s(shape, m, s, micro, context) for s in range(pp)) + (pp > 1) * _hop_s(shape, m, micro)
    cycle = sum(_stage_s(shape, m, s, micro, context) + (pp > 1) * _hop_s(shape, m, micro) for s in range(pp))
    cycle = max(cycle, -(-batch // micro) * period)  # fewer micro-batches than stages: each still passes them all
    return {"step_ms": one * 1e3, "tokens_per_s": batch / one, "in_flight_tokens_per_s": batch / cycle}


def max_batch(shape: Shape, m: Machines, context: int) -> int:
    """Sequences of ``context`` tokens every rank's KV room holds (0: a rank's weights alone are over memory)."""
    return max(0, min((m.memory - r.weights) // max(1, kv * context) for r, kv in zip(shape.ranks, shape.kv_token)))


def link_bytes(shape: Shape) -> dict[str, float]:
    """Bytes a link carries per generated token: a tensor-parallel rank's all-reduces (its stage's layers, the
    ring's 2 (t - 1) / t), and the hidden states and residual between two stages."""
    layers = max(r.layers[1] - r.layers[0] for r in shape.ranks)
    tp = shape.tp
    ring = 0.0 if tp == 1 else 2 * (tp - 1) / tp * (2 * layers + 1) * shape.hidden * shape.itemsize
    return {"tp_link_bytes_per_token": ring, "pp_link_bytes_per_token": 2 * shape.hidden * shape.itemsize
            if shape.pp > 1 else 0.0}


def layouts(machines: int) -> list[tuple[int, int]]:
    """(tensor_parallel_size, pipeline_parallel_size) pairs of one rank per machine."""
    return [(tp, machines // tp) for tp in range(1, machines + 1) if machines % tp == 0]


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm plan``'s flags of the on-paper cluster plan (``--machines`` turns it on)."""
    g = p.add_argument_group("cluster plan (on paper, from the config: --machines turns it on)")
    g.add_argument("--machines", type=int, nargs="+", default=None, help="machine counts to plan (one rank each)")
    g.add_argument("--machine-memory", default="64GiB", help="each machine's memory (default %(default)s)")
    g.add_argument("--machine-reserve", default="4GiB", help="of it, what the OS, Python and torch keep (default "
                   "%(default)s); the rest holds the rank's weights and KV")
    g.add_argument("--machine-read-gbs", type=float, default=100.0,
                   help="memory read bandwidth of a machine, GB/s (default %(default)s)")
    g.add_argument("--machine-tflops", type=float, default=2.0,
                   help="matrix throughput of a machine in the model's dtype, TFLOP/s (default %(default)s)")
    g.add_argument("--link-gbps", type=float, nargs="+", default=[10.0, 100.0],
                   help="network bandwidths between machines, Gb/s (default %(default)s)")
    g.add_argument("--link-latency-us", type=float, default=50.0, help="one message's latency (default %(default)s)")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32], help="decode batches (default %(default)s)")
    g.add_argument("--context-len", type=int, default=2048, help="tokens of context a sequence holds (KV room, KV "
                   "reads; default %(default)s)")


def _check(ns: argparse.Namespace) -> int:
    """The bytes a machine gives its rank; ValidationError naming a flag out of range."""
    memory = parse_memory(ns.machine_memory, "machine_memory") - parse_memory(ns.machine_reserve, "machine_reserve")
    if memory <= 0:
        raise ValidationError.bad_value("machine_reserve", ns.machine_reserve, "less than --machine-memory")
    for name in ("machine_read_gbs", "machine_tflops", "link_latency_us", "context_len"):
        if not getattr(ns, name) > 0:
            raise ValidationError.bad_value(name, getattr(ns, name), "a positive number")
    for name in ("machines", "link_gbps", "batch_sizes"):
        if not all(v > 0 for v in getattr(ns, name)):
            raise ValidationError.bad_value(name, getattr(ns, name), "positive numbers")
    return memory


def _row(shape: Shape, m: Machines, ns: argparse.Namespace) -> dict[str, Any]:
    """One layout at one link speed: memory, batch room, each batch's step, the links' bytes."""
    fits = max_batch(shape, m, ns.context_len)
    row: dict[str, Any] = {"tp": shape.tp, "pp": shape.pp, "link_gbps": m.link_gbps,
                           "rank_weights_gib": max(r.weights for r in shape.ranks) / GIB, "max_batch": fits,
                           **link_bytes(shape)}
    row["batches"] = {b: decode_step(shape, m, b, ns.context_len) for b in ns.batch_sizes if b <= fits}
    return row


def _line(machines: int, row: dict[str, Any], ns: argparse.Namespace) -> str:
    cells = [f"{machines:>3} x {row['link_gbps']:>5g} Gb/s  tp {row['tp']:>2} x pp {row['pp']:>2}  "
             f"{row['rank_weights_gib']:8.2f} GiB/rank  batch <= {row['max_batch']:>5}"]
    for b in ns.batch_sizes:
        got = row["batches"].get(b)
        cells.append(f"b={b}: " + ("does not fit" if got is None else f"{got['step_ms']:7.1f} ms "
                                   f"{got['tokens_per_s']:7.1f} tok/s ({got['in_flight_tokens_per_s']:.1f} in flight)"))
    cells.append(f"TP link {row['tp_link_bytes_per_token'] / 1024:6.0f} KiB/tok  "
                 f"PP link {row['pp_link_bytes_per_token'] / 1024:4.0f} KiB/tok")
    return "  ".join(cells)


def run_cluster(ns: argparse.Namespace, args: EngineArgs) -> int:
    """Print (and with --output-json write) every layout of every machine count at every link speed."""
    memory, table = _check(ns), []
    for machines in ns.machines:
        for tp, pp in layouts(machines):
            try:
                shape = layout_shape(args, tp, pp)
            except ValidationError as e:  # the model does not split so (its heads or layers)
                print(f"{machines:>3} machines  tp {tp:>2} x pp {pp:>2}  not a layout: {e}")
                continue
            for gbps in ns.link_gbps:
                m = Machines(memory, ns.machine_read_gbs, ns.machine_tflops, gbps, ns.link_latency_us)
                row = {"machines": machines, **_row(shape, m, ns)}
                table.append(row)
                print(_line(machines, row, ns))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"parameters": {k: getattr(ns, k) for k in ("machine_memory", "machine_reserve",
                                                               "machine_read_gbs", "machine_tflops",
                                                               "link_latency_us", "context_len")},
                       "layouts": table}, f)
    return 0
