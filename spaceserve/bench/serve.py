"""`spaceserve bench serve`: serving benchmark, in-process engine or a server over HTTP.

For each mode (in-process: an engine per mode; HTTP: the running server, labelled --label) and
each request rate, requests are sent on their arrival schedule (gamma / Poisson, an image-size
mix with text-only requests, probe requests beside the load), then TTFT, TPOT, ITL and E2EL
(mean / median / p99), throughput and goodput under the SLOs are reported for the load and the
probes apart, as `vllm bench serve` names them. Writes results.json (every run, every request,
the SM split timeline), latency_vs_rate.png and sm_split_timeline.png under --out, and prints
a table and a few outputs. A mode this engine build lacks runs as temporal and is labelled so.

Models: a checkpoint directory, ``tiny`` (the tiny random-weight Qwen2-VL), or a random-weight
model of real shapes with no checkpoint (``qwen2-vl-7b-random``, ``qwen2.5-vl-7b-random``;
prompts as token ids, `--llm-layers` cuts the LLM's depth to save time and is recorded).
`--sim` adds the simulator's prediction for the same requests, mode and SM splits beside each
in-process run (TPOT, p99 ITL, TTFT predicted against measured, with the relative error).

Default: the tiny random-weight Qwen2-VL, spatial against temporal, two rates, on whatever
device there is (a CPU finishes in about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from spaceserve.cli_args import HelpFormatter

from .backends import HttpBackend, InProcessBackend, chat_body
from .metrics import Result, parse_slos, summarize_results
from .plots import plot_timeline, plot_vs_rate
from .predict import predict_run
from .random_model import (
    RANDOM_MODELS,
    RandomModels,
    default_backend,
    is_random_model,
    random_config,
)
from .timeline import poll_split, thin_timeline
from .workload import ServeWorkload, build_requests, parse_mix

CUT = "unfinished at the time limit"


async def _collect(tasks: list[asyncio.Future], reqs: list[Any], t0: float,
                   deadline: float | None) -> list[Result]:
    """Every task's result; with a `deadline` (monotonic), the ones still running then are
    cancelled (their requests aborted) and count as failed."""
    if deadline is None or not tasks:
        return list(await asyncio.gather(*tasks))
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    return [Result(r.idx, r.kind, r.resolution, t0 + r.arrival, error=CUT) if t in pending
            else t.result() for r, t in zip(reqs, tasks, strict=False)]


async def run_one(backend: Any, workload: ServeWorkload, model: str, slos: dict[str, float],
                  client: Any = None, *, deadline: float | None = None) -> dict[str, Any]:
    """Send one workload on schedule; metrics, per-request results and the split timeline.

    `deadline` (time.monotonic()): requests due later are not sent (counted as "unsent"), and
    those unfinished then are aborted and fail with `CUT`, so a run ends in time."""
    reqs = build_requests(workload)
    make = getattr(backend, "body", None)
    # images encoded (or token prompts drawn) before the clock starts
    bodies = [make(r, model) if make is not None else chat_body(r, model) for r in reqs]
    t0 = time.monotonic()
    polled: list[dict[str, float]] = []
    poller = asyncio.ensure_future(poll_split(backend, polled, t0)) \
        if isinstance(backend, HttpBackend) else None
    tasks = []
    for r, body in zip(reqs, bodies, strict=True):
        if deadline is not None and t0 + r.arrival >= deadline:
            break
        delay = t0 + r.arrival - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(backend.send(r, body)))
    results = await _collect(tasks, reqs, t0, deadline)
    end = time.monotonic()
    if poller is not None:
        poller.cancel()
    if client is not None:
        polled = [{"t": s.time - t0, "encoder_sms": s.encoder_sms, "decoder_sms": s.decoder_sms}
                  for s in list(client.timeline) if t0 <= s.time <= end]
    return {"rate": workload.request_rate, "num_requests": len(tasks),
            "unsent": len(reqs) - len(tasks),
            "metrics": summarize_results(results, slos, t0, duration=end - t0),
            "timeline": thin_timeline(polled), "results": results, "t0": t0}


def _request_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    t0 = run["t0"]
    rows = []
    for r in run["results"]:
        row = {"idx": r.idx, "kind": r.kind, "resolution": r.resolution, "send": r.send - t0,
               "prompt_tokens": r.prompt_tokens, "image_tokens": r.image_tokens,
               "output_tokens": r.output_tokens, "error": r.error}
        if r.ok:
            row["ttft"] = r.first_token - r.send
            row["e2el"] = r.finish - r.send
            row["tpot"] = (r.finish - r.first_token) / (r.output_tokens - 1) \
                if r.output_tokens > 1 else None
        rows.append(row)
    return rows


def _fmt(x: Any, width: int = 8, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(width)
    return f"{x:{width}.{digits}f}"


HEADER = (f"{'mode':<28}{'rate':>6}{'done':>6}{'fail':>5}{'req/s':>7}{'tok/s':>8}"
          f"{'TTFT':>8}{'p99':>8}{'TPOT':>8}{'p99':>8}{'ITLp99':>8}{'E2EL':>8}{'good':>7}"
          f" |{'probe TTFT':>11}{'TPOT':>7}")


def _cells(label: str, rate: float, failed: Any, m: dict[str, Any], p: dict[str, Any]) -> str:
    return (f"{label:<28}{rate:>6g}{m['completed']:>6}{failed:>5}"
            f"{_fmt(m['request_throughput'], 7, 2)}{_fmt(m['output_throughput'], 8)}"
            f"{_fmt(m['mean_ttft_ms'])}{_fmt(m['p99_ttft_ms'])}{_fmt(m['mean_tpot_ms'])}"
            f"{_fmt(m['p99_tpot_ms'])}{_fmt(m['p99_itl_ms'])}{_fmt(m['mean_e2el_ms'])}"
            f"{_fmt(m.get('request_goodput'), 7, 2)} |{_fmt(p['mean_ttft_ms'], 11)}"
            f"{_fmt(p['mean_tpot_ms'], 7)}")


def table_row(run: dict[str, Any]) -> str:
    return _cells(run["label"], run["rate"], run["metrics"]["failed"], run["metrics"]["load"],
                  run["metrics"]["probe"])


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def sim_row(run: dict[str, Any]) -> str:
    """The simulator's prediction of a run in the table's columns, then its errors."""
    sim = run.get("sim") or {}
    if "load" not in sim:
        return f"{'  sim':<28}failed: {sim.get('error', 'no prediction')}"
    err = sim["errors"]["load"]
    return (_cells("  sim", run["rate"], "", sim["load"], sim["probe"]) +
            f"  err TPOT {_pct(err.get('tpot'))} ITLp99 {_pct(err.get('p99_itl'))} "
            f"TTFT {_pct(err.get('ttft'))}")


def _show(run: dict[str, Any], n: int) -> None:
    shown = [r for r in run["results"] if r.ok][:n]
    for r in shown:
        what = f"{r.kind} {r.resolution}".strip()
        print(f"  [{run['label']} #{r.idx} {what}, {r.prompt_tokens} prompt tokens] "
              f"{r.text[:70]!r}")


async def bench_engine(engine: Any, workloads: list[ServeWorkload], slos: dict[str, float], *,
                       mode: str, model: str, note: str | None = None, preprocessor: Any = None,
                       prompts: Any = None, sim: bool = False, warm: bool = True,
                       deadline: float | None = None, extra: dict[str, Any] | None = None
                       ) -> list[dict[str, Any]]:
    """Every workload on one engine in-process (a short warm-up first), one run dict each;
    closes the engine. Requests go through `preprocessor` (chat) or `prompts` (token ids).
    `deadline` (time.monotonic()): rates not started by then are left out, the running one is
    cut (see `run_one`). `sim`: the simulator's prediction in ``run["sim"]``."""
    from spaceserve.server.engine_client import AsyncEngine

    label = mode if note is None else f"{mode} (ran as temporal)"
    client = AsyncEngine(engine, max_pending=10_000, mode_note=note)
    runs: list[dict[str, Any]] = []
    try:
        backend = InProcessBackend(client, preprocessor, model, prompts=prompts)
        if warm:
            w = ServeWorkload(request_rate=50.0, duration_s=0.1, image_mix=workloads[0]
                              .image_mix, output_len=4, seed=12345)
            await run_one(backend, w, model, slos, deadline=deadline)
        for w in workloads:
            if deadline is not None and time.monotonic() >= deadline:
                break
            run = await run_one(backend, w, model, slos, client=client, deadline=deadline)
            run.update(label=label, mode=mode, ran_as=client.mode, note=note, **(extra or {}))
            print(table_row(run), flush=True)
            if sim:
                run["sim"] = predict_run(engine, run)
                print(sim_row(run), flush=True)
            runs.append(run)
    finally:
        client.close()
        engine.close()
    return runs


def _free_device() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


async def _run_inprocess(args: argparse.Namespace, workloads: list[ServeWorkload],
                         slos: dict[str, float]) -> list[dict[str, Any]]:
    import torch

    from spaceserve.server.engine_client import load_engine, resolve_mode

    run_modes = [resolve_mode(m)[0] for m in args.modes]  # unknown modes fail before building
    randoms = None
    if is_random_model(args.model):
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        backends = [args.attention_backend] if args.attention_backend else \
            [default_backend(m, device) for m in run_modes]
        randoms = RandomModels(args.model, llm_layers=args.llm_layers, backends=backends,
                               device=device, seed=args.seed,
                               tensor_parallel_size=args.tensor_parallel_size)
    cfg = dict(max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks, seed=args.seed,
               tensor_parallel_size=args.tensor_parallel_size)
    runs = []
    for mode in args.modes:
        pre = prompts = None
        extra: dict[str, Any] = {"model": args.model}
        if randoms is not None:
            engine, prompts, note = randoms.engine(mode, attention_backend=args.attention_backend,
                                                   **cfg)
            extra["llm_layers"] = randoms.llm_layers
        else:
            engine, pre, note = load_engine(args.model, mode=mode, device=args.device,
                                            attention_backend=args.attention_backend, **cfg)
        if note:
            print(f"note: {note}")
        runs += await bench_engine(engine, workloads, slos, mode=mode, model=args.model,
                                   note=note, preprocessor=pre, prompts=prompts, sim=args.sim,
                                   extra=extra)
        del engine
        _free_device()
    return runs


async def _run_http(args: argparse.Namespace, workloads: list[ServeWorkload],
                    slos: dict[str, float]) -> list[dict[str, Any]]:
    backend = HttpBackend(args.base_url, args.served_model or args.model)
    runs = []
    try:
        for w in workloads:
            run = await run_one(backend, w, backend.model, slos)
            run.update(label=args.label, mode=args.label, ran_as=None, note=None)
            runs.append(run)
            print(table_row(run), flush=True)
    finally:
        await backend.close()
    return runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spaceserve bench serve", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--backend", choices=("inprocess", "http"), default="inprocess",
                   help="where requests go: engines in this process, or a server over HTTP")
    p.add_argument("--model", default="tiny", help="checkpoint directory, 'tiny', or a "
                   f"random-weight model: {', '.join(RANDOM_MODELS)}")
    p.add_argument("--llm-layers", type=int,
                   help="random-weight models: LLM layers to keep (default: all)")
    p.add_argument("--sim", action="store_true",
                   help="in-process: add the simulator's prediction beside each run")
    p.add_argument("--modes", default="spatial,temporal", help="in-process engine modes")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="http backend")
    p.add_argument("--served-model",
                   help="http: the model name the server serves (default: --model)")
    p.add_argument("--label", default="server", help="http: the run's label in the outputs")
    p.add_argument("--rates", default="2,8", help="comma-separated request rates (req/s)")
    p.add_argument("--duration", type=float, default=6.0, help="seconds of arrivals per rate")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--image-mix", default="112x112=0.4,224x224=0.3,448x448=0.1,text=0.2",
                   help="WxH=weight entries; 'text' = text-only requests")
    p.add_argument("--probe-rate", type=float, default=2.0, help="probe requests/s (0: none)")
    p.add_argument("--input-words", type=int, default=12, help="words of each text prompt")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    p.add_argument("--probe-output-len", type=int, default=8,
                   help="output tokens per probe request")
    p.add_argument("--slo", default="ttft:1000,tpot:100",
                   help="goodput SLOs in ms, e.g. ttft:500,tpot:50,e2el:5000")
    p.add_argument("--seed", type=int, default=0, help="workload random seed")
    p.add_argument("--device", help="in-process: cuda or cpu (default: cuda when present)")
    p.add_argument("--attention-backend", help="in-process: triton or torch (default: triton "
                   "on CUDA except in shared mode, torch on CPU)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="in-process: ranks the decoder is split over (a process and GPU each)")
    p.add_argument("--max-num-seqs", type=int, default=128,
                   help="in-process: requests in the running batch at most")
    p.add_argument("--num-kv-blocks", type=int,
                   help="in-process: KV cache blocks (default: sized from free memory)")
    p.add_argument("--out", type=Path, default=Path("runs/bench-serve"),
                   help="output directory")
    p.add_argument("--show", type=int, default=3, help="outputs to print per mode")
    p.add_argument("--no-plot", action="store_true", help="skip the figures")
    return p


def check_model_args(args: argparse.Namespace) -> None:
    """`--model`, `--llm-layers` and `--sim` against each other; ValueError naming them."""
    if args.sim and args.backend != "inprocess":
        raise ValueError("--sim needs the in-process backend (the engine's mode and splits)")
    if is_random_model(args.model):
        random_config(args.model, args.llm_layers)  # validates --llm-layers
        return
    if args.llm_layers is not None:
        raise ValueError(f"--llm-layers applies to the random-weight models only "
                         f"({', '.join(RANDOM_MODELS)}), not --model {args.model!r}")
    if args.backend == "inprocess" and args.model != "tiny" and \
            not (Path(args.model).expanduser() / "config.json").is_file():
        raise ValueError(f"--model {args.model!r}: not a checkpoint directory (no config.json), "
                         f"'tiny' or a random-weight model ({', '.join(RANDOM_MODELS)})")


def results_doc(config: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON document of a benchmark: its settings, every run and every request."""
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.items()},
            "runs": [{k: v for k, v in r.items() if k not in ("results", "t0")}
                     | {"requests": _request_rows(r)} for r in runs]}


def write_outputs(runs: list[dict[str, Any]], out: Path, config: dict[str, Any], *,
                  plots: bool = True, prefix: str = "") -> list[Path]:
    """results.json and (matplotlib present) the two figures under `out`; paths written."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{prefix}results.json"
    path.write_text(json.dumps(results_doc(config, runs), indent=1, default=str))
    written = [path]
    if plots:
        for fn, name in ((plot_vs_rate, "latency_vs_rate.png"),
                         (plot_timeline, "sm_split_timeline.png")):
            fig = fn(runs, out / f"{prefix}{name}")
            if fig is None:
                print("note: matplotlib is not installed (or nothing to plot); no plots")
                break
            written.append(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
        slos = parse_slos(args.slo)
        check_model_args(args)
        workloads = [ServeWorkload(request_rate=r, duration_s=args.duration,
                                   burstiness=args.burstiness, image_mix=parse_mix(args.image_mix),
                                   probe_rate=args.probe_rate, input_words=args.input_words,
                                   output_len=args.output_len,
                                   probe_output_len=args.probe_output_len, seed=args.seed)
                     for r in rates]
        if not workloads:
            raise ValueError("--rates: no rate given")
    except ValueError as exc:
        print(f"spaceserve bench serve: {exc}", file=sys.stderr)
        return 2
    cut = f" (LLM cut to {args.llm_layers} layers)" if args.llm_layers else ""
    print(f"serving benchmark: {args.backend}, model {args.model}{cut}, rates {rates} req/s, "
          f"{args.duration:g} s each, mix {args.image_mix}, probes {args.probe_rate:g}/s, "
          f"SLOs {slos} ms")
    print("latencies in ms (means unless p99), goodput in req/s")
    print(HEADER)
    runner = _run_inprocess if args.backend == "inprocess" else _run_http
    try:
        runs = asyncio.run(runner(args, workloads, slos))
    except ValueError as exc:
        print(f"spaceserve bench serve: {exc}", file=sys.stderr)
        return 2
    print("\nsample outputs (random weights: the text is noise, the token counts are real):")
    for label in dict.fromkeys(r["label"] for r in runs):
        _show(next(r for r in runs if r["label"] == label), args.show)
    written = write_outputs(runs, args.out, vars(args), plots=not args.no_plot)
    print(f"\nwrote {', '.join(str(p) for p in written)} "
          f"({time.monotonic() - started:.1f} s in all)")
    return 0
