"""Batched token sampling on the device from per-request state kept on the device.

`Sampler.prepare` turns a step's sampled requests into a `SampleBatch`: their sequence slots
and every per-row parameter the batch needs (temperature, top-p / top-k / min-p, penalties,
logit bias, seeds) as device tensors, built once and reused while the batch keeps the same
requests in the same order (a decode-heavy batch changes only when a request joins or leaves).
Per sequence slot the sampler also keeps device state that outlives batch changes: the last
sampled token (a pipelined step takes its decode inputs from it, see `engine.py`) and, for
requests with penalties, their output-token counts and their repetition scale (the penalty at
every token seen in the prompt or output, 1 elsewhere), (re)built when a request takes the
slot. `Sampler.sample` then processes the logits and draws every row with a
short sequence of tensor ops (sampling_ops.py) and starts the copy of the ids (and, when asked,
the raw logprobs) to the host: one copy per step, read by `Sampled.fetch`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spaceserve.runtime.core.request import Request
from spaceserve.runtime.sample.ops import (
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    fold_seed,
    gumbel_noise,
    logprob_rows,
    row_keys,
)

__all__ = ["SampleBatch", "Sampled", "Sampler"]


@dataclass
class SampleBatch:
    """The sampled requests of a step, in logits-row order, with their device parameters
    (None where no row of the batch uses that control)."""

    reqs: list[Request]
    admissions: int
    rows: torch.Tensor  # [B] int64 sequence slots
    temperature: torch.Tensor | None  # [B, 1] (1 for greedy rows), None when all are greedy
    random: torch.Tensor | None  # [B] bool, None unless greedy and random rows mix
    seeds: torch.Tensor | None  # [B] folded 32-bit seeds
    positions: torch.Tensor | None  # [B] sequence index of the drawn token (advances by 1)
    top_p: torch.Tensor | None
    top_k: tuple[torch.Tensor, int, torch.Tensor | None] | None  # (k - 1, max k, off)
    log_min_p: torch.Tensor | None
    repetition: torch.Tensor | None  # [B] per-row repetition penalty
    rep_mode: str  # how apply_penalties tells the two cases apart ("min", "max", "where")
    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (batch rows, ids, values)
    min_tokens: list[tuple[int, Request]]  # rows whose stop tokens may still be barred
    penalised: bool
    logprobs: int  # top logprobs to return (max over rows), -1 when no row asked

    @property
    def size(self) -> int:
        return len(self.reqs)


class Sampled:
    """One step's draws on their way to the host: `fetch` waits for the copy (a no-op on CPU)
    and returns the ids and, when asked, the logprob rows (see `sampling_ops.logprob_rows`)."""

    __slots__ = ("batch", "ids", "_out", "_event", "_host")

    def __init__(self, batch: SampleBatch, ids: torch.Tensor, packed: torch.Tensor) -> None:
        self.batch, self.ids = batch, ids
        self._event = None
        self._host: Any = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            packed = host
        self._out = packed

    def ready(self) -> bool:
        """Whether `fetch` would not wait."""
        return self._event is None or bool(self._event.query())

    def fetch(self) -> tuple[list[int], list[list[float]] | None]:
        """(sampled ids, logprob rows or None); waits for the device the first time."""
        if self._host is None:
            if self._event is not None:
                self._event.synchronize()
            rows = self._out.tolist()
            if self._out.dim() == 1:
                self._host = (rows, None)
            else:
                self._host = ([int(r[0]) for r in rows], rows)
        return self._host


@dataclass
class Launched:
    """A step on the device: its batch (a `ScheduledBatch`) and its draws on their way to the
    host (None when it samples nothing)."""

    batch: Any
    sampled: Sampled | None


class Sampler:
    """Samples one token per logits row for the requests of a step (module docstring).

    `vocab_size` columns; `max_num_seqs` sequence slots (``Request.row``). `eos_token_ids` are
    barred, with each request's stop token ids, while it is short of its `min_tokens`.
    """

    def __init__(self, device: torch.device | str, vocab_size: int, max_num_seqs: int,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.device = torch.device(device)
        self.vocab_size, self.max_num_seqs = int(vocab_size), int(max_num_seqs)
        self.eos = tuple(eos_token_ids)
        self.last_tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        # [slots, 2, V] fp32, gathered in one op: output-token counts (`counts` views [:, 0])
        # and the repetition penalty at seen tokens, 1 elsewhere (`rep_scale` views [:, 1])
        self.penalty: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.rep_scale: torch.Tensor | None = None
        self._slot_owner = [-1] * max_num_seqs  # admit_serial whose penalty state a slot holds
        self._cache: dict[str, SampleBatch] = {}
        self.num_prepares = 0  # batches built (not reused): a measure of batch churn
        self._one = torch.ones((), device=self.device)
        self._neg_inf = torch.full((), -math.inf, device=self.device)

    # -- batch parameters ------------------------------------------------------------------------
    def prepare(self, reqs: list[Request], stage: str = "decoder", admissions: int = -1
                ) -> SampleBatch:
        """The `SampleBatch` of `reqs` (row ``i`` of the logits is ``reqs[i]``'s), reused from
        the previous call of the same `stage` while the requests and the scheduler's admission
        count (`admissions`: a request that re-took a slot changes it) are unchanged."""
        cached = self._cache.get(stage)
        if cached is not None and admissions >= 0 and cached.admissions == admissions \
                and cached.reqs == reqs:
            return cached
        batch = self._build(list(reqs), admissions)
        self._cache[stage] = batch
        self.num_prepares += 1
        return batch

    def _tensor(self, values: Any, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(values))
        if t.dtype != dtype:
            t = t.to(dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _build(self, reqs: list[Request], admissions: int) -> SampleBatch:
        ps = [r.params for r in reqs]
        rows = [r.row for r in reqs]
        if any(r < 0 for r in rows):
            raise ValueError("a sampled request holds no sequence slot")
        temps = [p.temperature for p in ps]
        rand = [t > 0 for t in temps]
        any_rand, all_rand = any(rand), all(rand)
        # One float matrix and one int matrix carry every per-row value to the device.
        fcols = {"temp": [t if t > 0 else 1.0 for t in temps],
                 "top_p": [p.top_p for p in ps],
                 "log_min_p": [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in ps],
                 "rep": [p.repetition_penalty for p in ps],
                 "freq": [p.frequency_penalty for p in ps],
                 "pres": [p.presence_penalty for p in ps]}
        k_max = max((p.top_k for p, r in zip(ps, rand, strict=True) if r and p.top_k), default=0)
        k_max = min(k_max, self.vocab_size)
        icols = {"rows": rows,
                 "seeds": [fold_seed(r.seed) for r in reqs],
                 "pos": [len(r.token_ids) + r.num_placeholders - 1 for r in reqs],
                 "kth": [min(p.top_k or k_max, k_max) - 1 for p in ps],
                 "rand": rand,
                 "k_off": [not p.top_k for p in ps]}
        fdev = self._tensor(np.array(list(fcols.values()), dtype=np.float32).T, torch.float32)
        idev = self._tensor(np.array(list(icols.values()), dtype=np.int64).T, torch.int64)
        fcol = {k: fdev[:, i:i + 1] for i, k in enumerate(fcols)}
        icol = {k: idev[:, i] for i, k in enumerate(icols)}
        any_p = any_rand and any(p.top_p < 1.0 for p, r in zip(ps, rand, strict=True) if r)
        any_min_p = any_rand and any(p.min_p > 0 for p, r in zip(ps, rand, strict=True) if r)
        reps = [p.repetition_penalty for p in ps]
        rep = any(r != 1.0 for r in reps)
        rep_mode = "min" if min(reps) >= 1.0 else "max" if max(reps) <= 1.0 else "where"
        fp = any(p.frequency_penalty or p.presence_penalty for p in ps)
        penalised = rep or fp
        if penalised:
            self._init_penalty_slots(reqs)
        bias = None
        entries = [(i, t, v) for i, p in enumerate(ps) for t, v in p.logit_bias]
        if entries:
            arr = np.array(entries, dtype=np.float64)
            bias = (self._tensor(arr[:, 0], torch.int64), self._tensor(arr[:, 1], torch.int64),
                    self._tensor(arr[:, 2], torch.float32))
        min_tok = [(i, r) for i, r in enumerate(reqs) if r.params.min_tokens]
        lp = max((p.logprobs for p in ps if p.logprobs is not None), default=-1)
        positions = icol["pos"].clone() if any_rand else None  # advanced in place per draw
        off = icol["k_off"][:, None].bool() if k_max and any(p.top_k == 0 for p in ps) else None
        return SampleBatch(
            reqs=reqs, admissions=admissions, rows=icol["rows"],
            temperature=fcol["temp"] if any_rand else None,
            random=icol["rand"].bool() if any_rand and not all_rand else None,
            seeds=icol["seeds"] if any_rand else None, positions=positions,
            top_p=fcol["top_p"] if any_p else None,
            top_k=(icol["kth"][:, None].clamp(min=0), k_max, off) if k_max else None,
            log_min_p=fcol["log_min_p"] if any_min_p else None,
            repetition=fcol["rep"][:, 0] if rep else None, rep_mode=rep_mode,
            frequency=fcol["freq"] if fp else None, presence=fcol["pres"] if fp else None,
            bias=bias, min_tokens=min_tok, penalised=penalised, logprobs=lp)

    def _init_penalty_slots(self, reqs: list[Request]) -> None:
        """(Re)build the counts and repetition scale of every slot whose request changed."""
        fresh = [r for r in reqs if self._slot_owner[r.row] != r.admit_serial]
        if not fresh:
            return
        if self.penalty is None:
            self.penalty = torch.ones((self.max_num_seqs, 2, self.vocab_size),
                                      dtype=torch.float32, device=self.device)
            self.counts, self.rep_scale = self.penalty[:, 0], self.penalty[:, 1]
            self.counts.zero_()
        assert self.counts is not None and self.rep_scale is not None
        slots, out_rows, out_ids, all_rows, all_ids, all_scale = [], [], [], [], [], []
        for r in fresh:
            self._slot_owner[r.row] = r.admit_serial
            slots.append(r.row)
            out = r.token_ids[r.num_prompt_tokens:]
            out_rows += [r.row] * len(out)
            out_ids += out
            all_rows += [r.row] * len(r.token_ids)
            all_ids += r.token_ids
            all_scale += [r.params.repetition_penalty] * len(r.token_ids)
        slot_t = self._tensor(np.array(slots, dtype=np.int64), torch.int64)
        self.counts.index_fill_(0, slot_t, 0.0)
        self.rep_scale.index_fill_(0, slot_t, 1.0)
        if out_ids:
            idx = (self._tensor(np.array(out_rows, dtype=np.int64), torch.int64),
                   self._tensor(np.array(out_ids, dtype=np.int64), torch.int64))
            self.counts.index_put_(idx, torch.ones((), device=self.device), accumulate=True)
        idx = (self._tensor(np.array(all_rows, dtype=np.int64), torch.int64),
               self._tensor(np.array(all_ids, dtype=np.int64), torch.int64))
        self.rep_scale.index_put_(idx, self._tensor(np.array(all_scale, dtype=np.float32),
                                                    torch.float32))

    # -- drawing -----------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, batch: SampleBatch) -> Sampled:
        """Draw a token per row of `logits` ``[B, V]`` (row ``i`` = ``batch.reqs[i]``) and start
        reading them back; updates the slots' device state."""
        if logits.dim() != 2 or logits.shape[0] != batch.size:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match "
                             f"{batch.size} rows")
        x = self.process(logits, batch)
        if batch.temperature is None:
            ids = x.argmax(dim=-1)
        else:
            ids = self.draw(x, batch)
            if batch.random is not None:
                ids = torch.where(batch.random, ids, x.argmax(dim=-1))
        rows = batch.rows
        self.last_tokens.index_copy_(0, rows, ids)
        if batch.penalised:
            assert self.counts is not None and self.rep_scale is not None
            self.counts.index_put_((rows, ids), self._one, accumulate=True)
            if batch.repetition is not None:
                self.rep_scale.index_put_((rows, ids), batch.repetition)
        packed = ids if batch.logprobs < 0 else logprob_rows(logits, ids, batch.logprobs)
        return Sampled(batch, ids, packed)

    def process(self, logits: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
        """The processed fp32 logits before temperature: min_tokens, logit bias, penalties."""
        x = logits if logits.dtype == torch.float32 else logits.float()
        masked = self._min_token_mask(batch)
        if (masked is not None or batch.bias is not None) and x is logits:
            x = x.clone()  # masked in place below; the raw logits stay for logprobs
        if masked is not None:
            x.index_put_(masked, self._neg_inf)
        if batch.bias is not None:
            bi, bc, bv = batch.bias
            x.index_put_((bi, bc), bv, accumulate=True)
        if batch.penalised:
            rows = batch.rows
            assert self.penalty is not None
            both = self.penalty.index_select(0, rows)  # one gather for both tables
            scale = both[:, 1] if batch.repetition is not None else None
            counts = both[:, 0] if batch.frequency is not None else None
            x = apply_penalties(x, counts, scale, batch.frequency, batch.presence,
                                batch.rep_mode)
        return x

    def draw(self, x: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
        """Random draws for every row of processed logits `x` (greedy rows are replaced by the
        caller): temperature, min-p, top-k, top-p, then Gumbel-max with counter noise."""
        assert batch.temperature is not None and batch.positions is not None
        x = x / batch.temperature
        if batch.log_min_p is not None:
            x = apply_min_p(x, batch.log_min_p)
        if batch.top_k is not None:
            x = apply_top_k(x, *batch.top_k)
        if batch.top_p is not None:
            x = apply_top_p(x, batch.top_p)
        noise = self.noise(batch)
        batch.positions += 1  # the next draw of the same batch is one token further
        return (x + noise).argmax(dim=-1)

    def noise(self, batch: SampleBatch) -> torch.Tensor:
        """The Gumbel noise of this draw (separate so benchmarks can time it apart)."""
        assert batch.seeds is not None and batch.positions is not None
        return gumbel_noise(row_keys(batch.seeds, batch.positions), self.vocab_size)

    def _min_token_mask(self, batch: SampleBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, ids) of stop tokens barred this step: rows still short of `min_tokens`."""
        if not batch.min_tokens:
            return None
        bi: list[int] = []
        bc: list[int] = []
        for i, r in batch.min_tokens:
            drawn_at = len(r.token_ids) + r.num_placeholders - 1 - r.num_prompt_tokens
            if drawn_at < r.params.min_tokens:
                stops = set(r.params.stop_token_ids)
                if not r.params.ignore_eos:
                    stops.update(self.eos)
                stops = [t for t in stops if t < self.vocab_size]
                bi += [i] * len(stops)
                bc += stops
        if not bi:
            return None
        return (self._tensor(np.array(bi, dtype=np.int64), torch.int64),
                self._tensor(np.array(bc, dtype=np.int64), torch.int64))
