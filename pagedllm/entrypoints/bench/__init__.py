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
