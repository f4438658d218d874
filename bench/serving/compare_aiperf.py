"""`spaceserve bench serve --backend http` against aiperf on the same server and load.

Both clients send the same requests at the same instants to one `spaceserve serve` (the tiny
model unless --base-url names a running server): the benchmark's Poisson load at --rate
requests/s, each request one 112x112 image plus text, --output-len tokens, greedy, ignore_eos;
aiperf replays exactly those requests (prompt, image, arrival offset) from a single-turn trace
with its fixed schedule. Each client scrapes /metrics as it does by default. The two alternate
--rounds times (a round = one seed; who goes first alternates), so the slow drift of a shared
machine hits both. Reported: per client the median over rounds of
its mean TTFT, TPOT and E2EL (aiperf: time to first token, inter-token latency = (latency -
TTFT) / (output - 1), request latency) and the ratio benchmark / aiperf, which should stay
within 10% (exit 1 otherwise). Around each client run the script reads the server's own
latency histograms (engine timestamps): how fast the server itself was meanwhile, so a shared
machine's drift shows as what it is, and each client's own time (client - server). aiperf is
optional (not in CI): install it in its own environment, e.g.

    python3 -m venv ~/venvs/aiperf && ~/venvs/aiperf/bin/pip install aiperf
    python -m bench.serving.compare_aiperf --aiperf ~/venvs/aiperf/bin/aiperf --out runs/aiperf

`--base-url` may also name `python -m bench.serving.sse_stub`, a server whose timing is known
exactly: there the difference between the clients is their own overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from spaceserve.bench.workload import ServeWorkload, build_requests

METRICS = (("ttft", "mean_ttft_ms", "time_to_first_token"),
           ("tpot", "mean_tpot_ms", "inter_token_latency"),
           ("e2el", "mean_e2el_ms", "request_latency"))
# the server's own histograms of the same quantities (engine timestamps), by metric
SERVER = {"ttft": "time_to_first_token_seconds", "tpot": "time_per_output_token_seconds",
          "e2el": "e2e_request_latency_seconds"}


def server_sums(base_url: str) -> dict[str, tuple[float, float]] | None:
    """(sum, count) of the server's latency histograms; None when it has none (not SpaceServe)."""
    import httpx

    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    out = {}
    for metric, hist in SERVER.items():
        try:
            out[metric] = (float(values[f"spaceserve:{hist}_sum"]),
                           float(values[f"spaceserve:{hist}_count"]))
        except (KeyError, ValueError):
            return None
    return out


def measured(run, base_url: str, settle_s: float = 0.0) -> dict[str, float]:
    """A client's run (after `settle_s` of quiet), with what the server itself measured
    meanwhile (``server_<metric>``, ms): the engine's view, whose drift is the machine's, not
    the client's."""
    time.sleep(settle_s)
    before = server_sums(base_url)
    got = run()
    after = server_sums(base_url)
    if before and after:
        for metric in SERVER:
            (s0, n0), (s1, n1) = before[metric], after[metric]
            if n1 > n0:
                got[f"server_{metric}"] = 1e3 * (s1 - s0) / (n1 - n0)
    return got


def start_server(port: int, mode: str, log: Path, threads: int) -> subprocess.Popen:
    """`spaceserve serve --model tiny` on loopback; returns once /health answers. `threads`:
    torch's intra-op threads (a tiny model needs one; on a CPU shared with other work, more
    threads wait on each other whenever one is descheduled, which swamps the comparison)."""
    import httpx

    cmd = [sys.executable, "-m", "spaceserve.cli", "serve", "--model", "tiny", "--port",
           str(port), "--mode", mode, "--log-level", "warning"]
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not start within 300 s")


def workload(args: argparse.Namespace, seed: int) -> ServeWorkload:
    return ServeWorkload(request_rate=args.rate, duration_s=args.requests / args.rate,
                         image_mix={"112x112": 1.0}, probe_rate=0.0,
                         output_len=args.output_len, seed=seed)


def write_trace(w: ServeWorkload, path: Path) -> int:
    """The workload's requests as an aiperf single-turn trace (ms offsets); returns the count."""
    from spaceserve.bench.backends import chat_body

    lines = []
    for r in build_requests(w):
        content = chat_body(r, "unused")["messages"][0]["content"]
        image = next(c["image_url"]["url"] for c in content if c["type"] == "image_url")
        lines.append(json.dumps({"timestamp": round(r.arrival * 1e3, 3), "text": r.prompt,
                                 "image": image, "output_length": r.max_tokens}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def run_bench(args: argparse.Namespace, seed: int, out: Path) -> dict[str, float]:
    w = workload(args, seed)
    cmd = [sys.executable, "-m", "spaceserve.cli", "bench", "serve", "--backend", "http",
           "--base-url", args.base_url, "--served-model", args.model, "--rates", str(args.rate),
           "--duration", str(w.duration_s), "--image-mix", "112x112=1", "--probe-rate", "0",
           "--output-len", str(args.output_len), "--seed", str(seed), "--out", str(out),
           "--no-plot", "--show", "0", *args.bench_args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    run = json.loads((out / "results.json").read_text())["runs"][0]
    load = run["metrics"]["load"]
    prompt = [r["prompt_tokens"] for r in run["requests"] if r["prompt_tokens"]]
    return {name: load[key] for name, key, _ in METRICS} | {
        "requests": load["completed"], "prompt_tokens": statistics.median(prompt)}


def run_aiperf(args: argparse.Namespace, seed: int, out: Path) -> dict[str, float]:
    trace = out / "trace.jsonl"
    count = write_trace(workload(args, seed), trace)
    cmd = [args.aiperf, "profile", "--model", args.model, "--url", args.base_url,
           "--endpoint-type", "chat", "--streaming", "--tokenizer", args.tokenizer,
           "--input-file", str(trace), "--custom-dataset-type", "single_turn",
           "--fixed-schedule", "--request-count", str(count), "--extra-inputs",
           "ignore_eos:true", "--extra-inputs", "temperature:0.0", "--use-server-token-count",
           "--random-seed", str(seed), "--output-artifact-dir", str(out), "--no-auto-plot",
           "--ui-type", "none"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    return {name: doc[key]["avg"] for name, _, key in METRICS} | {
        "requests": doc["request_count"]["avg"],
        "prompt_tokens": doc["input_sequence_length"]["p50"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serving.compare_aiperf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf",
                   help="the aiperf executable")
    p.add_argument("--base-url", help="a running server (default: start spaceserve serve tiny)")
    p.add_argument("--model", default="tiny", help="the served model name")
    p.add_argument("--tokenizer", help="aiperf's tokenizer (default: the tiny checkpoint's)")
    p.add_argument("--mode", default="temporal", help="engine mode of the started server")
    p.add_argument("--port", type=int, default=0, help="of the started server (0: a free one)")
    p.add_argument("--threads", type=int, default=1, help="the started server's torch threads")
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--requests", type=int, default=60, help="about this many per run")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle", type=float, default=5.0, help="seconds of quiet before a run")
    p.add_argument("--out", type=Path, default=Path("runs/aiperf-compare"))
    p.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[],
                   help="extra `bench serve` arguments (last on the line)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if shutil.which(args.aiperf) is None and not os.access(args.aiperf, os.X_OK):
        print(f"aiperf not found ({args.aiperf}); install it in its own environment",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    server = None
    if args.base_url is None:
        if not args.port:
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                args.port = sock.getsockname()[1]
        server = start_server(args.port, args.mode, args.out / "server.log", args.threads)
        args.base_url = f"http://127.0.0.1:{args.port}"
    if args.tokenizer is None:
        from spaceserve.models.tiny import resolve_model

        args.tokenizer = str(resolve_model("tiny"))
    try:
        # a fresh server's first requests pay one-off costs (first image decode, allocations):
        # a short unmeasured run first, then a pause before each measured run so the previous
        # client's processes (aiperf's services) have exited
        warm = argparse.Namespace(**(vars(args) | {"requests": max(4, int(args.rate * 3))}))
        run_bench(warm, 999, args.out / "warmup")
        rows = []
        for i in range(args.rounds):  # who goes first alternates, so drift hits both
            runs = [lambda i=i: run_bench(args, i, args.out / f"bench-{i}"),
                    lambda i=i: run_aiperf(args, i, args.out / f"aiperf-{i}")]
            got = [measured(f, args.base_url, args.settle)
                   for f in (runs if i % 2 == 0 else runs[::-1])]
            b, a = got if i % 2 == 0 else got[::-1]
            rows.append({"round": i, "bench": b, "aiperf": a})
            print(f"round {i}: " + "  ".join(
                f"{n} {b[n]:.1f}/{a[n]:.1f}" for n, _, _ in METRICS) +
                f"  (bench/aiperf ms; {b['requests']:g}/{a['requests']:g} requests, prompt "
                f"{b['prompt_tokens']:g}/{a['prompt_tokens']:g} tokens)", flush=True)
            if "server_tpot" in b and "server_tpot" in a:
                print("  the server itself meanwhile: " + "  ".join(
                    f"{n} {b['server_' + n]:.1f}/{a['server_' + n]:.1f}" for n in SERVER))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    summary = {}
    print(f"\nmedian of {args.rounds} rounds, mean per run (ms): metric, bench, aiperf, ratio")
    for name, _, _ in METRICS:
        b = statistics.median(r["bench"][name] for r in rows)
        a = statistics.median(r["aiperf"][name] for r in rows)
        summary[name] = {"bench_ms": b, "aiperf_ms": a, "ratio": b / a}
        verdict = "ok" if abs(b / a - 1) <= 0.10 else "OFF BY MORE THAN 10%"
        print(f"  {name:<5}{b:9.2f}{a:9.2f}{b / a:8.3f}  {verdict}")
    if all(f"server_{n}" in r[c] for r in rows for c in ("bench", "aiperf") for n in SERVER):
        print("each client's own time (client mean - server mean), median of rounds (ms):")
        for name in SERVER:
            own = {c: statistics.median(r[c][name] - r[c][f"server_{name}"] for r in rows)
                   for c in ("bench", "aiperf")}
            summary[name] |= {f"{c}_own_ms": v for c, v in own.items()}
            print(f"  {name:<5}{own['bench']:9.2f}{own['aiperf']:9.2f}")
    (args.out / "compare.json").write_text(json.dumps(
        {"config": {k: str(v) for k, v in vars(args).items()}, "rounds": rows,
         "summary": summary}, indent=1))
    print(f"wrote {args.out / 'compare.json'}")
    return 0 if all(abs(s["ratio"] - 1) <= 0.10 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
