"""Serving metrics of simulated requests, named as `vllm bench serve` names them.

TTFT = first token - arrival; TPOT = (E2EL - TTFT) / (output tokens - 1); ITL = every gap between
consecutive tokens of a request; E2EL = finish - arrival. Background requests (decoding from the
start) have no TTFT or E2EL of their own but count for TPOT and ITL, which is what the image load
does to decode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .workload import Request

# Goodput SLOs (ms) unless told otherwise: `spaceserve bench serve --slo`'s default.
DEFAULT_SLOS_MS: dict[str, float] = {"ttft": 1000.0, "tpot": 100.0}


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


def request_record(r: Request) -> dict[str, Any]:
    """Per-request outcome (seconds) for the JSON output."""
    ttft = None if r.kind == "background" else r.first_token - r.arrival
    e2el = r.finish - r.arrival
    tpot = (r.finish - r.first_token) / (r.generated - 1) if r.generated > 1 else None
    return {"rid": r.rid, "gpu": r.gpu, "kind": r.kind, "resolution": r.resolution,
            "arrival": r.arrival, "prompt_tokens": r.prompt_tokens, "output_tokens": r.generated,
            "ttft": ttft, "tpot": tpot, "e2el": None if r.kind == "background" else e2el,
            "mean_itl": sum(r.itls) / len(r.itls) if r.itls else None,
            "max_itl": max(r.itls) if r.itls else None}


def summarize(requests: Iterable[Request], kinds: Sequence[str] | None = None
              ) -> dict[str, Any]:
    """Aggregate metrics over the finished requests of the given kinds (default: all)."""
    reqs = [r for r in requests if kinds is None or r.kind in kinds]
    unfinished = sum(1 for r in reqs if r.finish is None)
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
        "completed": len(done), "unfinished": unfinished, "served": len(served),
        "ttft": stats(ttft), "tpot": stats(tpot), "itl": stats(itl), "e2el": stats(e2el),
        "duration_s": span,
        "request_throughput": len(served) / span if span > 0 else 0.0,
        "output_throughput": sum(r.generated for r in done) / span if span > 0 else 0.0,
        "served_output_throughput": tokens / span if span > 0 else 0.0,
    }


def meets(r: Request, slos: dict[str, float]) -> bool:
    """Whether a finished image or text request met every SLO (ms; "ttft", "tpot", "e2el"). A
    one-token request has no TPOT to miss."""
    if r.finish is None:
        return False
    values = {"ttft": r.first_token - r.arrival, "e2el": r.finish - r.arrival,
              "tpot": (r.finish - r.first_token) / (r.generated - 1) if r.generated > 1
              else None}
    for name, limit_ms in slos.items():
        if name not in values:
            raise ValueError(f"slos: unknown metric {name!r}; choose from {sorted(values)}")
        if values[name] is not None and values[name] * 1e3 > limit_ms:
            return False
    return True


def goodput(requests: Iterable[Request], slos: dict[str, float], duration_s: float) -> float:
    """Image and text requests per second of arrivals that met every SLO (the background batch
    is not served traffic)."""
    if duration_s <= 0:
        return 0.0
    return sum(1 for r in requests if r.kind != "background" and meets(r, slos)) / duration_s
