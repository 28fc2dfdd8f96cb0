"""Per-step cost of sending one step's SchedulerOutput to the tensor-parallel workers.

Two channels, each with 2 reader processes (the ranks) and rank 0 answering on a pipe, as the
multiprocess executor does:
- ``pipe``: the output pickled once, the same bytes written to every worker's pipe (blocking
  reads: an idle worker sleeps in the kernel).
- ``shm``: a shared-memory ring buffer (vLLM's design): the writer copies the bytes into a slot
  and bumps a counter; readers poll the counter (``sched_yield`` between polls).
Then the real executor: ``MultiprocExecutor.execute_model`` of an empty step on a tiny model vs
``UniProcExecutor``'s (the whole engine-side overhead of a step, workers included).

    .venv/bin/python benchmarks/broadcast_channels.py [--iters 2000]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import struct
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

from pagedllm.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

SLOTS, SLOT_BYTES = 4, 1 << 20
IDLE_S = 1.0


def idle_cpu(procs: list) -> float:
    """CPU seconds the reader processes burn per second while no message comes."""
    def cpu() -> float:
        total = 0
        for p in procs:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
        return total / os.sysconf("SC_CLK_TCK")
    before = cpu()
    time.sleep(IDLE_S)
    return (cpu() - before) / IDLE_S


def decode_step(n: int = 256) -> SchedulerOutput:
    """A decode step of ``n`` running requests (one in 16 gets a new block)."""
    cached = [CachedRequestData(req_id=f"{i}:req-{i}", new_block_ids=[1000 + i] if i % 16 == 0 else [],
                                num_computed_tokens=200 + i) for i in range(n)]
    return SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={c.req_id: 1 for c in cached})


def prefill_step(n: int = 8, prompt: int = 256) -> SchedulerOutput:
    """A step that admits ``n`` new requests of ``prompt`` tokens."""
    new = [NewRequestData(req_id=f"{i}:new-{i}", prompt_token_ids=list(range(i, i + prompt)),
                          sampling_params=SamplingParams(max_tokens=128), block_ids=list(range(i * 16, i * 16 + 16)),
                          num_computed_tokens=0) for i in range(n)]
    return SchedulerOutput(scheduled_new_reqs=new, num_scheduled_tokens={r.req_id: prompt for r in new})


# ----------------------------------------------------------------------------- pipes
def _pipe_reader(rank: int, commands, results) -> None:
    while True:
        msg = pickle.loads(commands.recv_bytes())
        if msg is None:
            return
        if rank == 0:
            results.send(len(msg.num_scheduled_tokens))


def bench_pipe(payload: SchedulerOutput, iters: int) -> tuple[list[float], float]:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    res_read, res_write = ctx.Pipe(duplex=False)
    for rank in range(2):
        r, w = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_pipe_reader, args=(rank, r, res_write), daemon=True))
        procs[-1].start()
        pipes.append(w)
    times = []
    for i in range(iters + 100):
        start = time.perf_counter()
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        for w in pipes:
            w.send_bytes(data)
        res_read.recv()
        if i >= 100:
            times.append(time.perf_counter() - start)
    idle = idle_cpu(procs)
    for w in pipes:
        w.send_bytes(pickle.dumps(None))
    for p in procs:
        p.join()
    return times, idle


# ----------------------------------------------------------------------------- shared-memory ring
def _ring_views(buf) -> tuple[np.ndarray, memoryview]:
    header = np.ndarray((3,), dtype=np.int64, buffer=buf)  # [written, read by rank 0, read by rank 1]
    return header, buf[24:]


def _shm_reader(rank: int, name: str, results) -> None:
    shm = shared_memory.SharedMemory(name=name)
    header, slots = _ring_views(shm.buf)
    seq = 0
    try:
        while True:
            while header[0] <= seq:  # poll: a new message has a higher counter
                os.sched_yield()
            slot = slots[(seq % SLOTS) * SLOT_BYTES:]
            (size,) = struct.unpack_from("<q", slot)
            msg = pickle.loads(slot[8:8 + size])
            seq += 1
            header[1 + rank] = seq
            if msg is None:
                return
            if rank == 0:
                results.send(len(msg.num_scheduled_tokens))
    finally:
        del header, slots, slot
        shm.close()


# A module-level function, not a closure over bench_shm's views: bench_shm drops its last references
# to them (`del header, slots`) before shm.close(), which refuses while a view of the buffer is alive.
def _shm_publish(header: np.ndarray, slots: memoryview, obj: object, seq: int) -> None:
    """Write message ``seq`` into its slot once both readers are done with the slot's previous message."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    while min(header[1], header[2]) <= seq - SLOTS:  # the slot is still being read
        os.sched_yield()
    base = (seq % SLOTS) * SLOT_BYTES
    struct.pack_into("<q", slots, base, len(data))
    slots[base + 8:base + 8 + len(data)] = data
    header[0] = seq + 1


def bench_shm(payload: SchedulerOutput, iters: int) -> tuple[list[float], float]:
    ctx = mp.get_context("spawn")
    shm = shared_memory.SharedMemory(create=True, size=24 + SLOTS * SLOT_BYTES)
    header, slots = _ring_views(shm.buf)
    header[:] = 0
    res_read, res_write = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_shm_reader, args=(rank, shm.name, res_write), daemon=True) for rank in range(2)]
    for p in procs:
        p.start()
    times = []
    seq = 0
    try:
        for i in range(iters + 100):
            start = time.perf_counter()
            _shm_publish(header, slots, payload, seq)
            seq += 1
            res_read.recv()
            if i >= 100:
                times.append(time.perf_counter() - start)
        idle = idle_cpu(procs)
        _shm_publish(header, slots, None, seq)
        for p in procs:
            p.join()
    finally:
        del header, slots
        shm.close()
        shm.unlink()
    return times, idle


# ----------------------------------------------------------------------------- the executor
def bench_executor(iters: int) -> dict[str, float]:
    """Empty steps through the real executors on a tiny random model (no forward pass)."""
    import sys

    from pagedllm.engine.llm_engine import EngineArgs, get_tokenizer
    from pagedllm.executor.factory import get_executor_class
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the test suite's tiny-model factory
    from tests.conftest import save_tiny_model
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(Path(tmp) / "tiny", "llama-gqa-untied", vocab_size=len(get_tokenizer()),
                               tokenizer=get_tokenizer())
        for tp, backend in ((1, "uni"), (2, "mp"), (2, "ray")):
            args = EngineArgs(model=str(path), dtype="float32", tensor_parallel_size=tp,
                              distributed_executor_backend=backend, num_kv_blocks=64)
            config, arch = args.create_engine_config()
            executor = get_executor_class(config)(config, arch, (2,))
            executor.initialize_cache(64, 0)
            times = []
            for i in range(iters + 50):
                start = time.perf_counter()
                executor.execute_model(SchedulerOutput())
                if i >= 50:
                    times.append(time.perf_counter() - start)
            executor.shutdown()
            out[f"tp={tp} {backend}"] = statistics.median(times) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    print(f"cores: {len(os.sched_getaffinity(0))}")
    for label, payload in (("decode step, 256 requests", decode_step()),
                           ("prefill step, 8 x 256 tokens", prefill_step())):
        size = len(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        for name, fn in (("pipe", bench_pipe), ("shm ring", bench_shm)):
            times, idle = fn(payload, args.iters)
            print(f"{label:30s} ({size:6d} B)  {name:8s}: median {statistics.median(times) * 1e6:7.1f} us, "
                  f"p90 {np.percentile(times, 90) * 1e6:7.1f} us; idle readers use {idle:.2f} cores")
    for name, us in bench_executor(args.iters // 4).items():
        print(f"empty step through the executor, {name:10s}: median {us:7.1f} us")


if __name__ == "__main__":
    main()
