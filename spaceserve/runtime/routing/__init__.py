"""Replica routing: what a router keys on and how it picks a replica.

router.py (`RouteRequest`, the routers), keys.py (image and prefix-block keys of a prompt),
tracker.py (per-replica load and affinity the router reads).
"""
