"""Executors: run the workers behind one interface (today one worker in the engine's process)."""
