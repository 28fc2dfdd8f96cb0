"""The soak of the suite (benchmarks/soak.py, about 80 s: start-up, a 5 s capacity measurement, 45 s of
load and the drain; 45 s, not 80, to keep make test inside CI's 30 minutes) on the tiny model: a mix of normal,
chat, streamed, cancelled, malformed and oversized requests at 80% of the measured capacity; every request
answered or cleanly refused, 0 KV blocks held and the invariants intact afterwards, RSS growth under 5% after
the warm-up."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SOAK = Path(__file__).parents[3] / "benchmarks" / "soak.py"


def test_soak(tiny_llm_dir: Path, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    out = tmp_path / "soak.json"
    status = soak.main(["--model", str(tiny_llm_dir), "--duration", "45", "--warmup", "15", "--calibrate", "5",
                        "--concurrency", "16", "--output-json", str(out), "--server-log", str(tmp_path / "server.log"),
                        "--timeout", "60"])
    result = json.loads(out.read_text())
    assert status == 0 and result["passed"], (result["checks"], result["failures"])
    outcomes = result["outcomes"]
    for kind in ("normal ok", "chat ok", "stream ok", "cancel cancelled", "malformed refused 400",
                 "oversized refused 400"):
        assert outcomes.get(kind, 0) > 10, (kind, outcomes)
    assert result["requests"] > 0.8 * 0.7 * result["capacity_per_s"] * 45  # the load was kept up
