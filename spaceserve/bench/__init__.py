"""Benchmarks of SpaceServe as a service (`spaceserve bench serve`)."""
