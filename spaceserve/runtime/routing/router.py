"""Request routing across engine replicas: one plain function of (request, replica states).

`rank_replicas(policy, request, replicas, model, config)` orders the candidate replicas, best
first. Ray Serve's request router (`spaceserve.server.replicas`) and the simulator's cluster mode
(`spaceserve.runtime.sim.router`) both call it, on states kept by the same `ReplicaTracker`
(tracker.py): the router's own account of what it sent where, not the engines' internals.

``media_aware`` scores a replica by the request's predicted time to its first token there:

- the compute work already queued on it (predicted encoder + prefill seconds of the requests
  routed to it that have no first token yet),
- plus this request's encoder work (TWSRFT's cost model on the resource-utility curves), minus
  the images whose content hash the replica recently served (its encoder cache may hold them),
- plus this request's prefill, minus the prompt prefix the replica recently served (its prefix
  cache may hold it),

plus the request's decode time at the replica's decode load (expected output tokens x the decode
step at the replica's batch + 1). Affinity is a saving in the same seconds as the queue, so a
replica that holds the request's images or prefix wins only while its load allows. Keys that a
large share of recent requests carry (the chat template's prefix, a common system prompt, a logo)
are marked `common` by the tracker and earn no affinity: every replica soon holds them, and they
would otherwise pull all traffic to the first replica that served them. Ties (an idle cluster)
go to the replica routed the fewest requests.

``least_loaded`` picks the fewest requests in flight; ``round_robin`` takes turns.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from spaceserve.checks import require_choice, require_int, require_number
from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.twsrft import curve_cost

POLICIES = ("media_aware", "least_loaded", "round_robin")


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs to know of one request.

    `image_tokens[i]` is image i's LLM token count and `image_hashes[i]` its content hash ("" when
    unknown); `prefix_hashes` chain-hash the prompt's full blocks of `block_tokens` tokens (a
    block's hash covers every token before it, image contents included), so two prompts share
    the first k hashes exactly when they share the first k blocks. `output_tokens` is the decode
    work expected (the request's limit, capped by the router). `common` holds keys (image or
    block hashes) too widespread to count as affinity; the tracker fills it in.
    """

    request_id: str
    prompt_tokens: int
    image_tokens: tuple[int, ...] = ()
    image_hashes: tuple[str, ...] = ()
    prefix_hashes: tuple[int, ...] = ()
    block_tokens: int = 64
    output_tokens: int = 128
    common: frozenset = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if len(self.image_hashes) not in (0, len(self.image_tokens)):
            raise ValueError(f"{len(self.image_hashes)} image hashes for "
                             f"{len(self.image_tokens)} images")
        if self.prompt_tokens < 0 or self.output_tokens < 0 or self.block_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 0, block_tokens >= 1")


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the router sees it (seconds are predicted, not measured).

    `queued_encoder_s` / `queued_prefill_s`: compute work of requests routed there that have no
    first token yet; `waiting` their count; `decoding` / `decode_context`: requests past their
    first token and their context tokens; `routed`: requests ever routed there; `images` /
    `prefixes`: content hashes and prefix-block hashes it recently served.
    """

    key: str
    queued_encoder_s: float = 0.0
    queued_prefill_s: float = 0.0
    waiting: int = 0
    decoding: int = 0
    decode_context: int = 0
    routed: int = 0
    images: Container = frozenset()
    prefixes: Container = frozenset()

    @property
    def in_flight(self) -> int:
        return self.waiting + self.decoding


@dataclass(frozen=True)
class RouterConfig:
    """Knobs of the router and its tracker.

    `max_output_tokens` caps the decode work a request is expected to bring (clients often send
    no limit); `decode_weight` scales the decode term against time to first token.
    `recent_images` / `recent_blocks`: how many image hashes and prefix blocks a replica is
    remembered to hold (about its encoder cache and prefix cache). A key counts as common once
    it is in at least `common_share` of the last `common_window` requests (and in at least
    `common_min` of them).
    """

    block_tokens: int = 64
    max_output_tokens: int = 512
    decode_weight: float = 1.0
    recent_images: int = 2048
    recent_blocks: int = 16384
    common_window: int = 64
    common_share: float = 0.5
    common_min: int = 4

    def __post_init__(self) -> None:
        for name in ("block_tokens", "max_output_tokens", "recent_images", "recent_blocks",
                     "common_window", "common_min"):
            value = getattr(self, name)
            require_int(name, value)
        if not 0.0 < self.common_share <= 1.0:
            raise ValueError(f"common_share={self.common_share} must be in (0, 1]")
        require_number("decode_weight", self.decode_weight, zero_ok=True)


class WorkModel:
    """Predicted stage seconds from resource-utility curves on `sms` SMs (default: the device).

    The encoder term is TWSRFT's cost model (`curve_cost`): a whole pass over one image's
    patches (`patches_per_token` ViT patches per LLM token: 4 for Qwen2-VL's 2x2 merge)."""

    def __init__(self, curves: CurveSet, sms: int | None = None, *,
                 patches_per_token: int = 4) -> None:
        self.curves = curves
        self.sms = int(sms or curves.num_sms)
        self.patches_per_token = patches_per_token
        self.depth = curves.encoder_depth
        self._encoder = curve_cost(curves, self.sms, corun=False)

    def encoder_s(self, image_tokens: int) -> float:
        """One image's encoder pass."""
        if image_tokens <= 0:
            return 0.0
        return self._encoder(image_tokens * self.patches_per_token, self.depth)

    def prefill_s(self, tokens: int, context: int = 0) -> float:
        """Prefill of `tokens` new prompt tokens after `context` cached ones."""
        return self.curves.prefill(tokens, context, self.sms) if tokens > 0 else 0.0

    def decode_step_s(self, batch: int, context: float) -> float:
        """One decode step of `batch` requests at mean context `context`."""
        return self.curves.decode(batch, context, self.sms) if batch > 0 else 0.0

    def compute_s(self, req: RouteRequest) -> tuple[float, float]:
        """(encoder, prefill) seconds of `req` on a replica that holds nothing of it."""
        return (sum(self.encoder_s(t) for t in req.image_tokens),
                self.prefill_s(req.prompt_tokens, 0))


def affinity_tokens(req: RouteRequest, prefixes: Container) -> int:
    """Prompt tokens of `req` that a replica holding `prefixes` is likely to have cached: the
    longest run of leading blocks it recently served, less the common blocks in that run."""
    matched = 0
    for h in req.prefix_hashes:
        if h not in prefixes:
            break
        if h not in req.common:
            matched += 1
    return min(matched * req.block_tokens, req.prompt_tokens)


def media_aware_cost(req: RouteRequest, r: ReplicaState, model: WorkModel,
                     config: RouterConfig) -> float:
    """Predicted seconds `req` costs on replica `r`: time to first token plus weighted decode."""
    encoder = 0.0
    for i, tokens in enumerate(req.image_tokens):
        h = req.image_hashes[i] if req.image_hashes else ""
        if h and h not in req.common and h in r.images:
            continue  # the replica's encoder cache may hold it
        encoder += model.encoder_s(tokens)
    cached = affinity_tokens(req, r.prefixes)
    prefill = model.prefill_s(req.prompt_tokens - cached, cached)
    ttft = r.queued_encoder_s + r.queued_prefill_s + encoder + prefill
    batch = r.decoding + 1
    context = (r.decode_context + req.prompt_tokens) / batch
    out = min(req.output_tokens, config.max_output_tokens)
    return ttft + config.decode_weight * out * model.decode_step_s(batch, context)


def rank_replicas(policy: str, req: RouteRequest | None, replicas: Sequence[ReplicaState],
                  model: WorkModel | None = None, config: RouterConfig | None = None, *,
                  turn: int = 0) -> list[int]:
    """Indices into `replicas`, best first, under `policy` (one of `POLICIES`).

    `req` None (a control call) or no `model` ranks media_aware by load alone (least_loaded);
    `turn` is round_robin's position."""
    n = len(replicas)
    if n == 0:
        return []
    require_choice("policy", policy, POLICIES)
    if policy == "round_robin":
        start = turn % n
        return [(start + i) % n for i in range(n)]
    if policy == "least_loaded" or req is None or model is None:
        return sorted(range(n), key=lambda i: (replicas[i].in_flight, replicas[i].routed, i))
    cfg = config or RouterConfig()
    costs = [media_aware_cost(req, r, model, cfg) for r in replicas]
    return sorted(range(n), key=lambda i: (costs[i], replicas[i].routed, i))


def choose_replica(policy: str, req: RouteRequest | None, replicas: Sequence[ReplicaState],
                   model: WorkModel | None = None, config: RouterConfig | None = None, *,
                   turn: int = 0) -> int:
    """The index of the replica `req` goes to (the head of `rank_replicas`)."""
    order = rank_replicas(policy, req, replicas, model, config, turn=turn)
    if not order:
        raise ValueError("no replica to route to")
    return order[0]
