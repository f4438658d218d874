"""Serving-benchmark metrics, named as `vllm bench serve` names them.

The aggregation is the simulator's (`spaceserve.runtime.sim.metrics.summarize`): TTFT, TPOT =
(E2EL - TTFT) / (output tokens - 1) over requests with more than one token, ITL = every gap
between consecutive streamed outputs, E2EL; mean / median / p99. This module turns measured
results into the records it takes, adds goodput (requests per second that meet every SLO) and
flattens everything to vLLM's key names (``mean_ttft_ms``, ``p99_itl_ms``, ...).

SLOs and goodput are `spaceserve.runtime.policy.slo`'s, as in the simulator and the server:
``request_goodput`` (vLLM's name) is load requests per second of the run that met the SLO, and
``goodput`` the image requests of the arrival window that met it (per second of the window, and
as a fraction), a failed, cut or unsent one counting as a miss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from spaceserve.runtime.policy.slo import RequestLatency, Slo, goodput
from spaceserve.runtime.sim.metrics import summarize


@dataclass
class Result:
    """What one benchmark request did; times in seconds on one monotonic clock."""

    idx: int
    kind: str
    resolution: str
    send: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str | None = None
    image_tokens: int = 0  # of prompt_tokens; known in-process only

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish is not None and self.first_token is not None


@dataclass
class Record:
    """A successful request in the simulator's record shape (times relative to run start)."""

    rid: int
    kind: str
    resolution: str
    arrival: float
    first_token: float
    finish: float
    generated: int
    prompt_tokens: int
    itls: list[float]
    gpu: int = 0
    shed: str | None = None  # never: a measured request is served or failed (the sim's field)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.finish - self.first_token) / (self.generated - 1) \
            if self.generated > 1 else None

    @property
    def e2el(self) -> float:
        return self.finish - self.arrival


def to_record(r: Result, t0: float) -> Record | None:
    """The record of a successful result (None for a failed one)."""
    if not r.ok:
        return None
    times = r.token_times or [r.first_token]
    itls = [b - a for a, b in zip(times, times[1:], strict=False)]
    return Record(r.idx, r.kind, r.resolution, r.send - t0, r.first_token - t0, r.finish - t0,
                  max(r.output_tokens, 1), r.prompt_tokens, itls)


def latency(rec: Record) -> RequestLatency | None:
    """A record's latencies for SLO checks (TPOT over its output count, p99 of its gaps)."""
    return RequestLatency.from_times(rec.arrival, rec.first_token, rec.finish, rec.itls,
                                     rec.generated)


def result_latency(r: Result) -> RequestLatency | None:
    """A result's latencies; None for a failed (or cut) request."""
    rec = to_record(r, r.send)
    return None if rec is None else latency(rec)


def flatten(summary: dict[str, Any]) -> dict[str, Any]:
    """The simulator's nested summary under vLLM's flat key names."""
    out: dict[str, Any] = {"completed": summary["served"], "duration": summary["duration_s"],
                           "request_throughput": summary["request_throughput"],
                           "output_throughput": summary["served_output_throughput"]}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            out[f"{stat}_{metric}_ms"] = summary[metric][f"{stat}_ms"]
    return out


def summarize_results(results: Iterable[Result], slo: Slo | dict | None, t0: float,
                      duration: float | None = None, *, window_s: float | None = None,
                      unsent_images: int = 0) -> dict[str, Any]:
    """Load (image + text) and probe metrics of one run, failures counted apart.

    `duration` (seconds) defaults to first send -> last finish; throughput and
    ``request_goodput`` use it. With `window_s` (the arrival window) and an `slo`, ``goodput``
    covers the image requests (`unsent_images` of them never sent: misses). A dict `slo` is
    an `Slo.to_dict()` (empty: no SLO).
    """
    if isinstance(slo, dict):
        slo = Slo.of(slo) if slo else None
    results = list(results)
    records = [rec for rec in (to_record(r, t0) for r in results) if rec is not None]
    out: dict[str, Any] = {"failed": sum(1 for r in results if not r.ok),
                           "errors": sorted({r.error for r in results if r.error})[:5]}
    for name, kinds in (("load", ("image", "text")), ("probe", ("probe",))):
        group = [r for r in records if r.kind in kinds]
        s = flatten(summarize(group))
        span = duration if duration is not None else s["duration"]
        if duration is not None and span > 0:
            s["duration"] = span
            s["request_throughput"] = len(group) / span
            s["output_throughput"] = sum(r.generated for r in group) / span
        s["total_input_tokens"] = sum(r.prompt_tokens for r in group)
        s["total_output_tokens"] = sum(r.generated for r in group)
        s["request_goodput"] = goodput([latency(r) for r in group], slo, span).rate_per_s \
            if slo is not None and span > 0 else None
        out[name] = s
    if slo is not None and window_s is not None:
        images = [result_latency(r) for r in results if r.kind == "image"]
        out["goodput"] = goodput(images + [None] * unsent_images, slo, window_s).to_dict()
    return out
