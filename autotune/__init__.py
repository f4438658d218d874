"""Offline profiling (resource-utility curves) and per-budget kernel tuning for SpaceServe."""
