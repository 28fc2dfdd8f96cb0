"""Tensor-parallel groups and collectives (identity at tp=1)."""
