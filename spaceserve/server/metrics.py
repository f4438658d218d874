"""Prometheus text exposition of the server's state: queues, SM split, latency histograms.

No client library: a few counters, gauges and histograms rendered in the text format (version
0.0.4). Names follow vLLM's where one exists (``spaceserve:time_to_first_token_seconds``, ...).
Observations come from the engine thread and scrapes from the event loop, so updates take a
lock; each is a handful of integer operations.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spaceserve.runtime.core.request import RequestOutput

from spaceserve.runtime.policy.slo import DEFAULT_SLO, RequestLatency, Slo

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2EL_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0)


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` upper bounds, +Inf last)."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name, self.help = name, help_text
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            acc += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {acc}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.sum!r}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class ServerMetrics:
    """Counters and histograms updated as requests finish and HTTP errors are answered.

    Every request that finishes (stop, length or error; not a client's abort) is judged by the
    engine's SLO (`runtime.policy.slo`): ``request_slo_total{result="met"|"missed"}`` is the
    server's goodput counter, and ``slo_info`` names the bounds."""

    PREFIX = "spaceserve:"

    def __init__(self, slo: Slo = DEFAULT_SLO) -> None:
        p = self.PREFIX
        self.slo = slo
        self.slo_results = {"met": 0, "missed": 0}
        self._lock = threading.Lock()
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              TPOT_BUCKETS)
        self.e2el = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency.",
                              E2EL_BUCKETS)
        self.finished: dict[str, int] = {}
        self.http_errors: dict[int, int] = {}
        self.shed = {"arrival": 0, "waiting": 0}  # SLO-aware admission's 503s
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def observe(self, out: RequestOutput) -> None:
        """Record a finished sequence (engine clock timestamps); a request with ``n`` > 1
        counts its prompt once."""
        m = out.metrics
        with self._lock:
            reason = out.finish_reason or "unknown"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if out.index == 0:
                self.prompt_tokens += len(out.prompt_token_ids)
            self.generation_tokens += len(out.token_ids)
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
                n = len(m.token_times)
                if n > 1 and m.finished_time is not None:
                    self.tpot.observe((m.finished_time - m.first_token_time) / (n - 1))
            if m.finished_time is not None and reason in ("stop", "length"):
                self.e2el.observe(m.finished_time - m.arrival_time)
            if reason != "abort":
                ok = reason in ("stop", "length") and self.slo.meets(
                    RequestLatency.from_metrics(m))
                self.slo_results["met" if ok else "missed"] += 1
            if out.extra.get("status") == 503 and "retry_after" in out.extra and out.index == 0:
                self.shed["waiting"] += 1  # ended by admission while it waited

    def refused(self) -> None:
        """A request SLO-aware admission refused at arrival: shed, and a miss of the SLO."""
        with self._lock:
            self.shed["arrival"] += 1
            self.slo_results["missed"] += 1

    def http_error(self, status: int) -> None:
        with self._lock:
            self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def render(self, gauges: Iterable[tuple[str, str, float]],
               counters: Iterable[tuple[str, str, int]] = ()) -> str:
        """The exposition text; `gauges` and `counters` (the engine's own, read from it) are
        (name without prefix, help, value)."""
        p = self.PREFIX
        lines: list[str] = []
        for name, help_text, value in gauges:
            lines += [f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} gauge",
                      f"{p}{name} {float(value)!r}"]
        for name, help_text, count in counters:
            lines += [f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} counter",
                      f"{p}{name} {int(count)}"]
        with self._lock:
            lines += [f"# HELP {p}request_success_total Finished requests by finish reason.",
                      f"# TYPE {p}request_success_total counter"]
            lines += [f'{p}request_success_total{{finished_reason="{k}"}} {v}'
                      for k, v in sorted(self.finished.items())]
            lines += [f"# HELP {p}http_errors_total Error responses by status code.",
                      f"# TYPE {p}http_errors_total counter"]
            lines += [f'{p}http_errors_total{{status="{k}"}} {v}'
                      for k, v in sorted(self.http_errors.items())]
            labels = ",".join(f'{k}_ms="{v:g}"' for k, v in self.slo.to_dict().items())
            lines += [f"# HELP {p}slo_info The latency SLO requests are judged by (ms).",
                      f"# TYPE {p}slo_info gauge", f"{p}slo_info{{{labels}}} 1",
                      f"# HELP {p}request_slo_total Finished requests (not aborted) that met "
                      "or missed the SLO.", f"# TYPE {p}request_slo_total counter"]
            lines += [f'{p}request_slo_total{{result="{k}"}} {v}'
                      for k, v in self.slo_results.items()]
            lines += [f"# HELP {p}requests_shed_total Requests SLO-aware admission answered "
                      "with 503 and Retry-After: refused at arrival, or ended while waiting "
                      "(--admission slo).", f"# TYPE {p}requests_shed_total counter"]
            lines += [f'{p}requests_shed_total{{when="{k}"}} {v}' for k, v in self.shed.items()]
            for name, value in (("prompt_tokens_total", self.prompt_tokens),
                                ("generation_tokens_total", self.generation_tokens)):
                lines += [f"# HELP {p}{name} Tokens of finished requests.",
                          f"# TYPE {p}{name} counter", f"{p}{name} {value}"]
            for h in (self.ttft, self.tpot, self.e2el):
                lines += h.render()
        return "\n".join(lines) + "\n"


def parse_gauges(text: str) -> dict[str, float]:
    """Unlabelled samples of an exposition text, by name (the benchmark reads the SM split)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        name, _, value = line.partition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out
