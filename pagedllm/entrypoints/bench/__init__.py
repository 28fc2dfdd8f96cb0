"""``pagedllm bench ...`` benchmarks: each prints a table and one JSON line."""
