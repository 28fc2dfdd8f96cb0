"""The shared-memory collectives give gloo's results, for small tensors and ones larger than a slot."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.distributed import shm_comm
from tests.utils import free_port


def _check(rank: int, port: int, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = shm_comm.ShmCommunicator(rank, 2)
    dist.barrier()  # rank 0 unlinks right after every rank mapped the buffer
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("pagedllm-tp-")]  # unlinked once mapped
    torch.manual_seed(rank)
    big_rows = shm_comm.SLOT_BYTES // (576 * 4) + 3  # float32 rows: more than one slot
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 7, 256, big_rows):
            x = torch.randn(rows, 576).to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            got = comm.all_reduce(x.clone())
            worst = max(worst, (got.float() - want.float()).abs().max().item() if dtype == torch.float32 else 0.0)
            if dtype == torch.bfloat16:  # ours sums in float32 then rounds: within one bf16 step of gloo's
                assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
            parts = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(parts, x)
            assert torch.equal(comm.all_gather(x, dim=-1), torch.cat(parts, dim=-1))
            assert torch.equal(comm.all_gather(x, dim=0), torch.cat(parts, dim=0))
    results[rank] = worst
    comm.close()
    dist.destroy_process_group()


def test_shm_collectives_match_gloo() -> None:
    results = mp.Manager().dict()
    mp.spawn(_check, args=(free_port(), results), nprocs=2)
    assert results[0] == results[1] == 0.0  # float32: the same two-term sums, bit for bit


@pytest.mark.parametrize("world,local,expected", [(2, 2, True), (2, 1, False), (1, 1, False)])
def test_shm_only_when_every_rank_is_local(monkeypatch: pytest.MonkeyPatch, world: int, local: int,
                                           expected: bool) -> None:
    assert shm_comm.shm_usable(world, local) == (expected and shm_comm.shm_usable(2, 2))
    monkeypatch.setenv(shm_comm.SHM_ENV, "0")
    assert not shm_comm.shm_usable(2, 2)
