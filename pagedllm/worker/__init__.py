"""Per-device workers: model, KV tensors, and the model runner that executes each step."""
