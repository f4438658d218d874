"""`SpaceServeRequestRouter`: Ray Serve's request router running SpaceServe's routing function.

Ray Serve (2.60) lets a deployment name a custom `RequestRouter`; every deployment handle builds
one and asks it, per request, for replicas in order of preference (`choose_replicas`). This one
ranks the live replicas with `ReplicaTracker.rank` (`spaceserve.runtime.routing.router`: predicted
encoder work, queued compute, decode load, image and prefix affinity) and charges the request to
its first choice at once, so the next decision sees it (Ray takes the first choice unless that
replica is at its `max_ongoing_requests`; the client moves the account when the answer comes
from another). The request's `RouteRequest` travels in the call's ``route`` argument; a retried
request names the replica that failed it in ``exclude``. Replica set changes and each replica's
periodic routing stats (its rank, process and gauges) are passed to the tracker too.

Ray pickles this class by value into the handle's process, so all state lives in the tracker
(found by name in `state`), never in this module.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from spaceserve.server.replicas import state


class SpaceServeRequestRouter(RequestRouter):
    """Ranks replicas with the named tracker (`request_router_kwargs`: ``tracker``)."""

    def initialize_state(self, tracker: str = "spaceserve", **kwargs: Any) -> None:
        self._tracker_name = tracker

    @property
    def tracker(self) -> Any:
        return state.tracker(self._tracker_name)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:  # back off between rounds when every replica is full
            pending_request.routing_context.should_backoff = True
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        exclude, route = kwargs.get("exclude"), kwargs.get("route")
        tracker = self.tracker
        order = tracker.rank(route, list(by_key), exclude=() if exclude is None else (exclude,))
        if route is not None and order:
            tracker.on_routed(order[0], route, stream=bool(kwargs.get("stream", True)))
        return [[by_key[k]] for k in order]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        self.tracker.sync({r.replica_id.unique_id: r.routing_stats for r in replicas})
        return super().update_replicas(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.tracker.remove(replica_id.unique_id)
        super().on_replica_actor_died(replica_id)
