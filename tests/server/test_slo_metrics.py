"""The server judges finished requests by the engine's SLO: /metrics counts met and missed,
`spaceserve serve --slo` takes the one syntax and refuses a bad one before loading anything."""

from __future__ import annotations

from spaceserve.runtime.core.request import RequestMetrics, RequestOutput
from spaceserve.runtime.policy.slo import Slo
from spaceserve.server.app import build_parser, main
from spaceserve.server.metrics import ServerMetrics


def _out(reason: str, first: float | None, times: tuple[float, ...]) -> RequestOutput:
    m = RequestMetrics(0.0, first, times, times[-1] if times else 0.5)
    n = len(times)
    return RequestOutput("r", [1, 2], list(range(n)), [], True, reason, None, m)


def test_metrics_count_slo_met_and_missed() -> None:
    metrics = ServerMetrics(Slo(ttft=100, tpot=50))
    metrics.observe(_out("length", 0.05, (0.05, 0.09, 0.13)))  # TTFT 50 ms, TPOT 40 ms: met
    metrics.observe(_out("stop", 0.2, (0.2, 0.21)))  # TTFT 200 ms: missed
    metrics.observe(_out("length", 0.05, (0.05, 0.15, 0.25)))  # TPOT 100 ms: missed
    metrics.observe(_out("error", None, ()))  # failed: missed
    metrics.observe(_out("abort", 0.01, (0.01,)))  # the client went away: not judged
    assert metrics.slo_results == {"met": 1, "missed": 3}
    text = metrics.render([])
    assert 'spaceserve:request_slo_total{result="met"} 1' in text
    assert 'spaceserve:request_slo_total{result="missed"} 3' in text
    assert 'spaceserve:slo_info{ttft_ms="100",tpot_ms="50"} 1' in text


def test_serve_accepts_the_slo_syntax_and_refuses_a_bad_one(capsys) -> None:
    args = build_parser().parse_args(["--slo", "ttft:2000,itl:21", "--mode", "temporal-chunked",
                                      "--encoder-window-ms", "10"])
    assert Slo.parse(args.slo) == Slo(ttft=2000, itl=21) and args.encoder_window_ms == 10
    assert build_parser().parse_args([]).slo == "ttft:2000,tpot:50"
    assert main(["--slo", "ttft:fast"]) == 2
    assert "slo='ttft:fast'" in capsys.readouterr().err
