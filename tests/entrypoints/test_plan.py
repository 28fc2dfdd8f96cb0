"""`pagedllm plan`: the step-time model's fit, the replay through the real scheduler (the same steps and
preemptions as the real engine on the same requests), and the command end to end on the tiny model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench.datasets import BenchRequest
from pagedllm.entrypoints.bench.plan import CostModel, arrival_times, replay
from pagedllm.entrypoints.cli import main

LENGTHS = [(5 + 7 * i % 60, 4 + 5 * i % 40) for i in range(24)]


def test_fit_recovers_a_linear_step_time() -> None:
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(200), rng.integers(1, 2048, 200), rng.integers(1, 256, 200), rng.random(200) * 500])
    truth = np.array([2e-3, 1e-5, 5e-5, 3e-4])
    model = CostModel.fit(x.tolist(), (x @ truth).tolist())
    np.testing.assert_allclose(model.coef, truth, rtol=1e-6)
    assert model.median_error < 1e-9
    assert abs(model.predict([1, 100, 10, 5]) - float(np.dot(truth, [1, 100, 10, 5]))) < 1e-12
    negative = CostModel.fit(x.tolist(), (x @ np.array([2e-3, 1e-5, 0, 3e-4]) - 1e-9 * x[:, 2]).tolist())
    assert min(negative.coef) >= 0  # a coefficient that fits negative is dropped, the others refit


def test_replay_schedules_as_the_real_engine(tiny_llm_dir: Path) -> None:
    """All requests at once into a pool too small for them: the replay takes the same number of steps and
    preemptions as the real engine, whose scheduler it is."""
    options = dict(num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    llm = LLM(str(tiny_llm_dir), dtype="float32", **options)
    prompts = [{"prompt_token_ids": [7 + i] * p} for i, (p, _) in enumerate(LENGTHS)]
    llm.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in LENGTHS], use_tqdm=False)
    real = llm.get_stats()
    llm.shutdown()
    requests = [BenchRequest([], p, o) for p, o in LENGTHS]
    p = replay(requests, [0.0] * len(requests), CostModel([1e-3, 0, 0, 0]), num_blocks=24, block_size=16,
               max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)
    assert (p.num_steps, p.num_preemptions, p.max_num_running) == (real.num_steps, real.num_preemptions,
                                                                   real.max_num_running)
    assert real.num_preemptions > 0
    assert abs(p.requests_per_second - len(requests) / (p.num_steps * 1e-3)) < 1e-6  # 1 ms a step


def test_replay_at_low_and_high_rates() -> None:
    requests = [BenchRequest([], 32, 32)] * 40
    cost = CostModel([2e-3, 1e-5, 1e-4, 0])
    args = dict(num_blocks=64, block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512)
    low = replay(requests, arrival_times(40, 1.0, 0), cost, **args)
    high = replay(requests, arrival_times(40, 1000.0, 0), cost, **args)
    assert abs(low.requests_per_second - 1.0) < 0.3 and low.num_preemptions == 0 and low.max_num_running <= 4
    assert low.tpot_ms["p50"] < high.tpot_ms["p50"] and high.max_num_running == 16 and high.max_kv_usage <= 1
    assert arrival_times(3, 2.0, 0)[0] == 0.0 and arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_replicas_split_the_load() -> None:
    """Data parallelism on paper: at a rate that saturates one replica, two serve about twice the requests per
    second at a lower TTFT; at a light rate they add nothing (the rate is the rate)."""
    requests = [BenchRequest([], 64, 32)] * 80
    cost = CostModel([2e-3, 2e-5, 2e-4, 0])
    args = dict(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    heavy = arrival_times(80, 200.0, 0)
    one, two = replay(requests, heavy, cost, **args), replay(requests, heavy, cost, replicas=2, **args)
    assert 1.7 < two.requests_per_second / one.requests_per_second < 2.1
    assert two.ttft_ms["p50"] < one.ttft_ms["p50"] and two.num_steps > one.num_steps
    light = arrival_times(80, 1.0, 0)
    one, two = replay(requests, light, cost, **args), replay(requests, light, cost, replicas=2, **args)
    assert abs(two.requests_per_second - one.requests_per_second) < 0.1


def test_plan_command(tiny_llm_dir: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    cost, out, log = tmp_path / "cost.json", tmp_path / "plan.json", tmp_path / "requests.jsonl"
    assert main(["plan", str(tiny_llm_dir), "--dtype", "float32", "--num-kv-blocks", "64", "--calibrate",
                 "--calibrate-seconds", "4", "--cost-model", str(cost), "--num-prompts", "30", "--random-input-len",
                 "40", "--random-output-len", "20", "--rates", "2", "50", "--target-tpot-ms", "1000",
                 "--max-num-seqs-options", "4", "16", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    model = json.loads(cost.read_text())
    assert model["samples"] >= 8 and model["coef"][0] > 0 and result["num_blocks"] == 64
    assert [p["request_rate"] for p in result["predictions"]] == [2, 50]
    assert result["recommendation"] == {"max_num_seqs": 4, "max_request_rate": 50}  # the smallest that meets it
    assert "recommendation: --max-num-seqs 4" in capsys.readouterr().out
    log.write_text("".join(json.dumps({"prompt_len": 20, "output_len": 10, "arrival_time": 100 + i / 4}) + "\n"
                           for i in range(12)))
    assert main(["plan", str(tiny_llm_dir), "--num-kv-blocks", "64", "--cost-model", str(cost), "--trace", str(log),
                 "--output-json", str(out)]) == 0
    (recorded,) = json.loads(out.read_text())["predictions"]
    assert recorded["requests_per_second"] > 0 and recorded["max_num_running"] >= 1


def test_calibrate_from_a_served_step_log(tmp_path: Path) -> None:
    """`pagedllm serve --step-log` lines (features and seconds) fit the model `plan --calibrate-from` saves."""
    rng = np.random.default_rng(1)
    log, cost = tmp_path / "steps.jsonl", tmp_path / "cost.json"
    truth = [5e-3, 2e-5, 4e-4, 1e-3]
    lines = []
    for _ in range(50):
        f = [1.0, float(rng.integers(1, 500)), float(rng.integers(1, 64)), float(rng.random() * 100)]
        lines.append(json.dumps({"features": f, "seconds": float(np.dot(truth, f))}))
    log.write_text("\n".join(lines) + "\n")
    assert main(["plan", "--calibrate-from", str(log), "--cost-model", str(cost), "--num-kv-blocks", "64",
                 "--num-prompts", "5", "--rates", "1"]) == 0
    np.testing.assert_allclose(json.loads(cost.read_text())["coef"], truth, rtol=1e-6)
    log.write_text("not json\n")
    assert main(["plan", "--calibrate-from", str(log), "--cost-model", str(cost), "--num-kv-blocks", "64"]) == 2


def test_plan_models_one_rank_and_says_which_option_is_not(tiny_llm_dir: Path) -> None:
    """A planned engine of several ranks (tensor or pipeline) is refused naming the option (nothing is started)."""
    import pytest

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.bench.plan import kv_blocks
    from pagedllm.errors import ValidationError

    for option in ("tensor_parallel_size", "pipeline_parallel_size"):
        with pytest.raises(ValidationError, match="one CPU rank") as err:
            kv_blocks(EngineArgs(model=str(tiny_llm_dir), num_kv_blocks=16, **{option: 2}))
        assert err.value.param == option
    assert kv_blocks(EngineArgs(model=str(tiny_llm_dir), num_kv_blocks=16))[0] == 16


def test_a_model_over_machines_on_paper(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """`pagedllm plan --machines`: every tensor x pipeline layout of one rank per machine, each rank's weights the
    engine's own plan of it; a slow link costs tensor parallelism its two all-reduces a layer where pipeline
    stages pay one message a stage; micro-batches in flight keep the stages busy; a machine whose memory a rank's
    weights fill has no batch; a reserve over the memory is refused naming the flag."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.worker import memory_fit
    from tests.utils import save_tiny_model

    model = save_tiny_model(tmp_path / "model", "llama-mha-tied", num_hidden_layers=4)  # layers outweigh the table
    out = tmp_path / "cluster.json"
    flags = ["plan", str(model), "--dtype", "float32", "--link-gbps", "0.1", "100", "--batch-sizes", "1", "8",
             "--context-len", "64", "--machine-read-gbs", "0.05", "--output-json", str(out)]
    assert main([*flags, "--machines", "2"]) == 0
    capsys.readouterr()
    rows = {(r["tp"], r["pp"], r["link_gbps"]): r for r in json.loads(out.read_text())["layouts"]}
    assert set(rows) == {(1, 2, 0.1), (1, 2, 100), (2, 1, 0.1), (2, 1, 100)}
    for tp, pp in ((1, 2), (2, 1)):
        config = EngineArgs(model=str(model), dtype="float32", tensor_parallel_size=tp,
                            pipeline_parallel_size=pp).create_engine_config()
        assert rows[tp, pp, 100]["rank_weights_gib"] == max(r.weights for r in memory_fit.plan_ranks(*config)) / 2**30
    slow = {k: rows[k + (0.1,)]["batches"]["8"]["step_ms"] - rows[k + (100,)]["batches"]["8"]["step_ms"]
            for k in ((1, 2), (2, 1))}
    assert slow[2, 1] > 4 * slow[1, 2] > 0, slow  # 5 all-reduces against one message of the same activations
    assert rows[2, 1, 100]["tp_link_bytes_per_token"] > 2 * rows[1, 2, 100]["pp_link_bytes_per_token"] > 0
    staged = rows[1, 2, 100]["batches"]["8"]
    assert staged["in_flight_tokens_per_s"] > 1.2 * staged["tokens_per_s"]  # both stages at work, not one
    assert main([*flags, "--machines", "1", "--machine-memory", "1.5MiB", "--machine-reserve", "1MiB"]) == 0
    assert "does not fit" in capsys.readouterr().out and json.loads(out.read_text())["layouts"][0]["max_batch"] == 0
    assert main([*flags, "--machines", "2", "--machine-reserve", "64GiB"]) == 2
    assert "machine_reserve" in capsys.readouterr().err
