"""Attention backends (interface + registry), the per-step forward context and the Attention layer."""
