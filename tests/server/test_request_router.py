"""`SpaceServeRequestRouter`, the class Ray Serve builds per deployment handle, run without a
cluster: it ranks the candidates with the named tracker, charges the first choice at once (so
the next decision sees it), puts a replica that failed the request last, asks Ray to back off
between rounds, and passes replica-set changes to the tracker."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve.request_router")

from ray.serve.request_router import RequestRouter  # noqa: E402

from spaceserve.runtime.routing.router import RouteRequest  # noqa: E402
from spaceserve.runtime.routing.tracker import ReplicaTracker  # noqa: E402
from spaceserve.server.replicas import state  # noqa: E402
from spaceserve.server.replicas.router import SpaceServeRequestRouter  # noqa: E402

NAME = "test-request-router"


def replica(key: str, stats: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=key), routing_stats=stats)


def pending(route: RouteRequest | None, exclude: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(kwargs={"route": route, "exclude": exclude, "stream": True},
                           routing_context=SimpleNamespace(should_backoff=False))


@pytest.fixture
def router(monkeypatch):
    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)
    monkeypatch.setattr(RequestRouter, "on_replica_actor_died", lambda self, rid: None)
    tracker = state.register(NAME, ReplicaTracker(None, policy="least_loaded"))
    r = SpaceServeRequestRouter.__new__(SpaceServeRequestRouter)  # Ray's own state unused
    r.initialize_state(tracker=NAME)
    yield r, tracker
    state.unregister(NAME)


def choose(r: SpaceServeRequestRouter, reps: list, req: SimpleNamespace | None) -> list[str]:
    ranks = asyncio.run(r.choose_replicas(reps, req))
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_each_choice_is_charged_so_requests_spread(router) -> None:
    r, tracker = router
    reps = [replica("a"), replica("b")]
    r.update_replicas(reps)
    assert sorted(tracker.keys()) == ["a", "b"]
    firsts = []
    for i in range(4):
        req = pending(RouteRequest(f"r{i}", prompt_tokens=100, output_tokens=64))
        order = choose(r, reps, req)
        assert sorted(order) == ["a", "b"] and req.routing_context.should_backoff
        firsts.append(order[0])
    assert sorted(firsts) == ["a", "a", "b", "b"]  # least loaded: the charges alternate it
    assert tracker.num_routed == 4


def test_a_replica_that_failed_the_request_goes_last(router) -> None:
    r, tracker = router
    reps = [replica("a"), replica("b")]
    r.update_replicas(reps)
    for _ in range(3):  # "b" is the less loaded one, and still last when it failed it
        req = pending(RouteRequest("again", prompt_tokens=100, output_tokens=64), exclude="b")
        assert choose(r, reps, req)[-1] == "b"


def test_without_a_route_nothing_is_charged_and_a_dead_replica_leaves(router) -> None:
    r, tracker = router
    reps = [replica("a"), replica("b")]
    r.update_replicas(reps)
    assert sorted(choose(r, reps, None)) == ["a", "b"]
    assert tracker.num_routed == 0
    r.on_replica_actor_died(SimpleNamespace(unique_id="a"))
    assert tracker.keys() == ["b"]
