"""SLOs and goodput: the one parser, per-request attainment, and goodput over hand-built runs
with known misses (simulated requests, benchmark records, engine metrics)."""

from __future__ import annotations

import pytest

from spaceserve.runtime.core.request import RequestMetrics
from spaceserve.runtime.policy.slo import (
    DEFAULT_SLO,
    DEFAULT_SLO_TEXT,
    RequestLatency,
    Slo,
    goodput,
    p99,
)
from spaceserve.runtime.sim.metrics import image_goodput, latency, request_record
from spaceserve.runtime.sim.workload import Request


def test_parse_any_subset_and_round_trip() -> None:
    slo = Slo.parse("ttft:2000,tpot:50,itl:21,e2el:9000")
    assert (slo.ttft, slo.tpot, slo.itl, slo.e2el) == (2000.0, 50.0, 21.0, 9000.0)
    assert Slo.parse(" itl:21.5 , ttft:2000 ") == Slo(ttft=2000, itl=21.5)
    assert str(Slo.parse("e2el:5000,ttft:300")) == "ttft:300,e2el:5000"
    assert Slo.parse(str(slo)) == slo and Slo.of(slo.to_dict()) == slo
    assert slo.to_dict() == {"ttft": 2000.0, "tpot": 50.0, "itl": 21.0, "e2el": 9000.0}
    assert DEFAULT_SLO == Slo.parse(DEFAULT_SLO_TEXT) == Slo(ttft=2000, tpot=50)
    assert Slo.of(None) is DEFAULT_SLO and Slo.of("itl:21") == Slo(itl=21)


@pytest.mark.parametrize("text, named", [
    ("ttft", "'ttft'"), ("ttfb:100", "'ttfb:100'"), ("ttft:fast", "'fast'"),
    ("ttft:0", "positive"), ("tpot:-5", "positive"), ("itl:inf", "positive"),
    ("ttft:1,ttft:2", "given twice"), ("", "bounds nothing"), (",", "bounds nothing"),
    ("itl:nan", "positive"),
])
def test_bad_slo_names_the_entry(text, named) -> None:
    with pytest.raises(ValueError) as exc:
        Slo.parse(text)
    assert named in str(exc.value)


def test_bad_slo_objects() -> None:
    with pytest.raises(ValueError, match="must be a string"):
        Slo.parse(50)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown metrics"):
        Slo.of({"ttft": 1.0, "p50": 2.0})
    with pytest.raises(ValueError, match="tpot"):
        Slo(tpot=0)


def test_meets_each_bound() -> None:
    # 5 tokens: first at 0.5 s, gaps 40, 40, 40, 180 ms -> TPOT 75 ms, p99 ITL 175.8 ms
    lat = RequestLatency.from_token_times(0.0, [0.5, 0.54, 0.58, 0.62, 0.80], 0.80)
    assert lat.ttft == pytest.approx(0.5) and lat.e2el == pytest.approx(0.8)
    assert lat.tpot == pytest.approx(0.075) and lat.itl == pytest.approx(0.1758)
    assert Slo(ttft=600, tpot=80).meets(lat)
    assert Slo(ttft=400).misses(lat) == ("ttft",)
    assert Slo(tpot=50, itl=200).misses(lat) == ("tpot",)
    assert Slo(tpot=80, itl=100).misses(lat) == ("itl",)  # the mean is fine, the stall is not
    assert Slo(e2el=799).misses(lat) == ("e2el",)
    assert Slo(ttft=500, e2el=800).meets(lat)  # bounds are inclusive
    one = RequestLatency.from_times(1.0, 1.2, 1.2, [])  # one token: no TPOT or ITL to miss
    assert one.tpot is None and one.itl is None and Slo(tpot=1, itl=1, ttft=300).meets(one)
    assert not DEFAULT_SLO.meets(None) and DEFAULT_SLO.misses(None) == ("ttft", "tpot")
    assert RequestLatency.from_times(0.0, None, None) is None
    assert p99([]) is None and p99([3.0]) == 3.0


def test_engine_metrics_give_the_same_latencies() -> None:
    m = RequestMetrics(10.0, 10.3, (10.3, 10.35, 10.4), 10.4)
    lat = RequestLatency.from_metrics(m)
    want = RequestLatency(0.3, 0.05, 0.05, 0.4)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert getattr(lat, name) == pytest.approx(getattr(want, name)), name
    assert DEFAULT_SLO.meets(lat) and not Slo(tpot=40).meets(lat)
    assert RequestLatency.from_metrics(RequestMetrics(1.0, None, (), None)) is None


def _req(rid, arrival, first, gaps, kind="image") -> Request:
    r = Request(rid, arrival, 256 if kind == "image" else 0, 16, len(gaps) + 1, kind)
    if first is not None:
        r.first_token = first
        r.itls = list(gaps)
        r.generated = len(gaps) + 1
        r.finish = first + sum(gaps)
        r.last_token = r.finish
    return r


def test_goodput_of_a_hand_built_run_with_known_misses() -> None:
    """Ten image requests in a 5 s window: 6 meet ttft:2000,tpot:50; the others miss TTFT,
    TPOT, by never finishing, or by an unfinished first token. A text request and one that
    arrived after the window do not count; an empty run has rate 0, attainment 1."""
    ok = [0.03] * 9
    reqs = [
        _req(0, 0.0, 0.5, ok), _req(1, 0.5, 1.0, ok), _req(2, 1.0, 2.9, ok),  # 2: TTFT 1.9 s
        _req(3, 1.5, 1.7, [0.03] * 8 + [0.1]),  # TPOT (0.24 + 0.1) / 9 = 37.8 ms: meets
        _req(4, 2.0, 4.1, ok),  # TTFT 2.1 s: miss
        _req(5, 2.5, 2.6, [0.06] * 9),  # TPOT 60 ms: miss
        _req(6, 3.0, None, ok),  # unfinished when the run ended: miss
        _req(7, 3.5, 3.6, ok), _req(8, 4.0, 4.2, ok),
        _req(9, 4.5, None, ok),  # miss
        _req(10, 1.0, 9.9, ok, kind="text"),  # not an image request
        _req(11, 5.0, 5.1, ok),  # arrived after the window
    ]
    reqs[6].first_token = 3.2  # first token, then the run ended mid-decode
    g = image_goodput(reqs, DEFAULT_SLO, 5.0)
    assert (g.met, g.counted) == (6, 10)
    assert g.rate_per_s == pytest.approx(6 / 5.0) and g.attainment == pytest.approx(0.6)
    assert g.to_dict() == {"slo": {"ttft": 2000.0, "tpot": 50.0}, "rate_per_s": 1.2,
                           "attainment": 0.6, "met": 6, "counted": 10, "window_s": 5.0}
    strict = image_goodput(reqs, Slo(ttft=2000, itl=40), 5.0)  # 3's 100 ms gap now misses
    assert (strict.met, strict.counted) == (5, 10)
    assert latency(reqs[6]) is None and latency(reqs[9]) is None
    rec = request_record(reqs[6], DEFAULT_SLO)
    assert rec["finished"] is False and rec["e2el"] is None and rec["slo_met"] is False
    assert request_record(reqs[0], DEFAULT_SLO)["slo_met"] is True
    empty = goodput([], DEFAULT_SLO, 5.0)
    assert (empty.rate_per_s, empty.attainment, empty.counted) == (0.0, 1.0, 0)
    with pytest.raises(ValueError, match="window_s"):
        goodput([], DEFAULT_SLO, 0.0)
