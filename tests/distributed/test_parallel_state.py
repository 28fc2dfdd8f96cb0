"""How dimensions and heads split across ranks, and which cores each local rank binds to."""
from __future__ import annotations

import pytest

from pagedllm.distributed.parallel_state import HeadShard, shard_heads, split_evenly
from pagedllm.errors import ValidationError
from pagedllm.platform.cpu import THREADS_BIND_ENV, rank_cores


@pytest.mark.parametrize("total,parts", [(10, 3), (1536, 2), (9, 4), (7, 7), (64, 1)])
def test_split_evenly_covers_the_range_once(total: int, parts: int) -> None:
    spans = [split_evenly(total, parts, i) for i in range(parts)]
    assert spans[0][0] == 0 and sum(n for _, n in spans) == total
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert max(n for _, n in spans) - min(n for _, n in spans) <= 1


def _covered(heads: int, kv: int, tp: int) -> list[HeadShard]:
    shards = [shard_heads(heads, kv, tp, r) for r in range(tp)]
    group = heads // kv
    for s in shards:  # every query head sits with its own KV head
        for q in range(s.q_start, s.q_start + s.num_heads):
            assert s.kv_start <= q // group < s.kv_start + s.num_kv_heads
    queries = sorted(q for s in shards for q in range(s.q_start, s.q_start + s.num_heads))
    assert queries == list(range(heads))  # each query head on exactly one rank
    return shards


def test_heads_split_evenly_when_they_divide() -> None:
    assert _covered(4, 2, 2) == [HeadShard(0, 2, 0, 1), HeadShard(2, 2, 1, 1)]
    assert _covered(32, 8, 4)[3] == HeadShard(24, 8, 6, 2)


def test_smollm2_heads_split_unevenly_along_groups() -> None:
    # 9 query heads over 3 KV heads on 2 ranks: KV heads 2 + 1, query heads 6 + 3
    assert _covered(9, 3, 2) == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    shards = _covered(4, 1, 2)  # MQA: the one KV head on both ranks, query heads split
    assert shards == [HeadShard(0, 2, 0, 1), HeadShard(2, 2, 0, 1)]
    assert [s.kv_start for s in _covered(8, 2, 4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("heads,kv,tp", [(9, 3, 4), (4, 1, 8), (6, 4, 2)])
def test_impossible_splits_name_the_parameter(heads: int, kv: int, tp: int) -> None:
    with pytest.raises(ValidationError) as e:
        [shard_heads(heads, kv, tp, r) for r in range(tp)]
    assert e.value.param == "tensor_parallel_size"


def test_rank_cores_default_split_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    cores = sorted(os.sched_getaffinity(0))
    first, second = rank_cores(0, 2, {}), rank_cores(1, 2, {})
    assert first and second and not set(first) & set(second) and set(first + second) <= set(cores)
    env = {THREADS_BIND_ENV: "0-2,5|3-4"}
    assert rank_cores(0, 2, env) == [0, 1, 2, 5] and rank_cores(1, 2, env) == [3, 4]
    assert rank_cores(0, 2, {THREADS_BIND_ENV: "all"}) is None
    with pytest.raises(ValidationError):
        rank_cores(0, 3, env)  # two core sets for three ranks
    with pytest.raises(ValidationError):
        rank_cores(0, 1, {THREADS_BIND_ENV: "zero"})
