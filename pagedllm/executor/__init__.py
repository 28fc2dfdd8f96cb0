"""Executors: run the workers (one process now; multiprocess / Ray later) behind one interface."""
