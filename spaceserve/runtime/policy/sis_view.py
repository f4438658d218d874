"""SIS's predictions at engine speed: per-split latency tables and a per-round view of the state.

`decide` runs every engine step, so it must cost the host next to nothing (<= 0.1 ms with 64
encoder jobs waiting; bench/sim/bench_sis.py). What made it slow was asking the curves again and
again - one interpolation per job, per candidate split, per prediction - and draining the queue
once per question. Here:

- `WorkTable` memoises, per encoder SM count, each job's encoder run (by ViT patches and layers
  left), each prompt's prefill pass and each chunked-prefill decode step, so a round reads
  dictionaries, not curves;
- `StateView` is built once per round from the `SisState` and answers every question SIS asks
  about it (TTFT misses at a split, the mean predicted TTFT at a split and placement) from those
  tables, each answer computed once per round.

The arithmetic is the one the predictions always did, in the same order, so the answers are the
same floats (tests/runtime/policy/test_sis_fast.py checks decisions against the old code).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from itertools import accumulate, compress, repeat
from operator import add, attrgetter, itemgetter, mul

from spaceserve.runtime.policy.curves import CurveSet
from spaceserve.runtime.policy.sis_state import SisState

CACHE_LIMIT = 100_000  # entries per split's table before it is cleared
_third = itemgetter(2)
_fields = attrgetter("patches", "layers_left", "prefill_tokens", "age_s", "requests")


def _scaled(xs: list[float], scale: float) -> list[float]:
    return xs if scale == 1.0 else list(map(mul, xs, repeat(scale)))


class WorkTable:
    """Curve latencies memoised per encoder SM count (co-running with the decoder)."""

    def __init__(self, curves: CurveSet, total_sms: int | None = None) -> None:
        self.curves = curves
        self.total = curves.num_sms if total_sms is None else total_sms
        self._enc: dict[int, dict[tuple[int, int], float]] = {}
        self._pre: dict[int, dict[int, float]] = {}
        self._mixed: dict[tuple, float] = {}
        self._chunked: dict[tuple, dict[int, float]] = {}
        self._sat: dict[tuple, int] = {}

    def saturation(self, kind: str, work: float, cap: int, cands: Sequence[int],
                   tolerance: float) -> int:
        """Fewest of `cands` SMs at which `kind` ("encoder" or "prefill") `work` runs within
        `tolerance` of its time at `cap`, over curve grid points up to the first >= `work` (so
        it never falls as the work grows)."""
        c = self.curves
        if kind == "encoder":
            grid, fn = c.encoder_curve.grid["patches"], lambda x, n: c.encoder(x, 1, n, True)
        else:
            grid, fn = c.prefill_curve.grid["tokens"], lambda x, n: c.prefill(x, 0, n, True)
        top = min(bisect.bisect_left(grid, work), len(grid) - 1)
        key = (kind, cap, top, tuple(cands), tolerance)
        hit = self._sat.get(key)
        if hit is None:
            hit = cands[0]
            for x in grid[: top + 1]:
                limit = fn(x, cap) * (1.0 + tolerance)
                hit = max(hit, next(n for n in cands if fn(x, n) <= limit))
            if len(self._sat) > CACHE_LIMIT:
                self._sat.clear()
            self._sat[key] = hit
        return hit

    def runs(self, e: int, keys: list[tuple[int, int]]) -> list[float]:
        """Encoder seconds of each (patches, layers left) at `e` SMs co-running with the decoder
        (`e` 0: alone on the whole device, as in a whole-GPU window)."""
        table = self._enc.get(e)
        if table is None:
            table = self._enc[e] = {}
        try:
            return list(map(table.__getitem__, keys))
        except KeyError:
            if len(table) > CACHE_LIMIT:
                table.clear()
            enc, n, corun = self.curves.encoder, e or self.total, e > 0
            for k in keys:
                if k not in table:
                    table[k] = enc(k[0], k[1], n, corun)
            return list(map(table.__getitem__, keys))

    def prefills(self, e: int, tokens: list[int]) -> list[float]:
        """Prefill seconds of each prompt (whole, no cached context) at `e` SMs co-running (0:
        alone on the whole device); 0 for none."""
        table = self._pre.get(e)
        if table is None:
            table = self._pre[e] = {}
        try:
            return list(map(table.__getitem__, tokens))
        except KeyError:
            if len(table) > CACHE_LIMIT:
                table.clear()
            pre, n, corun = self.curves.prefill, e or self.total, e > 0
            for t in tokens:
                if t not in table:
                    table[t] = pre(t, 0, n, corun) if t > 0 else 0.0
            return list(map(table.__getitem__, tokens))

    def mixed(self, batch: int, context: float, chunk: int, decoder_sms: int) -> float:
        """A co-running decode step of `batch` carrying a `chunk`-token prefill chunk."""
        key = (batch, context, chunk, decoder_sms)
        t = self._mixed.get(key)
        if t is None:
            if len(self._mixed) > CACHE_LIMIT:
                self._mixed.clear()
            t = self._mixed[key] = self.curves.mixed_step(batch, context, chunk, 0,
                                                          decoder_sms, True)
        return t


    def chunked(self, batch: int, context: float, chunk: int, decoder_sms: int,
                tokens: list[int]) -> list[float]:
        """Seconds each prompt takes prefilled in `chunk`-token pieces carried by co-running
        decode steps of `batch` requests (one step per piece)."""
        key = (batch, context, chunk, decoder_sms)
        table = self._chunked.get(key)
        if table is None:
            if len(self._chunked) > CACHE_LIMIT:
                self._chunked.clear()
            table = self._chunked[key] = {}
        try:
            return list(map(table.__getitem__, tokens))
        except KeyError:
            for t in tokens:
                if t not in table:
                    step = self.mixed(batch, context, min(t, chunk), decoder_sms)
                    table[t] = math.ceil(t / chunk) * step
            return list(map(table.__getitem__, tokens))


class StateView:
    """One round's `SisState`, flattened once, with its predictions memoised per split."""

    def __init__(self, state: SisState, table: WorkTable) -> None:
        self.state, self.table = state, table
        encode = state.encode
        if encode:
            patches, layers, tokens, ages, requests = zip(*map(_fields, encode), strict=True)
            self.keys = list(zip(patches, layers, strict=True))
        else:
            patches = tokens = ages = requests = ()
            self.keys = []
        self.tokens, self.ages, self.requests = list(tokens), list(ages), list(requests)
        self.total_requests = sum(requests)
        self.ready = list(state.prefill)
        ages = state.prefill_age_s
        n = len(ages)
        self.ready_ages = [ages[i] if i < n else 0.0 for i in range(len(self.ready))]
        self.prompts = self.ready + [t for t in self.tokens if t > 0]
        self.max_patches = max(patches) if patches else 0
        self.max_prompt = max(self.prompts) if self.prompts else 0
        self._runs: dict[int, list[float]] = {}
        self._open_cache: dict[float, tuple[list, list, list, list, int]] = {}
        self._finish: dict[tuple[int, float], list[float]] = {}
        self._misses: dict[tuple[int, float, int, float], int] = {}
        self._ttft: dict[tuple[int, str, int, float], float] = {}

    def runs(self, e: int) -> list[float]:
        """Each encoder job's predicted run at `e` SMs, in the state's order."""
        r = self._runs.get(e)
        if r is None:
            r = self._runs[e] = self.table.runs(e, self.keys)
        return r

    def _open(self, limit: float) -> tuple[list, list, list, list, int]:
        """(keys, prompt tokens, ages, requests, their total) of the jobs whose age alone is
        within `limit`."""
        hit = self._open_cache.get(limit)
        if hit is None:
            keep = list(map(limit.__ge__, self.ages))
            requests = list(compress(self.requests, keep))
            hit = self._open_cache[limit] = (
                list(compress(self.keys, keep)), list(compress(self.tokens, keep)),
                list(compress(self.ages, keep)), requests, sum(requests))
        return hit

    def misses(self, e: int, limit: float, horizon: int, scale: float = 1.0) -> int:
        """Requests predicted to finish past `limit` with `e` encoder SMs: ready prompts first,
        then jobs in TWSRFT's order (live ones shortest first, up to `horizon`; a job late on
        its own is a miss without draining). `scale` stretches every latency (a whole-GPU
        window: the encoder has the device a share of the time)."""
        key = (e, limit, horizon, scale)
        hit = self._misses.get(key)
        if hit is not None:
            return hit
        t, missed = 0.0, 0
        if self.ready:
            for age, pre in zip(self.ready_ages, _scaled(self.table.prefills(e, self.ready),
                                                         scale), strict=True):
                t += pre
                if age + t > limit:
                    missed += 1
        # the same float operations as a per-job loop, run by map/compress in C, over the jobs
        # not already past `limit` by their age alone (those miss at every split)
        keys, tokens, ages, requests, total = self._open(limit)
        missed += self.total_requests - total
        runs = _scaled(self.table.runs(e, keys), scale)
        pres = _scaled(self.table.prefills(e, tokens), scale)
        start = ages if t == 0.0 else list(map(add, ages, repeat(t)))
        ontime = list(map(limit.__ge__, map(add, map(add, start, runs), pres)))
        works = compress(map(add, runs, pres), ontime)
        if total == len(requests):  # one request per job (the usual case): lighter tuples
            live = list(zip(works, compress(ages, ontime), strict=True))
            missed += total - len(live)
        else:
            live = list(zip(works, compress(ages, ontime), compress(requests, ontime),
                            strict=True))
            missed += total - sum(map(_third, live))
        if live:
            live.sort()
            cols = list(zip(*live[:horizon], strict=True))
            done = accumulate(cols[0], initial=t)
            next(done)
            late = map(limit.__lt__, map(add, cols[1], done))
            missed += sum(late) if len(cols) == 2 else sum(compress(cols[2], late))
        self._misses[key] = missed
        return missed

    def ttft(self, e: int, placement: str, chunk_tokens: int, total_sms: int,
             scale: float = 1.0) -> float:
        """Mean predicted TTFT of the waiting requests with `e` encoder SMs: jobs drain
        shortest first, then every prompt prefills on `placement` (`scale` as in `misses`;
        a window's prompts prefill in it, on the whole device)."""
        key = (e, placement, chunk_tokens, scale)
        hit = self._ttft.get(key)
        if hit is not None:
            return hit
        jobs = self._finish.get((e, scale))
        if jobs is None:  # the encoder part is the same for both placements
            jobs = self._finish[(e, scale)] = list(accumulate(sorted(_scaled(self.runs(e),
                                                                            scale))))
        finish = list(jobs)
        done_at = finish[-1] if finish else 0.0
        if self.prompts:
            if placement == "compute" or scale != 1.0:
                steps = _scaled(self.table.prefills(e, self.prompts), scale)
            else:
                s = self.state
                steps = self.table.chunked(s.decode_batch, s.decode_context, chunk_tokens,
                                           total_sms - e, self.prompts)
            done = accumulate(steps, initial=done_at)
            next(done)
            finish.extend(done)
        out = sum(finish) / len(finish) if finish else 0.0
        self._ttft[key] = out
        return out
