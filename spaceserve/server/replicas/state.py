"""The trackers Ray Serve's request router and the HTTP client share, by name, per process.

Ray Serve builds the request router inside the process that holds the deployment handle (here,
the ingress) from a copy of its class pickled by value, so the router's own module globals are
not the ingress's; this module is imported normally on both sides and holds the one tracker per
deployment.
"""

from __future__ import annotations

import threading

from spaceserve.runtime.routing.tracker import ReplicaTracker

_TRACKERS: dict[str, ReplicaTracker] = {}
_LOCK = threading.Lock()


def register(name: str, tracker: ReplicaTracker) -> ReplicaTracker:
    """Make `tracker` the one named `name` (the ingress does, before the first request)."""
    with _LOCK:
        _TRACKERS[name] = tracker
    return tracker


def tracker(name: str) -> ReplicaTracker:
    """The tracker named `name`; a load-only one when nobody registered it (a handle used
    outside SpaceServe's ingress)."""
    with _LOCK:
        t = _TRACKERS.get(name)
        if t is None:
            t = _TRACKERS[name] = ReplicaTracker(None, policy="least_loaded")
        return t


def unregister(name: str) -> None:
    with _LOCK:
        _TRACKERS.pop(name, None)
