"""`spaceserve bench serve`: serving benchmark, in-process engine or a server over HTTP.

For each mode (in-process: an engine per mode; HTTP: the running server, labelled --label) and
each request rate, requests are sent on their arrival schedule (gamma / Poisson, an image-size
mix with text-only requests, probe requests beside the load), then TTFT, TPOT, ITL and E2EL
(mean / median / p99), throughput and goodput under the SLOs are reported for the load and the
probes apart, as `vllm bench serve` names them. Writes results.json (every run, every request,
the SM split timeline), latency_vs_rate.png and sm_split_timeline.png under --out, and prints
a table and a few outputs. A mode this engine build lacks runs as temporal and is labelled so.
Goodput follows `runtime.policy.slo` (--slo, default ttft:2000,tpot:50): the image requests
of the arrival window that met the SLO, per second and as a fraction; a run waits at most
--drain seconds after its last arrival, and a request unfinished then counts as a miss.

The header and every figure name the device, model and modes. On a CPU, which cannot co-locate
anything, the run proves correctness and plumbing only; it says so and prints the simulator's
goodput prediction for the target GPU (--target-gpu) on the same requests and SLO, labelled
as modelled. Over HTTP an unreachable server fails the command at once with the connection
error.

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
import sys
import time
from pathlib import Path
from typing import Any

from spaceserve.bench.backends import (
    CHAT,
    HttpBackend,
    InProcessBackend,
    Unreachable,
    check_endpoint,
)
from spaceserve.bench.predict import predict_run
from spaceserve.bench.random_model import (
    RANDOM_MODELS,
    RandomModels,
    default_backend,
    is_random_model,
    random_config,
)
from spaceserve.bench.report.tables import (
    CPU_NOTE,
    HEADER,
    is_cpu,
    modelled_table,
    show,
    sim_row,
    table_row,
    title,
    write_outputs,
)
from spaceserve.bench.schedule import CUT, run_one
from spaceserve.bench.workload import ServeWorkload, parse_mix
from spaceserve.cli_args import HelpFormatter
from spaceserve.models.tiny import TINY_MODELS
from spaceserve.runtime.engine.args import (
    SM_BUDGET_FIELDS,
    add_engine_args,
    add_load_args,
    add_sm_budget_args,
    engine_kwargs,
)
from spaceserve.runtime.policy.slo import DEFAULT_SLO_TEXT, Slo

__all__ = ["CUT", "bench_engine", "main", "run_one", "write_outputs"]

# the engine flags of the in-process backend (declared beside EngineConfig's fields)
BENCH_FIELDS = ("tensor_parallel_size", "max_num_seqs", "num_kv_blocks", "encoder_window_s")

async def bench_engine(engine: Any, workloads: list[ServeWorkload], slo: Slo | None, *,
                       mode: str, model: str, note: str | None = None, preprocessor: Any = None,
                       prompts: Any = None, sim: bool = False, warm: bool = True,
                       deadline: float | None = None, extra: dict[str, Any] | None = None,
                       drain_s: float | None = None, endpoint: str = CHAT
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
        backend = InProcessBackend(client, preprocessor, model, prompts=prompts,
                                   endpoint=endpoint)
        if warm:
            w = ServeWorkload(request_rate=50.0, duration_s=0.1, image_mix=workloads[0]
                              .image_mix, output_len=4, seed=12345)
            await run_one(backend, w, model, slo, deadline=deadline)
        for w in workloads:
            if deadline is not None and time.monotonic() >= deadline:
                break
            run = await run_one(backend, w, model, slo, client=client, deadline=deadline,
                                drain_s=drain_s)
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
                         slo: Slo) -> list[dict[str, Any]]:
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
    cfg = dict(engine_kwargs(args, BENCH_FIELDS + SM_BUDGET_FIELDS), seed=args.seed, slo=slo)
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
        runs += await bench_engine(engine, workloads, slo, mode=mode, model=args.model,
                                   note=note, preprocessor=pre, prompts=prompts, sim=args.sim,
                                   extra=extra, drain_s=args.drain, endpoint=args.endpoint)
        del engine
        _free_device()
    return runs


async def server_info(args: argparse.Namespace) -> dict[str, Any]:
    """The server's model name and device (`Unreachable` when it does not answer)."""
    backend = HttpBackend(args.base_url, args.served_model or args.model)
    try:
        return await backend.info()
    finally:
        await backend.close()


async def _run_http(args: argparse.Namespace, workloads: list[ServeWorkload],
                    slo: Slo) -> list[dict[str, Any]]:
    backend = HttpBackend(args.base_url, args.served_model or args.model,
                          poll_metrics=not args.no_poll, endpoint=args.endpoint)
    runs = []
    try:
        for w in workloads:
            run = await run_one(backend, w, backend.model, slo, drain_s=args.drain)
            run.update(label=args.label, mode=args.label, ran_as=None, note=None)
            if run["num_requests"] and run["metrics"]["failed"] == run["num_requests"]:
                await backend.info()  # every request failed: Unreachable if the server is gone
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
    p.add_argument("--model", default="tiny", help="checkpoint directory, 'tiny', "
                   f"'tiny-qwen3-vl', or a random-weight model: {', '.join(RANDOM_MODELS)}")
    p.add_argument("--llm-layers", type=int,
                   help="random-weight models: LLM layers to keep (default: all)")
    p.add_argument("--sim", action="store_true",
                   help="in-process: add the simulator's prediction beside each run")
    p.add_argument("--modes", default="spatial,temporal", help="in-process engine modes")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="http backend")
    p.add_argument("--endpoint", default=CHAT,
                   help="API the requests use: /v1/chat/completions, or /v1/completions "
                        "(text prompts only: --image-mix text=1)")
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
    p.add_argument("--slo", default=DEFAULT_SLO_TEXT,
                   help="goodput SLO in ms: any of ttft, tpot, itl (p99 per request), e2el "
                        f"(default {DEFAULT_SLO_TEXT})")
    p.add_argument("--seed", type=int, default=0, help="workload random seed")
    add_load_args(p, ("device", "attention_backend"), prefix="in-process: ")
    add_engine_args(p, BENCH_FIELDS[:3], prefix="in-process: ")
    p.add_argument("--out", type=Path, default=Path("runs/bench-serve"),
                   help="output directory")
    p.add_argument("--show", type=int, default=3, help="outputs to print per mode")
    p.add_argument("--no-plot", action="store_true", help="skip the figures")
    add_engine_args(p, BENCH_FIELDS[3:], prefix="in-process: ")
    p.add_argument("--drain", type=float, default=30.0,
                   help="seconds a run waits after its last arrival; then unfinished = missed")
    p.add_argument("--target-gpu", default="H200",
                   help="on a CPU: the GPU preset (H200, H100, A100) of the modelled goodput")
    p.add_argument("--no-poll", action="store_true",
                   help="http: do not scrape /metrics for the SM split timeline")
    add_sm_budget_args(p, prefix="in-process: ")
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
    if args.backend == "inprocess" and args.model not in TINY_MODELS and \
            not (Path(args.model).expanduser() / "config.json").is_file():
        raise ValueError(f"--model {args.model!r}: not a checkpoint directory (no config.json), "
                         "'tiny', 'tiny-qwen3-vl' or a random-weight model "
                         f"({', '.join(RANDOM_MODELS)})")


def _where(args: argparse.Namespace) -> str:
    """The device the run uses (in-process) or the server reports (HTTP)."""
    if args.backend == "http":
        info = asyncio.run(server_info(args))
        if args.served_model is None and args.model not in info["models"] and \
                len(info["models"]) == 1:
            args.served_model = info["models"][0]  # the one model the server serves
        return info["device"] or "the server's device (unknown)"
    import torch

    from spaceserve.server.engine_client import device_label

    return device_label(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
        slo = Slo.parse(args.slo)
        check_model_args(args)
        check_endpoint(args.endpoint, parse_mix(args.image_mix))
        for name in ("encoder_window_ms", "drain"):
            if not getattr(args, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        workloads = [ServeWorkload(request_rate=r, duration_s=args.duration,
                                   burstiness=args.burstiness, image_mix=parse_mix(args.image_mix),
                                   probe_rate=args.probe_rate, input_words=args.input_words,
                                   output_len=args.output_len,
                                   probe_output_len=args.probe_output_len, seed=args.seed)
                     for r in rates]
        if not workloads:
            raise ValueError("--rates: no rate given")
        if args.backend == "inprocess":  # a bad engine flag (a --curves file) fails here
            engine_kwargs(args, BENCH_FIELDS + SM_BUDGET_FIELDS)
        where = _where(args)
    except ValueError as exc:
        print(f"spaceserve bench serve: {exc}", file=sys.stderr)
        return 2
    except Unreachable as exc:
        print(f"spaceserve bench serve: {exc}", file=sys.stderr)
        return 1
    modes = args.modes if args.backend == "inprocess" else [args.label]
    cut = f" (LLM cut to {args.llm_layers} layers)" if args.llm_layers else ""
    weights = " (random weights)" if args.model in TINY_MODELS else ""
    head = title(args.backend, f"{args.model}{weights}{cut}", where, modes)
    print(f"serving benchmark: {head}\nrates {rates} req/s, {args.duration:g} s each, mix "
          f"{args.image_mix}, probes {args.probe_rate:g}/s, SLO {slo} ms")
    print("latencies in ms (means unless p99); good = image requests/s within the SLO, att% "
          "= their share")
    print(HEADER)
    runner = _run_inprocess if args.backend == "inprocess" else _run_http
    try:
        runs = asyncio.run(runner(args, workloads, slo))
    except ValueError as exc:
        print(f"spaceserve bench serve: {exc}", file=sys.stderr)
        return 2
    except Unreachable as exc:
        print(f"spaceserve bench serve: {exc}", file=sys.stderr)
        return 1
    extra: dict[str, Any] = {"device": where}
    if is_cpu(where):
        from spaceserve.bench.modelled import predict

        print(f"\n{CPU_NOTE}")
        pred = predict(workloads, args.modes if args.backend == "inprocess" else
                       ["temporal", "temporal-chunked", "spatial"], args.model, slo,
                       device=args.target_gpu, window_s=args.encoder_window_ms / 1e3,
                       drain_s=args.drain)
        print(modelled_table(pred))
        extra["modelled"] = pred
    print("\nsample outputs (random weights: the text is noise, the token counts are real):")
    for label in dict.fromkeys(r["label"] for r in runs):
        show(next(r for r in runs if r["label"] == label), args.show)
    written = write_outputs(runs, args.out, vars(args), plots=not args.no_plot, title=head,
                            device=where, extra=extra)
    print(f"\nwrote {', '.join(str(p) for p in written)} "
          f"({time.monotonic() - started:.1f} s in all)")
    return 0
