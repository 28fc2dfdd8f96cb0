"""Two Ray nodes on this machine (`ray start --head` and `ray start --address`, one CPU each): the
engine joins the cluster through RAY_ADDRESS and its two ranks run on different nodes.

Ray registers a multi-node cluster's nodes on the machine's address even when told 127.0.0.1
(only a single-node cluster can stay on loopback), so this cluster listens where Ray puts it;
``ray stop --force`` takes it down at the end.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from tests.distributed.utils import ray_auth_disabled
from tests.utils import free_port

RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _ray(*args: str) -> str:
    done = subprocess.run([RAY, *args], env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.fixture
def two_node_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if shutil.which(RAY) is None:
        pytest.skip("the ray CLI is not installed")
    port = free_port()
    head = _ray("start", "--head", "--num-cpus", "1", "--port", str(port), "--include-dashboard=false",
                "--disable-usage-stats")
    address = re.search(r"ray start --address='([^']+)'", head).group(1)
    try:
        _ray("start", "--address", address, "--num-cpus", "1", "--disable-usage-stats")
        monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", ENV["RAY_USAGE_STATS_ENABLED"])
        ray_auth_disabled(monkeypatch)  # (as the cluster's nodes run: ENV)
        monkeypatch.setenv("RAY_ADDRESS", address)
        monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT_STRATEGY", "STRICT_SPREAD")
        yield address
    finally:
        subprocess.run([RAY, "stop", "--force"], env=ENV, capture_output=True, timeout=120)


@pytest.mark.parametrize("layout", ["tensor", "pipeline"])
def test_ranks_on_two_nodes(two_node_cluster: str, tiny_llm_dir: Path, layout: str) -> None:
    """Two ranks, or two pipeline stages, on a cluster of two nodes (`ray start --head` + `ray start --address`):
    one per node, their all-reduces (or the hidden states between the stages) over gloo's TCP; one worker's tokens;
    stages on nodes of their own keep two batches in flight."""
    prompts = [f"Two nodes, prompt {i}" for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0)
    ref = LLM(str(tiny_llm_dir), dtype="float32")
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_llm_dir), dtype="float32", distributed_executor_backend="ray", **{f"{layout}_parallel_size": 2})
    try:
        executor = llm.llm_engine.engine_core.core.executor
        assert len(set(executor.node_ids)) == 2  # one rank per node
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        layers = [len(shapes) for shapes in llm.collective_rpc("kv_cache_shapes")]
        assert layers == ([1, 1] if layout == "pipeline" else [2, 2])  # a stage holds its layer; a rank every one
        # stages on nodes of their own: a batch in each at once (8 prompts, 4 a batch)
        assert llm.get_stats().max_batches_in_flight == (2 if layout == "pipeline" else 0)
    finally:
        llm.shutdown()
    import ray
    assert not ray.is_initialized()  # the engine disconnected; the cluster it joined is the fixture's to stop
