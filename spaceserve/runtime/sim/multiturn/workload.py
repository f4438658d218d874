"""Multi-turn image chat in the simulator: conversations, think time, image reuse, caching.

A conversation opens with an image question (conversations arrive Poisson, or gamma with
`burstiness`, at `conversation_rate`). Each of its `turns` turns is sent an exponential think
time (mean `think_s`) after the previous answer finished - a closed loop, as a person chats -
and resends the whole history: every image so far, every earlier question and answer, and a
new question of `text_tokens`. A follow-up turn asks about the images already sent with
probability `image_reuse`, else it brings a new one.

With caching (SpaceServe's default: the encoder output cache and automatic prefix caching) the
images a turn resends are zero encoder work, and the previous turn's prompt and answer - whole
blocks of `block_size` tokens - are in the KV cache, so only the rest is prefilled. The caches
are taken to be large enough for every live conversation (100 GB of an H200 holds ~1.7M tokens
of Qwen2-VL-7B KV); eviction is not modelled. Without caching every turn encodes every image
and prefills its whole history. Both runs see the same conversations (their contents are drawn
per conversation); only the timing differs.

Goodput (`slo.goodput`): turns that met the SLO per second of the window in which turns
arrived, and as a fraction of all turns (attainment).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.slo import RequestLatency, Slo, goodput
from spaceserve.runtime.sim.config import SimConfig
from spaceserve.runtime.sim.engine import Simulator
from spaceserve.runtime.sim.metrics import stats
from spaceserve.runtime.sim.workload import DEFAULT_MIX, RESOLUTIONS, Request, arrival_times


@dataclass(frozen=True)
class MultiTurn:
    """The conversations of one run."""

    conversation_rate: float  # new conversations per second
    duration_s: float  # conversations start within this window
    turns: int = 4
    think_s: float = 5.0  # mean think time between an answer and the next turn
    image_reuse: float = 0.75  # chance a follow-up turn brings no new image
    image_mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    text_tokens: int = 64  # tokens of each new question
    output_tokens: int = 128
    block_size: int = 16  # prefix caching reuses whole KV blocks
    burstiness: float = 1.0
    seed: int = 0
    # LLM tokens per resolution under the model's preprocessing (None: `RESOLUTIONS`, Qwen2-VL's)
    tokens_per_image: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.conversation_rate < 0 or not self.duration_s > 0:
            raise ValueError("conversation_rate must be >= 0 and duration_s > 0")
        if self.turns < 1 or self.text_tokens < 1 or self.output_tokens < 1 \
                or self.block_size < 1:
            raise ValueError("turns, text_tokens, output_tokens and block_size must be >= 1")
        if self.think_s < 0 or not 0 <= self.image_reuse <= 1:
            raise ValueError("think_s must be >= 0 and image_reuse in [0, 1]")
        unknown = set(self.image_mix) - set(self.tokens_per_image or RESOLUTIONS)
        if unknown or not self.image_mix or sum(self.image_mix.values()) <= 0:
            raise ValueError(f"image_mix: unknown resolutions {sorted(unknown)} or no weight")


@dataclass
class Conversation:
    """One conversation's drawn contents and where it is."""

    start: float
    thinks: list[float]  # before turns 1 .. turns - 1
    new_images: list[str | None]  # resolution of the image each turn brings (None: reuse)
    images: list[int] = field(default_factory=list)  # tokens of every image sent so far
    text: int = 0  # text tokens of the history so far (questions and answers)
    previous: int = 0  # prompt + answer tokens of the previous turn (0 before the first)
    turn: int = 0


def conversations(mt: MultiTurn) -> list[Conversation]:
    """The conversations of `mt`, each drawn from its own seeded stream."""
    starts = arrival_times(mt.conversation_rate, mt.duration_s, mt.burstiness,
                           random.Random(mt.seed))
    names = list(mt.image_mix)
    weights = [mt.image_mix[n] for n in names]
    out = []
    for i, t in enumerate(starts):
        rng = random.Random(f"{mt.seed}/{i}")
        thinks = [rng.expovariate(1 / mt.think_s) if mt.think_s > 0 else 0.0
                  for _ in range(mt.turns - 1)]
        new = [rng.choices(names, weights)[0] if k == 0 or rng.random() >= mt.image_reuse
               else None for k in range(mt.turns)]
        out.append(Conversation(t, thinks, new))
    return out


def next_turn(conv: Conversation, mt: MultiTurn, rid: int, now: float, caching: bool
              ) -> Request:
    """The request of `conv`'s next turn, arriving `now`."""
    seen = sum(conv.images)
    res = conv.new_images[conv.turn]
    if res is not None:
        conv.images.append((mt.tokens_per_image or RESOLUTIONS)[res])
    conv.text += mt.text_tokens
    req = Request(rid, now, sum(conv.images), conv.text, mt.output_tokens, "image",
                  res or "reuse")
    if caching and conv.turn:
        req.cached_image_tokens = seen
        cached = conv.previous // mt.block_size * mt.block_size
        req.cached_tokens = min(cached, req.prompt_tokens - 1)
    return req


def run_multiturn(curves: CurveSet, config: SimConfig, mt: MultiTurn, *, caching: bool
                  ) -> list[tuple[int, int, Request]]:
    """Simulate the conversations of `mt` on one GPU; returns (conversation, turn number,
    request) of every turn, in arrival order."""
    convs = conversations(mt)
    sim = Simulator(curves, config, horizon=mt.duration_s)
    due: list[tuple[float, int]] = [(c.start, i) for i, c in enumerate(convs)]
    heapq.heapify(due)
    owner: dict[int, int] = {}
    turns: list[tuple[int, int, Request]] = []

    def on_finish(req: Request) -> None:
        i = owner.get(req.rid)
        if i is None:
            return
        conv = convs[i]
        conv.previous = req.prompt_tokens + req.generated
        conv.text += req.generated
        if conv.turn < mt.turns:
            t = req.finish + conv.thinks[conv.turn - 1]
            heapq.heappush(due, (t, i))
            sim.wake_at = min(sim.wake_at, t)

    sim.on_finish = on_finish
    while due or sim.outstanding():
        sim.advance_to(due[0][0] if due else math.inf)
        sim.wake_at = math.inf
        while due and due[0][0] <= sim.now:
            _, i = heapq.heappop(due)
            req = next_turn(convs[i], mt, len(turns), sim.now, caching)
            convs[i].turn += 1
            owner[req.rid] = i
            turns.append((i, convs[i].turn - 1, req))
            sim.add(req)
    sim.drain()
    return turns


def summarize_turns(numbered: Sequence[tuple[int, int, Request]], slo: Slo,
                    window_s: float | None = None) -> dict[str, Any]:
    """TTFT (all turns, follow-ups), TPOT, goodput under `slo` over `window_s` (default: up
    to the last turn's arrival), and the work done (patches encoded, tokens prefilled)."""
    turns = [r for _, _, r in numbered]
    lats = [RequestLatency.from_times(r.arrival, r.first_token, r.finish, r.itls, r.generated)
            for r in turns]
    window = window_s or max((r.arrival for r in turns), default=0.0) or 1.0
    good = goodput(lats, slo, window)
    return {"turns": len(turns), "ttft": stats([x.ttft for x in lats if x is not None]),
            "followup_ttft": stats([r.first_token - r.arrival for _, k, r in numbered
                                    if k > 0 and r.first_token is not None]),
            "tpot": stats([x.tpot for x in lats if x is not None and x.tpot is not None]),
            "good": good.met, "attainment": good.attainment, "goodput": good.rate_per_s,
            "encoded_patches": sum(r.patches for r in turns),
            "prefilled_tokens": sum(r.prompt_tokens - r.cached_tokens for r in turns)}


def sweep_multiturn(curves: CurveSet, modes: Sequence[str], rates: Sequence[float],
                    mt: MultiTurn, base: SimConfig, *, slo: Slo,
                    seeds: Sequence[int] = (0,)) -> list[dict[str, Any]]:
    """Every (mode, conversation rate, caching on / off): one summary row each, over the
    turns of every seed pooled (goodput: SLO-meeting turns over the seeds' windows summed)."""
    rows = []
    for mode in modes:
        cfg = dataclasses.replace(base, mode=mode)
        for rate in rates:
            for caching in (True, False):
                pooled: list[tuple[int, int, Request]] = []
                window = 0.0
                for seed in seeds:
                    w = dataclasses.replace(mt, conversation_rate=rate, seed=seed)
                    turns = run_multiturn(curves, cfg, w, caching=caching)
                    window += max((r.arrival for _, _, r in turns), default=0.0)
                    pooled += turns
                rows.append({"mode": mode, "rate": rate, "caching": caching,
                             **summarize_turns(pooled, slo, window or None)})
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of `sweep_multiturn` rows."""
    out = ["| mode | conv/s | caching | turns | TTFT mean ms | TTFT p99 ms | follow-up TTFT "
           "mean ms | TPOT mean ms | SLO met | goodput turns/s |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['mode']} | {r['rate']:g} | {'on' if r['caching'] else 'off'} | "
                   f"{r['turns']} | {r['ttft']['mean_ms']:.0f} | {r['ttft']['p99_ms']:.0f} | "
                   f"{r['followup_ttft']['mean_ms']:.0f} | {r['tpot']['mean_ms']:.1f} | "
                   f"{100 * r['attainment']:.0f}% | {r['goodput']:.2f} |")
    return "\n".join(out)
