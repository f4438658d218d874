"""/metrics of a replica set: the single server's series as totals, then per replica.

`ReplicaSetMetrics` is a `ServerMetrics` (so everything the HTTP layer records lands in the
totals exactly as on one server) that also keeps a `ServerMetrics` per replica label, fed with
the outputs that replica produced. `render` renders the totals and each replica's metrics with
the single server's renderer, and merges them family by family: each family's unlabelled
(total) samples first, then the same samples labelled ``replica="0"``, ``replica="1"``, ... (the
text format wants a family's samples together). Gauges come from each replica's own report;
counters and histograms are observed here. A few families exist only here: replicas running,
requests retried on another replica, requests a replica failure cut short, and an info series
per replica (its Ray replica id, process and node).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from spaceserve.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from spaceserve.runtime.core.request import RequestOutput

Gauge = tuple[str, str, float]


def with_label(sample: str, name: str, value: str) -> str:
    """A sample line with ``name="value"`` put first among its labels."""
    head, _, rest = sample.partition(" ")
    label = f'{name}="{value}"'
    if head.endswith("}"):
        metric, _, labels = head[:-1].partition("{")
        head = f"{metric}{{{label},{labels}}}" if labels else f"{metric}{{{label}}}"
    else:
        head = f"{head}{{{label}}}"
    return f"{head} {rest}"


def families(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """family name -> (HELP/TYPE lines, sample lines) of an exposition text, in order."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = parts[2]
                out.setdefault(current, ([], []))[0].append(line)
            continue
        if current is None:
            current = line.split("{", 1)[0].split(" ", 1)[0]
            out.setdefault(current, ([], []))
        out[current][1].append(line)
    return out


def merge(total: str, per_replica: dict[str, str], label: str = "replica") -> str:
    """`total`'s families, each followed by the same family's samples of every replica text
    labelled `label`; families only a replica has come after, with their headers."""
    fams = families(total)
    for value, text in per_replica.items():
        for name, (heads, samples) in families(text).items():
            target = fams.setdefault(name, (list(heads), []))
            target[1].extend(with_label(s, label, value) for s in samples)
    lines = [line for heads, samples in fams.values() for line in (*heads, *samples)]
    return "\n".join(lines) + "\n"


class ReplicaSetMetrics(ServerMetrics):
    """Totals (this object) plus one `ServerMetrics` per replica label.

    `replica_gauges()` gives each live replica's gauges by label; `replica_info()` each live
    replica's identifying labels (replica id, pid, node); `replica_counters()` each live
    replica's engine counters (encoder and prefix cache, encoder jobs, prefill tokens)."""

    def __init__(self, replica_gauges: Callable[[], dict[str, Sequence[Gauge]]] = dict,
                 replica_info: Callable[[], dict[str, dict[str, str]]] = dict,
                 replica_counters: Callable[[], dict[str, Sequence[Gauge]]] | None = None
                 ) -> None:
        super().__init__()
        self.replica_gauges, self.replica_info = replica_gauges, replica_info
        self.replica_counters = replica_counters or dict
        self.per: dict[str, ServerMetrics] = {}
        self.retried = 0
        self.failures: dict[str, int] = {}
        self._plock = threading.Lock()

    def replica(self, label: str) -> ServerMetrics:
        with self._plock:
            m = self.per.get(label)
            if m is None:
                m = self.per[label] = ServerMetrics()
            return m

    def observe(self, out: RequestOutput, replica: str | None = None) -> None:
        """A finished request, in the totals and (when known) under the replica that ran it."""
        super().observe(out)
        if replica is not None:
            self.replica(replica).observe(out)

    def replica_failed(self, replica: str) -> None:
        with self._plock:
            self.failures[replica] = self.failures.get(replica, 0) + 1

    def request_retried(self) -> None:
        with self._plock:
            self.retried += 1

    def render(self, gauges: Iterable[Gauge], counters: Iterable[Gauge] = ()) -> str:
        """Totals (`gauges` and the engines' `counters` summed), then every replica's own."""
        gauges = list(gauges)
        per_gauges, per_counters = self.replica_gauges(), self.replica_counters()
        labels = sorted(set(per_gauges) | set(self.per), key=_label_order)
        per = {lab: self.replica(lab).render(per_gauges.get(lab, ()), per_counters.get(lab, ()))
               for lab in labels}
        text = merge(super().render(gauges, counters), per)
        p = self.PREFIX
        lines = [f"# HELP {p}replica_info A replica behind this endpoint (value 1).",
                 f"# TYPE {p}replica_info gauge"]
        for lab, info in sorted(self.replica_info().items(), key=lambda kv: _label_order(kv[0])):
            extra = "".join(f',{k}="{_escape(v)}"' for k, v in sorted(info.items()))
            lines.append(f'{p}replica_info{{replica="{lab}"{extra}}} 1')
        with self._plock:
            lines += [f"# HELP {p}request_retries_total Requests sent to a second replica after "
                      "the first failed before answering.",
                      f"# TYPE {p}request_retries_total counter",
                      f"{p}request_retries_total {self.retried}",
                      f"# HELP {p}replica_failures_total Requests cut short by a replica "
                      "failure, by the replica that failed.",
                      f"# TYPE {p}replica_failures_total counter"]
            lines += [f'{p}replica_failures_total{{replica="{k}"}} {v}'
                      for k, v in sorted(self.failures.items(), key=lambda kv: _label_order(
                          kv[0]))]
        return text + "\n".join(lines) + "\n"


def _label_order(label: str) -> tuple[int, str]:
    return (int(label), "") if label.isdigit() else (1 << 30, label)


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
