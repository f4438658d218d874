"""Latency SLOs and goodput, defined once for the engine, the simulator, the benchmark and the
server.

An SLO bounds any subset of four per-request latencies, written ``ttft:MS,tpot:MS,itl:MS,e2el:MS``
(milliseconds, as `vllm bench serve --goodput` takes them):

- ``ttft``: arrival to first token;
- ``tpot``: (E2EL - TTFT) / (output tokens - 1), the request's mean time per output token;
- ``itl``: the request's own p99 inter-token latency (a request whose decoding stalls now and
  then misses it even when its mean TPOT is fine);
- ``e2el``: arrival to last token.

The default everywhere (`DEFAULT_SLO`) is ``ttft:2000,tpot:50``: an image answer that starts
within 2 s and then streams at 20 tokens/s or better.

Goodput (`goodput`): of the requests that arrived in a run's arrival window, how many met the
SLO, per second of that window (``rate_per_s``) and as a fraction (``attainment``). A request
that had not finished when the run ended - the run drains for a bounded time after arrivals
stop - or that failed counts as a miss. A one-token request has no TPOT or ITL to miss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_SLO_TEXT = "ttft:2000,tpot:50"


def p99(values: Sequence[float]) -> float | None:
    """Linear-interpolated 99th percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * 0.99
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class RequestLatency:
    """One finished request's latencies in seconds (None where it has none)."""

    ttft: float | None
    tpot: float | None
    itl: float | None  # the request's p99 inter-token latency
    e2el: float | None

    @classmethod
    def from_times(cls, arrival: float, first_token: float | None, finish: float | None,
                   itls: Sequence[float] = (), output_tokens: int | None = None
                   ) -> RequestLatency | None:
        """From timestamps and inter-token gaps (seconds); None when it never finished.
        `output_tokens` defaults to ``len(itls) + 1``."""
        if first_token is None or finish is None:
            return None
        n = len(itls) + 1 if output_tokens is None else output_tokens
        tpot = (finish - first_token) / (n - 1) if n > 1 else None
        return cls(first_token - arrival, tpot, p99(itls), finish - arrival)

    @classmethod
    def from_token_times(cls, arrival: float, token_times: Sequence[float],
                         finish: float | None, output_tokens: int | None = None
                         ) -> RequestLatency | None:
        """From every token's timestamp (the first is the first token's)."""
        if not token_times:
            return None
        gaps = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
        return cls.from_times(arrival, token_times[0], finish, gaps,
                              len(token_times) if output_tokens is None else output_tokens)

    @classmethod
    def from_metrics(cls, m: Any) -> RequestLatency | None:
        """From an engine `RequestMetrics` (arrival, token and finish timestamps)."""
        return cls.from_token_times(m.arrival_time, tuple(m.token_times), m.finished_time)


@dataclass(frozen=True)
class Slo:
    """Upper bounds in milliseconds on per-request latencies (None: not bounded)."""

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None
    e2el: float | None = None

    def __post_init__(self) -> None:
        for name in METRICS:
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"SLO {name}={v!r} must be a positive number of milliseconds")
            object.__setattr__(self, name, float(v))

    @classmethod
    def parse(cls, text: str | None) -> Slo:
        """``"ttft:2000,tpot:50"`` -> Slo(ttft=2000.0, tpot=50.0); any subset of ttft, tpot,
        itl (p99 per request), e2el, in milliseconds. ValueError naming the bad entry."""
        if not isinstance(text, str):
            raise ValueError(f"SLO must be a string like {DEFAULT_SLO_TEXT!r}, got {text!r}")
        values: dict[str, float] = {}
        for part in text.split(","):
            if not part.strip():
                continue
            name, sep, value = part.strip().partition(":")
            name = name.strip()
            if not sep or name not in METRICS:
                raise ValueError(f"SLO entry {part.strip()!r}: want NAME:MS with NAME one of "
                                 f"{', '.join(METRICS)}")
            if name in values:
                raise ValueError(f"SLO entry {part.strip()!r}: {name} given twice")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"SLO entry {part.strip()!r}: {value.strip()!r} is not a "
                                 "number of milliseconds") from None
            if not 0 < ms < float("inf"):
                raise ValueError(f"SLO entry {part.strip()!r}: must be a positive number of "
                                 "milliseconds")
            values[name] = ms
        if not values:
            raise ValueError(f"SLO {text!r} bounds nothing; e.g. {DEFAULT_SLO_TEXT!r}")
        return cls(**values)

    @classmethod
    def of(cls, value: Slo | str | dict | None) -> Slo:
        """An Slo from an Slo, its text, its `to_dict()` or None (the default)."""
        if value is None:
            return DEFAULT_SLO
        if isinstance(value, Slo):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(METRICS)
            if unknown:
                raise ValueError(f"SLO: unknown metrics {sorted(unknown)}; known: "
                                 f"{', '.join(METRICS)}")
            return cls(**value)
        return cls.parse(value)

    def to_dict(self) -> dict[str, float]:
        """The bounds that are set, in milliseconds: ``{"ttft": 2000.0, "tpot": 50.0}``."""
        return {n: getattr(self, n) for n in METRICS if getattr(self, n) is not None}

    def __str__(self) -> str:
        return ",".join(f"{n}:{v:g}" for n, v in self.to_dict().items())

    def misses(self, lat: RequestLatency | None) -> tuple[str, ...]:
        """The bounds `lat` misses (every bound when the request never finished)."""
        if lat is None:
            return tuple(self.to_dict())
        return tuple(n for n, limit in self.to_dict().items()
                     if (v := getattr(lat, n)) is not None and v * 1e3 > limit)

    def meets(self, lat: RequestLatency | None) -> bool:
        """Whether a request met every bound; an unfinished one (None) never does."""
        return lat is not None and not self.misses(lat)


DEFAULT_SLO = Slo.parse(DEFAULT_SLO_TEXT)


@dataclass(frozen=True)
class Goodput:
    """Requests meeting the SLO: per second of the arrival window and as a fraction."""

    slo: Slo
    rate_per_s: float
    attainment: float
    met: int
    counted: int
    window_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"slo": self.slo.to_dict(), "rate_per_s": self.rate_per_s,
                "attainment": self.attainment, "met": self.met, "counted": self.counted,
                "window_s": self.window_s}


def goodput(latencies: Iterable[RequestLatency | None], slo: Slo, window_s: float) -> Goodput:
    """Goodput of the requests that arrived in an arrival window of `window_s` seconds, one
    entry each (None: unfinished or failed, a miss). No request: attainment 1 (nothing was
    missed) and rate 0."""
    if not window_s > 0:
        raise ValueError(f"window_s={window_s!r} must be positive")
    lats = list(latencies)
    met = sum(1 for lat in lats if slo.meets(lat))
    return Goodput(slo, met / window_s, met / len(lats) if lats else 1.0, met, len(lats),
                   float(window_s))
