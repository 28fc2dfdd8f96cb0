"""``pagedllm bench ...`` benchmarks: each prints a table and one JSON line."""
from __future__ import annotations

import json
from typing import Any


def emit_json(result: dict[str, Any], output_json: str | None) -> None:
    """Print the result as one JSON line, and write the same line to ``output_json`` if given."""
    line = json.dumps(result)
    print(line)
    if output_json:
        with open(output_json, "w") as f:
            f.write(line + "\n")


def load_summary(ranks: list[dict[str, float]]) -> dict[str, float]:
    """How the model loaded, from the ranks' ``rank_memory_usage``: the slowest rank's seconds, every rank's
    weights, and the largest peak RSS a rank's process reached while loading."""
    return {"load_time_s": max(r["load_seconds"] for r in ranks),
            "weights_gib": sum(r["weights_bytes"] for r in ranks) / 2**30,
            "load_peak_rss_gib": max(r["load_peak_rss_bytes"] for r in ranks) / 2**30}


def load_line(summary: dict[str, float]) -> str:
    """One line of ``load_summary``'s figures."""
    return (f"Load: {summary['load_time_s']:.1f} s for {summary['weights_gib']:.2f} GiB of weights, "
            f"peak RSS {summary['load_peak_rss_gib']:.2f} GiB while loading")
