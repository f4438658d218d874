"""`ReplicaTracker`: the router's own account of its replicas, the states `rank_replicas` reads.

The router sees every request it sends: where it went (`on_routed`), when its first token came
back (`on_first_token`) and when it ended (`on_finished`). From these it keeps, per replica, the
predicted compute work queued there (encoder + prefill seconds of requests without a first
token), the decode load (requests past their first token and their context), and the image and
prefix-block hashes it recently served (bounded LRU sets standing in for the replica's encoder
and prefix caches). A request whose first token the router cannot see (a non-streaming one) is
counted as decoding from its predicted first-token time on. Across all replicas it keeps how
often each key appeared in recent requests, to mark the common ones (see routing.py).

Thread-safe: Ray Serve routes on its own event loop thread while the HTTP layer reports tokens
from another. The same tracker drives the simulator's cluster mode.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from spaceserve.checks import require_choice
from spaceserve.runtime.policy.admission import AdmissionPolicy, Prediction
from spaceserve.runtime.routing.admission import admission_order, predict
from spaceserve.runtime.routing.router import (
    POLICIES,
    ReplicaState,
    RouterConfig,
    RouteRequest,
    WorkModel,
    rank_replicas,
)


class _LRU(OrderedDict):
    """A bounded set: the most recently added `cap` keys."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def add(self, key: Any) -> None:
        self[key] = None
        self.move_to_end(key)
        while len(self) > self.cap:
            self.popitem(last=False)


@dataclass
class _Flight:
    key: str
    req: RouteRequest
    encoder_s: float
    prefill_s: float
    decoding: bool = False
    stream: bool = True
    routed_at: float = 0.0  # when it was routed (admission learns from its first token)
    predicted_s: float = 0.0  # its wait admission predicted then (uncalibrated)


@dataclass
class _Replica:
    key: str
    config: RouterConfig
    info: dict[str, Any] = field(default_factory=dict)
    queued_encoder_s: float = 0.0
    queued_prefill_s: float = 0.0
    waiting: int = 0
    decoding: int = 0
    decode_context: int = 0
    routed: int = 0

    def __post_init__(self) -> None:
        self.images = _LRU(self.config.recent_images)
        self.prefixes = _LRU(self.config.recent_blocks)

    def state(self) -> ReplicaState:
        return ReplicaState(self.key, max(0.0, self.queued_encoder_s),
                            max(0.0, self.queued_prefill_s), self.waiting, self.decoding,
                            self.decode_context, self.routed, self.images, self.prefixes)


class ReplicaTracker:
    """See the module docstring. `model` None ranks media_aware by load alone."""

    def __init__(self, model: WorkModel | None = None, config: RouterConfig | None = None, *,
                 policy: str = "media_aware", clock: Callable[[], float] = time.monotonic,
                 admission: AdmissionPolicy | None = None) -> None:
        require_choice("policy", policy, POLICIES)
        self.model, self.config, self.policy, self.clock = \
            model, config or RouterConfig(), policy, clock
        # SLO-aware admission (routing/admission.py): replicas that can meet the TTFT bound
        # first; `shed` says when none can
        self.admission = admission if admission is not None and admission.active else None
        self._lock = threading.RLock()
        self._replicas: dict[str, _Replica] = {}
        self._flights: dict[str, _Flight] = {}
        self._gone: dict[str, dict[str, Any]] = {}  # info of replicas that left
        self._lost: dict[str, str] = {}  # request id -> the replica that left with it
        self._due: list[tuple[float, int, _Flight]] = []  # (predicted first token, seq, flight)
        self._recent: deque[frozenset] = deque()
        self._seen: Counter = Counter()
        self._turn = 0
        self._seq = itertools.count()
        self.num_routed = 0

    # The replica set.

    def sync(self, replicas: Mapping[str, Mapping[str, Any] | None]) -> None:
        """Make the tracked set exactly `replicas` (key -> info, e.g. the replica's routing
        stats); a replica that left takes its requests' accounts with it."""
        with self._lock:
            for key in [k for k in self._replicas if k not in replicas]:
                self.remove(key)
            for key, info in replicas.items():
                self.add(key, info)

    def add(self, key: str, info: Mapping[str, Any] | None = None) -> None:
        with self._lock:
            rep = self._replicas.get(key)
            if rep is None:
                rep = self._replicas[key] = _Replica(key, self.config)
            if info:
                rep.info = dict(info)

    def remove(self, key: str) -> None:
        """Replica `key` left (died, scaled down): forget its accounts, but remember its info
        and which requests it held, for the error they end with."""
        with self._lock:
            rep = self._replicas.pop(key, None)
            if rep is None:
                return
            self._gone[key] = rep.info
            for rid in [r for r, f in self._flights.items() if f.key == key]:
                del self._flights[rid]
                self._lost[rid] = key
            for d in (self._gone, self._lost):
                while len(d) > 4096:
                    d.pop(next(iter(d)))

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    def info(self) -> dict[str, dict[str, Any]]:
        """key -> the latest info each live replica reported."""
        with self._lock:
            return {k: dict(r.info) for k, r in self._replicas.items()}

    def info_of(self, key: str) -> dict[str, Any]:
        """The latest info of replica `key`, live or gone ({} if it never reported)."""
        with self._lock:
            rep = self._replicas.get(key)
            return dict(rep.info if rep is not None else self._gone.get(key, {}))

    def states(self, keys: Iterable[str] | None = None) -> list[ReplicaState]:
        with self._lock:
            self._promote()
            keys = list(self._replicas) if keys is None else list(keys)
            return [self._replicas[k].state() if k in self._replicas else ReplicaState(k)
                    for k in keys]

    # Routing.

    def common_keys(self, req: RouteRequest) -> frozenset:
        """The request's image and block hashes that too many recent requests carried."""
        with self._lock:
            cfg, n = self.config, len(self._recent)
            need = max(cfg.common_min, cfg.common_share * n)
            keys = (*req.image_hashes, *req.prefix_hashes)
            return frozenset(k for k in keys if k and self._seen[k] >= need)

    def rank(self, req: RouteRequest | None, keys: Sequence[str], *,
             exclude: Iterable[str] = ()) -> list[str]:
        """`keys` best first for `req` (the replicas in `exclude` last, e.g. one that just
        failed it)."""
        with self._lock:
            self._promote()
            skip = set(exclude)
            first = [k for k in keys if k not in skip]
            later = [k for k in keys if k in skip]
            if req is not None:
                req = replace(req, common=self.common_keys(req))
            out = []
            for group in (first, later):
                if not group:
                    continue
                states = self.states(group)
                order = rank_replicas(self.policy, req, states, self.model, self.config,
                                      turn=self._turn)
                if self.admission is not None and req is not None and self.model is not None:
                    order = admission_order(self.admission, req, states, self.model, order)[0]
                out += [group[i] for i in order]
            return out

    def shed(self, req: RouteRequest, keys: Sequence[str] | None = None) -> Prediction | None:
        """Under SLO-aware admission, the refusal to answer `req` with when no replica (of
        `keys`, default all) is predicted to meet its TTFT bound; None when one is."""
        if self.admission is None or self.model is None:
            return None
        with self._lock:
            self._promote()
            keys = self.keys() if keys is None else list(keys)
            states = self.states(keys)
            verdict = admission_order(self.admission, replace(
                req, common=self.common_keys(req)), states, self.model,
                range(len(states)))[1]
            self.admission.refused += verdict is not None
            return verdict

    def choose(self, req: RouteRequest, keys: Sequence[str] | None = None) -> str:
        """Rank and route in one go (the simulator's call); returns the replica's key."""
        with self._lock:
            order = self.rank(req, self.keys() if keys is None else keys)
            if not order:
                raise ValueError("no replica to route to")
            self.on_routed(order[0], req)
            return order[0]

    def on_routed(self, key: str, req: RouteRequest, *, stream: bool = True) -> None:
        """`req` was sent to replica `key` (again: a retry, or a new routing round, replaces
        the earlier account). Without `stream` its first token will not be reported: it
        counts as decoding from its predicted first-token time."""
        with self._lock:
            self.on_finished(req.request_id)
            rep = self._replica(key)
            flight = self._flights[req.request_id] = _Flight(key, req, 0.0, 0.0, stream=stream,
                                                             routed_at=self.clock())
            if self.admission is not None and self.model is not None:
                p = predict(self.admission, req, rep.state(), self.model)
                flight.predicted_s = p.ttft_s / self.admission.scale
            self._charge(rep, flight)
            rep.routed += 1
            for h in req.image_hashes:
                if h:
                    rep.images.add(h)
            for h in req.prefix_hashes:
                rep.prefixes.add(h)
            self._remember(frozenset(k for k in (*req.image_hashes, *req.prefix_hashes) if k))
            self._turn += 1
            self.num_routed += 1

    def confirm(self, request_id: str, key: str) -> None:
        """The request is in fact on replica `key` (the router's first choice was full):
        move its account there."""
        with self._lock:
            f = self._flights.get(request_id)
            if f is None or f.key == key or f.decoding:
                return
            old = self._replicas.get(f.key)
            if old is not None:
                old.queued_encoder_s -= f.encoder_s
                old.queued_prefill_s -= f.prefill_s
                old.waiting -= 1
                old.routed -= 1
                if not old.waiting:
                    old.queued_encoder_s = old.queued_prefill_s = 0.0
            f.key = key
            rep = self._replica(key)
            self._charge(rep, f)
            rep.routed += 1

    def _replica(self, key: str) -> _Replica:
        rep = self._replicas.get(key)
        if rep is None:
            rep = self._replicas[key] = _Replica(key, self.config)
        return rep

    def _charge(self, rep: _Replica, f: _Flight) -> None:
        """Put flight `f`'s predicted compute work on `rep`'s queue."""
        req = f.req
        hashes = req.image_hashes or ("",) * len(req.image_tokens)
        f.encoder_s = sum(self.model.encoder_s(t) for t, h in zip(
            req.image_tokens, hashes, strict=True) if not (h and h in rep.images)) \
            if self.model else 0.0
        f.prefill_s = self.model.prefill_s(req.prompt_tokens) if self.model else 0.0
        if not f.stream:
            due = self.clock() + rep.queued_encoder_s + rep.queued_prefill_s + f.encoder_s \
                + f.prefill_s
            heapq.heappush(self._due, (due, next(self._seq), f))
        rep.queued_encoder_s += f.encoder_s
        rep.queued_prefill_s += f.prefill_s
        rep.waiting += 1

    def on_first_token(self, request_id: str) -> None:
        with self._lock:
            f = self._flights.get(request_id)
            if f is None or f.decoding:
                return
            rep = self._replicas.get(f.key)
            f.decoding = True
            if self.admission is not None and f.stream:  # seen, not predicted: learn from it
                self.admission.observe(f.predicted_s, self.clock() - f.routed_at)
            if rep is not None:
                rep.queued_encoder_s -= f.encoder_s
                rep.queued_prefill_s -= f.prefill_s
                rep.waiting -= 1
                rep.decoding += 1
                rep.decode_context += f.req.prompt_tokens
                if not rep.waiting:  # no drift: an empty queue is exactly zero
                    rep.queued_encoder_s = rep.queued_prefill_s = 0.0

    def on_finished(self, request_id: str) -> None:
        with self._lock:
            self._lost.pop(request_id, None)
            self.on_first_token(request_id)
            f = self._flights.pop(request_id, None)
            rep = self._replicas.get(f.key) if f is not None else None
            if rep is not None:
                rep.decoding -= 1
                rep.decode_context -= f.req.prompt_tokens

    def assigned(self, request_id: str) -> str | None:
        """The replica a request in flight was routed to (also when that replica has left)."""
        with self._lock:
            f = self._flights.get(request_id)
            return f.key if f is not None else self._lost.get(request_id)

    def _promote(self) -> None:
        now = self.clock()
        while self._due and self._due[0][0] <= now:
            flight = heapq.heappop(self._due)[2]
            if self._flights.get(flight.req.request_id) is flight:
                self.on_first_token(flight.req.request_id)

    def _remember(self, keys: frozenset) -> None:
        self._recent.append(keys)
        self._seen.update(keys)
        while len(self._recent) > self.config.common_window:
            old = self._recent.popleft()
            self._seen.subtract(old)
            for k in old:
                if self._seen[k] <= 0:
                    del self._seen[k]
