"""Serving metrics of simulated requests, named as `vllm bench serve` names them.

TTFT = first token - arrival; TPOT = (E2EL - TTFT) / (output tokens - 1); ITL = every gap between
consecutive tokens of a request; E2EL = finish - arrival. Background requests (decoding from the
start) have no TTFT or E2EL of their own but count for TPOT and ITL, which is what the image load
does to decode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from spaceserve.runtime.policy.slo import Goodput, RequestLatency, Slo, goodput
from spaceserve.runtime.sim.workload import Request


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: Sequence[float]) -> dict[str, float]:
    """mean / median / p99 in milliseconds (inputs in seconds)."""
    if not values:
        nan = float("nan")
        return {"mean_ms": nan, "median_ms": nan, "p99_ms": nan}
    return {"mean_ms": 1e3 * sum(values) / len(values),
            "median_ms": 1e3 * percentile(values, 50),
            "p99_ms": 1e3 * percentile(values, 99)}


def latency(r: Request) -> RequestLatency | None:
    """A served request's latencies for SLO checks; None while it is unfinished."""
    return RequestLatency.from_times(r.arrival, r.first_token, r.finish, r.itls, r.generated)


def request_record(r: Request, slo: Slo | None = None) -> dict[str, Any]:
    """Per-request outcome (seconds) for the JSON output; None where it has none (an unfinished
    request has no E2EL); ``slo_met`` when an SLO is given (image and text requests)."""
    served = r.kind != "background"
    ttft = r.first_token - r.arrival if served and r.first_token is not None else None
    e2el = r.finish - r.arrival if served and r.finish is not None else None
    tpot = None
    if r.finish is not None and r.first_token is not None and r.generated > 1:
        tpot = (r.finish - r.first_token) / (r.generated - 1)
    out = {"rid": r.rid, "gpu": r.gpu, "kind": r.kind, "resolution": r.resolution,
           "arrival": r.arrival, "prompt_tokens": r.prompt_tokens, "output_tokens": r.generated,
           "finished": r.finish is not None, "shed": r.shed or None, "ttft": ttft,
           "tpot": tpot, "e2el": e2el,
           "mean_itl": sum(r.itls) / len(r.itls) if r.itls else None,
           "max_itl": max(r.itls) if r.itls else None}
    if slo is not None and served:
        out["slo_met"] = slo.meets(latency(r))
    return out


def image_goodput(requests: Iterable[Request], slo: Slo, window_s: float) -> Goodput:
    """Goodput of the image requests that arrived in ``[0, window_s)`` (the arrival window);
    one unfinished when the run ended is a miss."""
    return goodput((latency(r) for r in requests if r.kind == "image" and r.arrival < window_s),
                   slo, window_s)


def summarize(requests: Iterable[Request], kinds: Sequence[str] | None = None
              ) -> dict[str, Any]:
    """Aggregate metrics over the finished requests of the given kinds (default: all)."""
    reqs = [r for r in requests if kinds is None or r.kind in kinds]
    shed = sum(1 for r in reqs if r.shed)  # refused or ended by SLO-aware admission
    unfinished = sum(1 for r in reqs if r.finish is None) - shed
    done = [r for r in reqs if r.finish is not None]
    served = [r for r in done if r.kind != "background"]
    ttft = [r.first_token - r.arrival for r in served]
    e2el = [r.finish - r.arrival for r in served]
    tpot = [(r.finish - r.first_token) / (r.generated - 1) for r in done if r.generated > 1]
    itl = [x for r in done for x in r.itls]
    start = min((r.arrival for r in done), default=0.0)
    end = max((r.finish for r in done), default=0.0)
    span = end - start
    tokens = sum(r.generated for r in served)
    return {
        "completed": len(done), "unfinished": unfinished, "served": len(served), "shed": shed,
        "ttft": stats(ttft), "tpot": stats(tpot), "itl": stats(itl), "e2el": stats(e2el),
        "duration_s": span,
        "request_throughput": len(served) / span if span > 0 else 0.0,
        "output_throughput": sum(r.generated for r in done) / span if span > 0 else 0.0,
        "served_output_throughput": tokens / span if span > 0 else 0.0,
    }
