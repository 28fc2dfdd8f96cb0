"""The capacity planner against the server it plans for. `pagedllm serve --step-log` serves a calibration
load (`pagedllm bench serve` at --calibration-rate, other requests: --seed 1), `pagedllm plan --calibrate-from`
fits the step-time model on those served steps (or, with --offline-calibration, `pagedllm plan --calibrate`
on an engine of its own) and predicts each rate; then the same server is measured at the same rates, with the
same requests and seeded arrivals the plan replayed, and the two are printed side by side (goals: throughput
within 10%, p50 TPOT within 20%).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/plan_check.py --rates 1 2 4 --num-prompts 60
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.entrypoints.openai.conftest import RemoteServer  # noqa: E402

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--dataset-name", default="sharegpt-like")
    parser.add_argument("--engine-args", default="--dtype=auto --kv-cache-memory=1GiB --max-num-seqs=64",
                        help="engine options of both the plan and the server (one string)")
    parser.add_argument("--calibrate-seconds", type=float, default=60.0)
    parser.add_argument("--calibration-rate", type=float, default=2.0, help="request rate of the calibration load")
    parser.add_argument("--offline-calibration", action="store_true",
                        help="fit on an engine of the planner's own (`pagedllm plan --calibrate`), not served steps")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    engine = args.engine_args.split()
    work = Path(tempfile.mkdtemp(prefix="plan-check-"))
    dataset = ["--dataset-name", args.dataset_name, "--num-prompts", str(args.num_prompts), "--seed", "0"]
    rates = [str(r) for r in args.rates]
    plan_json, cost = work / "plan.json", work / "cost.json"
    from pagedllm.models.loader import default_model_path

    server = RemoteServer(Path(default_model_path()), *engine, "--step-log", str(work / "steps.jsonl"),
                          log=work / "server.log")
    measured = {}
    try:
        def serve(rate: float, seed: int, out: Path) -> dict:
            subprocess.run([*CLI, "bench", "serve", "--base-url", server.url, *dataset[:4], "--request-rate",
                            str(rate), "--seed", str(seed), "--output-json", str(out)], check=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
            return json.loads(out.read_text())

        calibration = ["--calibrate", "--calibrate-seconds", str(args.calibrate_seconds)]
        if not args.offline_calibration:
            serve(args.calibration_rate, 1, work / "calibration.json")
            calibration = ["--calibrate-from", str(work / "steps.jsonl")]
        subprocess.run([*CLI, "plan", *engine, *dataset, "--rates", *rates, *calibration, "--cost-model", str(cost),
                        "--output-json", str(plan_json)], check=True)
        predicted = {p["request_rate"]: p for p in json.loads(plan_json.read_text())["predictions"]}
        for rate in args.rates:
            measured[rate] = serve(rate, 0, work / f"serve-{rate}.json")
    finally:
        server.stop()
    rows = []
    print(f"{'rate':>6} {'req/s plan':>11} {'measured':>9} {'error':>7} {'TPOT p50 plan':>14} {'measured':>9} "
          f"{'error':>7} {'TTFT p50 plan':>14} {'measured':>9}")
    for rate in args.rates:
        p, m = predicted[rate], measured[rate]
        thr_err = p["requests_per_second"] / m["requests_per_second"] - 1
        tpot_err = p["tpot_ms"]["p50"] / m["tpot_ms"]["p50"] - 1
        rows.append({"rate": rate, "plan": p, "measured": m, "throughput_error": thr_err, "tpot_p50_error": tpot_err})
        print(f"{rate:>6} {p['requests_per_second']:>11.3f} {m['requests_per_second']:>9.3f} {thr_err:>+7.1%} "
              f"{p['tpot_ms']['p50']:>14.1f} {m['tpot_ms']['p50']:>9.1f} {tpot_err:>+7.1%} "
              f"{p['ttft_ms']['p50']:>14.1f} {m['ttft_ms']['p50']:>9.1f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows) + "\n")


if __name__ == "__main__":
    main()
