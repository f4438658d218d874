"""The serving benchmark: metrics from synthetic timestamps (vLLM's definitions), goodput,
arrival processes, and short end-to-end runs in-process and over HTTP."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from spaceserve.bench.metrics import Result, latency, summarize_results, to_record
from spaceserve.bench.workload import ServeWorkload, build_requests, parse_mix
from spaceserve.runtime.policy.slo import Slo, goodput


def result(idx: int, send: float, times: list[float], kind: str = "image") -> Result:
    return Result(idx, kind, "112x112", send, first_token=times[0], token_times=list(times),
                  finish=times[-1], prompt_tokens=10, output_tokens=len(times))


def test_ttft_tpot_itl_e2el_follow_vllm_definitions() -> None:
    # first token after 1.0 s (slow), then three 0.1 s steps: TPOT excludes the first token
    r = result(0, 0.0, [1.0, 1.1, 1.2, 1.3])
    rec = to_record(r, t0=0.0)
    assert rec.ttft == 1.0 and rec.e2el == pytest.approx(1.3)
    assert rec.tpot == pytest.approx(0.1)
    assert rec.itls == pytest.approx([0.1, 0.1, 0.1])
    m = summarize_results([r], None, t0=0.0)["load"]
    assert m["mean_ttft_ms"] == pytest.approx(1000.0) and m["mean_tpot_ms"] == pytest.approx(100)
    assert m["p99_itl_ms"] == pytest.approx(100.0) and m["mean_e2el_ms"] == pytest.approx(1300)
    assert m["completed"] == 1 and m["total_output_tokens"] == 4


def test_one_token_requests_have_no_tpot_and_failures_count_apart() -> None:
    ok = result(0, 0.0, [0.2])
    bad = Result(1, "text", "", 0.1, error="HTTP 400: no")
    s = summarize_results([ok, bad], Slo(tpot=1.0), t0=0.0, duration=2.0)
    assert s["failed"] == 1 and s["errors"] == ["HTTP 400: no"]
    assert s["load"]["completed"] == 1 and math.isnan(s["load"]["mean_tpot_ms"])
    assert s["load"]["request_throughput"] == 0.5
    assert s["load"]["request_goodput"] == 0.5  # nothing to miss: meets the TPOT SLO


def test_goodput_counts_only_requests_meeting_every_slo() -> None:
    rs = [result(0, 0.0, [0.1, 0.15, 0.2]),  # meets both (TTFT 100 ms, TPOT 50 ms)
          result(1, 0.0, [0.9, 0.95, 1.0]),  # TTFT 900 ms: misses
          result(2, 0.0, [0.1, 0.5, 0.9]),  # TPOT 400 ms: misses
          result(3, 0.0, [0.2, 0.25, 0.3], kind="probe"),  # probes apart
          result(4, 0.5, [0.6, 0.65, 0.7], kind="text"),  # meets; a text request
          Result(5, "image", "112x112", 1.0, error="HTTP 500: boom")]  # failed: a miss
    slo = Slo.parse("ttft:500,tpot:100")
    s = summarize_results(rs, slo, t0=0.0, duration=4.0, window_s=2.0, unsent_images=1)
    assert s["load"]["request_goodput"] == pytest.approx(2 / 4)
    assert s["probe"]["request_goodput"] == pytest.approx(1 / 4)
    assert s["load"]["completed"] == 4 and s["probe"]["completed"] == 1
    # image goodput: 1 of 5 image requests of the 2 s window (one failed, one never sent)
    assert s["goodput"] == {"slo": {"ttft": 500.0, "tpot": 100.0}, "rate_per_s": 0.5,
                            "attainment": 0.2, "met": 1, "counted": 5, "window_s": 2.0}
    lats = [latency(to_record(r, 0.0)) for r in rs[:3]]
    assert goodput(lats, Slo(ttft=1000), 1.0).rate_per_s == 3.0
    assert goodput(lats, Slo(ttft=1000, e2el=950), 1.0).rate_per_s == 2.0
    assert goodput(lats, Slo(itl=300), 1.0).met == 2  # 2's gaps are 400 ms


@pytest.mark.parametrize("burstiness,cv", [(1.0, 1.0), (0.25, 2.0)])
def test_arrivals_match_the_requested_process(burstiness, cv) -> None:
    w = ServeWorkload(request_rate=40.0, duration_s=50.0, burstiness=burstiness,
                      image_mix={"112x112": 0.5, "224x224": 0.3, "text": 0.2}, seed=3)
    reqs = build_requests(w)
    n = len(reqs)  # mean 2000; sd ~ sqrt(2000 / burstiness)
    assert abs(n - 2000) < 4 * math.sqrt(2000 / burstiness)
    gaps = [b.arrival - a.arrival for a, b in zip(reqs, reqs[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 40, rel=0.12)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.15)
    share = {k: sum(r.kind == "text" if k == "text" else r.resolution == k for r in reqs) / n
             for k in w.image_mix}
    for k, weight in w.image_mix.items():
        assert share[k] == pytest.approx(weight, abs=0.04)
    assert all(0 <= r.arrival < 50.0 for r in reqs)


def test_arrivals_are_seeded_and_probes_leave_the_load_alone() -> None:
    w = ServeWorkload(request_rate=5.0, duration_s=20.0, seed=7)
    assert build_requests(w) == build_requests(ServeWorkload(request_rate=5.0,
                                                             duration_s=20.0, seed=7))
    assert build_requests(w) != build_requests(ServeWorkload(request_rate=5.0,
                                                             duration_s=20.0, seed=8))
    probed = build_requests(ServeWorkload(request_rate=5.0, duration_s=20.0, seed=7,
                                          probe_rate=3.0))
    load = [(r.arrival, r.kind, r.resolution, r.prompt) for r in probed if r.kind != "probe"]
    assert load == [(r.arrival, r.kind, r.resolution, r.prompt) for r in build_requests(w)]
    probes = [r for r in probed if r.kind == "probe"]
    assert 30 < len(probes) < 95 and all(r.max_tokens == 8 for r in probes)


def test_bad_specs_raise_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_mix("112x=1")
    with pytest.raises(ValueError, match="NAME=WEIGHT"):
        parse_mix("112x112")
    with pytest.raises(ValueError, match="image_mix"):
        parse_mix("112x112=0,text=0")
    with pytest.raises(ValueError, match="burstiness"):
        ServeWorkload(request_rate=1.0, duration_s=1.0, burstiness=0)
    with pytest.raises(ValueError, match="duration_s"):
        ServeWorkload(request_rate=1.0, duration_s=0)


def test_bench_inprocess_end_to_end(tiny_path, tmp_path, capsys, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    from spaceserve.bench.serve import main

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    out = tmp_path / "run"
    rc = main(["--model", str(tiny_path), "--modes", "spatial,temporal-chunked", "--rates", "6",
               "--duration", "1", "--probe-rate", "3", "--output-len", "6",
               "--image-mix", "112x112=0.5,224x224=0.3,text=0.2", "--device", "cpu",
               "--num-kv-blocks", "256", "--out", str(out), "--show", "2"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT" in text and "TPOT" in text and "sample outputs" in text
    # the header names device, model and modes; a CPU run says what it proves, and what a
    # GPU would do is modelled, labelled so, per mode
    assert f"{tiny_path} on CPU" in text and "modes spatial, temporal-chunked" in text
    assert "proves correctness and plumbing" in text and "MODELLED (not measured)" in text
    doc = json.loads((out / "results.json").read_text())
    assert [r["mode"] for r in doc["runs"]] == ["spatial", "temporal-chunked"]
    assert doc["device"].startswith("CPU")
    pred = doc["modelled"]
    assert pred["device"] == "H200" and [r["mode"] for r in pred["rows"]] == \
        ["spatial", "temporal-chunked"]
    assert all(r["goodput"]["slo"] == {"ttft": 2000.0, "tpot": 50.0} for r in pred["rows"])
    for run in doc["runs"]:
        load = run["metrics"]["load"]
        assert run["metrics"]["failed"] == 0 and load["completed"] >= 1
        assert load["mean_ttft_ms"] > 0 and load["total_output_tokens"] == 6 * load["completed"]
        assert run["timeline"] and {"encoder_sms", "decoder_sms"} <= set(run["timeline"][0])
        kinds = {r["kind"] for r in run["requests"]}
        assert kinds <= {"image", "text", "probe"} and "probe" in kinds
        g = run["metrics"]["goodput"]
        images = [r for r in run["requests"] if r["kind"] == "image"]
        assert g["counted"] == len(images) and g["met"] == sum(r["slo_met"] for r in images)
        assert g["rate_per_s"] == pytest.approx(g["met"] / 1.0)
    assert (out / "latency_vs_rate.png").stat().st_size > 0
    assert (out / "sm_split_timeline.png").stat().st_size > 0
    # both figures name the model and the CPU, and say what a CPU run proves
    assert len(figures) == 2
    for fig in figures:
        head = " ".join(fig._suptitle.get_text().split())
        assert f"{tiny_path} on CPU" in head and "modes spatial, temporal-chunked" in head
        notes = " ".join(t.get_text() for t in fig.texts)
        assert "ran on a CPU: this proves plumbing, not performance" in notes, notes


def test_bench_over_http_matches_the_server(live_tiny, tmp_path) -> None:
    from spaceserve.bench.serve import main

    client, server = live_tiny
    before = client.metrics.finished.get("length", 0)
    out = tmp_path / "http"
    rc = main(["--backend", "http", "--base-url", server.url, "--served-model", "tiny-test",
               "--label", "live", "--rates", "5", "--duration", "1", "--probe-rate", "0",
               "--output-len", "5", "--image-mix", "112x112=0.6,224x224=0.2,text=0.2",
               "--out", str(out), "--no-plot"])
    assert rc == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["label"] == "live" and run["metrics"]["failed"] == 0
    done = run["metrics"]["load"]["completed"]
    assert done == run["num_requests"] >= 1
    assert run["metrics"]["load"]["total_output_tokens"] == 5 * done  # from usage chunks
    assert client.metrics.finished.get("length", 0) - before == done
    assert run["timeline"] and run["timeline"][0]["encoder_sms"] > 0  # scraped from /metrics


def test_bench_over_http_on_the_completions_endpoint(live_tiny, tmp_path) -> None:
    from spaceserve.bench.serve import main

    client, server = live_tiny
    out = tmp_path / "cmpl"
    rc = main(["--backend", "http", "--base-url", server.url, "--served-model", "tiny-test",
               "--endpoint", "/v1/completions", "--rates", "5", "--duration", "1",
               "--probe-rate", "2", "--output-len", "4", "--image-mix", "text=1",
               "--out", str(out), "--no-plot"])
    assert rc == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["metrics"]["failed"] == 0
    done = run["metrics"]["load"]["completed"]
    assert done >= 1 and run["metrics"]["load"]["total_output_tokens"] == 4 * done
    assert all(r["output_tokens"] in (4, 8) for r in run["requests"])


def test_completions_endpoint_needs_a_text_mix(capsys) -> None:
    from spaceserve.bench.serve import main

    assert main(["--endpoint", "/v1/completions", "--image-mix", "112x112=1,text=1"]) == 2
    assert "text prompts only" in capsys.readouterr().err
    assert main(["--endpoint", "/v1/embeddings"]) == 2
    assert "--endpoint" in capsys.readouterr().err


def test_bench_fails_fast_against_an_unreachable_server(tmp_path, capsys) -> None:
    import time

    from spaceserve.bench.serve import main

    t0 = time.monotonic()
    rc = main(["--backend", "http", "--base-url", "http://127.0.0.1:9", "--duration", "30",
               "--out", str(tmp_path / "never")])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot reach the server at http://127.0.0.1:9" in err
    assert "Connect" in err and time.monotonic() - t0 < 15  # the connection error itself
    assert not (tmp_path / "never").exists()


def test_http_client_against_a_server_of_known_timing(tmp_path) -> None:
    """The aiohttp client against bench/serving/sse_stub.py: every token and the usage counted, TTFT
    and E2EL never below what the stub guarantees; and the aiperf trace the comparison script
    writes holds the benchmark's own requests."""
    import asyncio
    import socket
    import subprocess
    import sys

    from bench.serving.compare_aiperf import write_trace
    from spaceserve.bench.backends import HttpBackend
    from spaceserve.bench.schedule import run_one

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stub = subprocess.Popen([sys.executable, "-m", "bench.serving.sse_stub", "--port", str(port),
                             "--ttft-ms", "30", "--itl-ms", "2"])
    w = ServeWorkload(request_rate=20.0, duration_s=0.5, image_mix={"112x112": 1.0},
                      output_len=6, seed=2)

    async def go():
        backend = HttpBackend(f"http://127.0.0.1:{port}", "tiny")
        for _ in range(200):  # the stub is starting
            try:
                await backend.info(timeout=1.0)
                break
            except Exception:
                await asyncio.sleep(0.05)
        try:
            return await run_one(backend, w, "tiny", Slo(ttft=2000), drain_s=5.0)
        finally:
            await backend.close()

    try:
        run = asyncio.run(go())
    finally:
        stub.terminate()
        stub.wait(timeout=10)
    assert run["metrics"]["failed"] == 0 and run["num_requests"] == len(build_requests(w)) > 3
    for r in run["results"]:
        assert r.output_tokens == 6 and len(r.token_times) == 6 and r.prompt_tokens == 50
        assert r.first_token - r.send >= 0.030 and r.finish - r.send >= 0.030 + 5 * 0.002
    n = write_trace(w, tmp_path / "trace.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    reqs = build_requests(w)
    assert n == len(lines) == len(reqs)
    assert [x["timestamp"] for x in lines] == [round(r.arrival * 1e3, 3) for r in reqs]
    assert [x["text"] for x in lines] == [r.prompt for r in reqs]
    assert all(x["image"].startswith("data:image/png;base64,") and x["output_length"] == 6
               for x in lines)
