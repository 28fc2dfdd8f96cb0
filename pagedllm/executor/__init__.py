"""Executors: run an engine's workers behind one interface: one worker in the engine's process (``uni``),
one process per tensor-parallel rank on this machine (``mp``), or Ray actors across machines (``ray``);
``factory.get_executor_class`` picks one from ``distributed_executor_backend``."""
