"""One engine under load, as the co-location section measures it: background requests decode
alone, then image and text "probe" requests arrive on a schedule beside them. `drive` returns
TPOT alone and under load, probe p99 ITL and TTFTs, and stops at its deadline wherever it is
(alone, under load or draining): what was measured until then is kept and the row says so.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from spaceserve.bench.prompts import Prompts

BACKGROUND, BG_PROMPT, BG_OUTPUT = 32, 256, 512


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def ms(xs: list[float], q: float | None = None) -> float:
    """Mean (or the q-th percentile) of seconds `xs`, in milliseconds; NaN when empty."""
    if not xs:
        return math.nan
    return 1e3 * (statistics.fmean(xs) if q is None else percentile(xs, q))


def _gaps(times: tuple[float, ...], lo: float, hi: float) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False) if a >= lo and b <= hi]


def drive(engine: Any, arrivals: list[Any], prompts: Prompts, *, alone_s: float,
          load_s: float, background: int = BACKGROUND, bg_prompt: int = BG_PROMPT,
          bg_output: int = BG_OUTPUT, drain_s: float = 10.0,
          deadline: float = math.inf,
          clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Background decode alone for `alone_s`, then `arrivals` (sim `Request`s: kind, arrival,
    text/output tokens, resolution) over `load_s`; returns measured metrics (ms).

    At `deadline` (a `clock()` value) every open request is aborted and the metrics cover what
    ran until then, with ``cut`` naming the phase that was cut. The phases are timed by `clock`
    too, so the latency metrics need it to be the engine's clock (the default; a test may
    inject a virtual one to place the deadline whatever the machine's load).
    """
    from spaceserve import SamplingParams

    finals: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    cut: str | None = None

    def sink(out: Any) -> None:
        if out.finished:
            finals[out.request_id] = out

    def add(kind: str, prompt: dict, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        kinds[engine.add_request(prompt, params, sink=sink)] = kind

    def background_up() -> None:
        alive = sum(1 for r, k in kinds.items() if k == "background" and r not in finals)
        for _ in range(background - alive):
            add("background", prompts.text(bg_prompt), bg_output)

    background_up()
    start = clock()
    while (now := clock()) - start < alone_s:
        if now > deadline:
            cut = "alone"
            break
        engine.step()
        background_up()
    t_load = clock()
    i = 0
    while cut is None:
        now = clock()
        elapsed = now - t_load
        while i < len(arrivals) and arrivals[i].arrival <= elapsed:
            r = arrivals[i]
            prompt = prompts.image(r.resolution, r.text_tokens) if r.kind == "image" \
                else prompts.text(r.text_tokens)
            add(r.kind, prompt, r.output_tokens)
            i += 1
        open_ = [r for r, k in kinds.items() if k != "background" and r not in finals]
        if (elapsed >= load_s and i == len(arrivals) and not open_) or \
                elapsed > load_s + drain_s:
            break
        if now > deadline:
            cut = "load"
            break
        engine.step()
        background_up()
    t_end = clock()
    for rid, kind in kinds.items():
        if rid not in finals and (kind == "background" or cut):
            engine.abort(rid)
    while engine.has_unfinished():
        if cut is None and clock() > deadline:
            cut = "drain"
            for rid in kinds:
                if rid not in finals:
                    engine.abort(rid)
        engine.step()
    bg = [o for r, o in finals.items() if kinds[r] == "background"]
    by = {k: [o for r, o in finals.items() if kinds[r] == k and o.finish_reason == "length"]
          for k in ("image", "text")}
    gaps_alone = [g for o in bg for g in _gaps(o.metrics.token_times, start + 0.2 * alone_s,
                                                   t_load)]
    gaps_load = [g for o in bg for g in _gaps(o.metrics.token_times, t_load, t_end)]
    probe_itl = [g for o in by["text"] for g in _gaps(o.metrics.token_times, 0, math.inf)]
    ttft = {k: [o.metrics.first_token_time - o.metrics.arrival_time for o in v]
            for k, v in by.items()}
    out = {"tpot_alone_ms": ms(gaps_alone), "tpot_load_ms": ms(gaps_load),
           "tpot_load_p99_ms": ms(gaps_load, 99), "probe_itl_p99_ms": ms(probe_itl, 99),
           "image_ttft_ms": ms(ttft["image"]), "image_ttft_p99_ms": ms(ttft["image"], 99),
           "probe_ttft_ms": ms(ttft["text"]), "images_done": len(by["image"]),
           "probes_done": len(by["text"]),
           "requests": sum(1 for k in kinds.values() if k != "background"),
           "load_s": t_end - t_load}
    if cut:
        out["cut"] = f"deadline reached while {cut}: open requests aborted"
    return out
