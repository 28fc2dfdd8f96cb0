"""Scheduler and KV block management: pure Python, no torch (tested with a fake model runner)."""
