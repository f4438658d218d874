"""SM partitions: the encoder and decoder stages on disjoint SMs, each with its own stream.

A `PartitionSet` is built once at start-up for a small set of splits (encoder SM counts; on
Hopper green-context SM groups come in multiples of 8). Each split becomes a `Partition`: an SM
budget per stage and a stream per stage. Switching split is switching streams, ordered by
events. Besides the splits there is always the `full` partition (no encoder partition: the
decoder gets every SM).

Where the driver offers green contexts (CUDA >= 12.4, reached through ``cuda.bindings``; the
driver calls are `green_context.py`), every split is made with ``cuDeviceGetDevResource ->
cuDevSmResourceSplitByCount -> cuDevResourceGenerateDesc -> cuGreenCtxCreate ->
cuGreenCtxStreamCreate``: one green context for the encoder's SM group and one for the
remaining SMs, each with a stream wrapped as a torch stream. A kernel on such a stream can only
use its context's SMs. The SM counts actually granted are read back from the green contexts and
become the budgets passed to every launch and reported (a request may be rounded), and inside a
green partition launches may run ``programs_per_sm > 1``. Each split is probed as it is made
(`partition_probe.py`: a Triton kernel on both its streams, within its granted SMs, disjoint);
a split that cannot be made or fails its probe (a request the driver rounds past the device,
a launch error, shared SMs) falls back to kernel budgets alone for that split only, with one
log line naming the split and why; the other splits stay green.

Without green contexts (no CUDA, an old driver, no ``cuda.bindings``: every CPU run) the set
falls back, with one logged line per process, to kernel budgets alone: the budgets are the
requested counts, both stages get ordinary streams on CUDA (none on CPU), and programs per SM
stay 1. The budgets then bound how many SMs each stage occupies, not which.

Memory safety across streams: each stage uses one stream at a time and a switch makes the new
streams wait on events of the old ones, so a block freed by the caching allocator to an old
stream's pool is only reused once that stream is current again, after the switch's wait. The
one tensor that crosses stages while both run, an image's embeddings, is handed over by the
encoder stage with an event and ``record_stream`` (see `spatial.py`).

CUDA graphs captured on a green stream stay bound to that partition: `capture_scope` makes the
partition's decoder stream the capture stream, so decode graphs are captured per split.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spaceserve.checks import require_int
from spaceserve.kernels.budget import device_num_sms, programs_per_sm_scope
from spaceserve.runtime.spatial.green_context import (
    MIN_DRIVER_VERSION,
    destroy_handles,
    green_context_stream,
    green_context_support,
    sm_resource,
    split_sm_resource,
)

__all__ = ["MIN_DRIVER_VERSION", "Partition", "PartitionSet", "default_splits",
           "green_context_stream", "green_context_support", "sm_resource", "split_sm_resource"]

log = logging.getLogger("spaceserve.runtime")
_LOGGED: set[str] = set()


def _log_once(key: str, msg: str, *args: Any) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning(msg, *args)


def _device_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """CUDA tensors reachable from an object (fields, containers; a few levels deep)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            yield obj
        return
    if depth >= 4 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, dict):
        values: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    elif hasattr(obj, "__dict__"):
        values = vars(obj).values()
    else:
        values = [getattr(obj, n, None) for n in getattr(obj, "__slots__", ())]
    for v in values:
        yield from _device_tensors(v, depth + 1)


@dataclass
class Partition:
    """One split: the SM budget of each stage and the stream its launches go on.

    `requested` is the encoder SM count asked for (0: the full partition). `encoder_sms` and
    `decoder_sms` are the budgets every launch of that stage gets (the granted counts under green
    contexts). Streams are None on CPU. `reason` says why a split is not green (None when it
    is, or when the whole set has no green contexts: see `PartitionSet.reason`); `probe` is the
    summary of its probe.
    """

    requested: int
    encoder_sms: int
    decoder_sms: int
    green: bool = False
    encoder_stream: Any = None
    decoder_stream: Any = None
    programs_per_sm: int = 1
    reason: str | None = None
    probe: str | None = None
    _handles: list[tuple[str, Any]] = field(default_factory=list, repr=False)

    @contextlib.contextmanager
    def _scope(self, stream: Any) -> Iterator[None]:
        with programs_per_sm_scope(self.programs_per_sm if self.green else 1):
            if stream is None:
                yield
            else:
                with torch.cuda.stream(stream):
                    yield

    def encoder_scope(self) -> contextlib.AbstractContextManager[None]:
        """Launches inside go on the encoder stream, with the partition's programs per SM."""
        return self._scope(self.encoder_stream)

    def decoder_scope(self) -> contextlib.AbstractContextManager[None]:
        """Launches inside go on the decoder stream, with the partition's programs per SM."""
        return self._scope(self.decoder_stream)

    @property
    def budgets(self) -> tuple[int, int]:
        """(encoder SMs, decoder SMs): what a step run on this partition carries."""
        return self.encoder_sms, self.decoder_sms

    def describe(self) -> str:
        kind = "green" if self.green else "budgets"
        return f"encoder {self.encoder_sms} / decoder {self.decoder_sms} SMs ({kind})"


class PartitionSet:
    """The partitions of one device, created once: one per encoder split, plus `full`.

    `green`: None uses green contexts when available (else the logged fallback), False never
    does. `shared` makes a single partition in which both stages get the whole device on two
    ordinary streams (co-location without a partition, as under MPS). Raises ValueError for a
    split outside ``1..SMs - 1``. `probe` checks each green split as it is made (default
    `probe_partition`; it raises to refuse the split, which then falls back alone).
    """

    def __init__(self, device: torch.device | str, encoder_splits: Sequence[int] = (), *,
                 green: bool | None = None, programs_per_sm: int = 1,
                 shared: bool = False,
                 probe: Callable[[Partition, torch.device], Any] | None = None) -> None:
        self.device = torch.device(device)
        self.total = total = device_num_sms(self.device)
        for e in encoder_splits:
            if isinstance(e, bool) or not isinstance(e, int) or not 0 < e < total:
                raise ValueError(f"encoder_splits={list(encoder_splits)!r}: each split must be "
                                 f"an int in 1..{total - 1} (SMs of this device: {total})")
        require_int("programs_per_sm", programs_per_sm)
        splits = sorted(set(encoder_splits))
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.shared = shared
        self.reason: str | None = None
        self._probe = probe
        self._raw: list[tuple[str, Any]] = []
        self.upload_stream = self._new_stream()  # host-to-device copies of the encoder side
        self.full = self._plain(0, total, total)
        self.splits: dict[int, Partition] = {}
        self.current = self.full
        if shared:
            self.reason = "shared mode (no partition)"
            return
        why = "disabled" if green is False else self._support()
        if why is not None:
            self.reason = why
            _log_once("fallback", "green contexts unavailable (%s): SM partitions fall back "
                      "to kernel budgets alone (bounding how many SMs a stage uses, not "
                      "which)", why)
        for e in splits:
            self.splits[e] = self._plain(e, e, total - e, self.full) if why is not None \
                else self._checked_green(e, programs_per_sm)
        if why is None and splits and not self.green:
            self.reason = "every split was refused (see each split's reason)"

    def _support(self) -> str | None:
        """Why green contexts cannot be used here (None when they can)."""
        return green_context_support(self.device)

    def _checked_green(self, e: int, programs_per_sm: int) -> Partition:
        """Split `e` as a green partition that passed its probe, else its own fallback to
        budgets alone (whatever it made destroyed, the reason logged once and kept)."""
        part: Partition | None = None
        try:
            part = self._green(e, programs_per_sm)
            probe = self._probe
            if probe is None:
                from spaceserve.runtime.spatial.partition_probe import probe_partition as probe
            part.probe = probe(part, self.device)
            self._raw.extend(part._handles)
            return part
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            if part is not None and part._handles:
                torch.cuda.synchronize(self.device)
                destroy_handles(part._handles)
            _log_once(f"split-{e}", "split %d (encoder %d SMs requested): green partition "
                      "refused (%s); this split runs on kernel budgets alone", e, e, why)
            fallback = self._plain(e, e, self.total - e, self.full)
            fallback.reason = why
            return fallback

    @property
    def green(self) -> bool:
        """Whether any split is a green-context partition (each says so in `green`)."""
        return any(p.green for p in self.splits.values())

    def _new_stream(self) -> Any:
        if not self.cuda:
            return None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return stream

    def _plain(self, requested: int, enc: int, dec: int, like: Partition | None = None
               ) -> Partition:
        """A partition of budgets alone on ordinary streams (those of `like` when given: without
        green contexts every split shares one encoder and one decoder stream)."""
        if like is not None:
            return Partition(requested, enc, dec, False, like.encoder_stream, like.decoder_stream)
        return Partition(requested, enc, dec, False, self._new_stream(), self._new_stream())

    def _green(self, e: int, programs_per_sm: int) -> Partition:
        """Two green contexts (e SMs / the rest) with a stream each; budgets read back. On an
        error, what was made is destroyed before it propagates."""
        index = self.device.index if self.device.index is not None else \
            torch.cuda.current_device()
        handles: list[tuple[str, Any]] = []
        try:
            dev, whole = sm_resource(index)
            streams, counts = [], []
            for res in split_sm_resource(whole, e):
                ctx, raw, granted = green_context_stream(dev, res)
                handles += [("ctx", ctx), ("stream", raw)]
                stream = torch.cuda.get_stream_from_external(int(raw), self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                streams.append(stream)
                counts.append(granted)
            if min(counts) < 1 or sum(counts) > self.total:
                raise RuntimeError(f"the driver granted {counts[0]} + {counts[1]} SMs of "
                                   f"{self.total} (SM groups round up to the device's group "
                                   "size; the decoder needs SMs left)")
        except BaseException:
            if handles:
                torch.cuda.synchronize(self.device)
                destroy_handles(handles)
            raise
        return Partition(e, counts[0], counts[1], True, streams[0], streams[1], programs_per_sm,
                         _handles=handles)

    def close(self) -> None:
        """Destroy the green contexts and their streams (after the device is idle)."""
        if not self._raw:
            return
        torch.cuda.synchronize(self.device)
        destroy_handles(self._raw)
        self._raw = []

    # -- choosing and switching --------------------------------------------------------------
    def partitions(self) -> list[Partition]:
        """Every partition: full first, then the splits by encoder SMs."""
        return [self.full, *(self.splits[e] for e in sorted(self.splits))]

    def get(self, encoder_sms: int) -> Partition:
        """The partition of a requested split (0: full); ValueError for one not created."""
        if encoder_sms == 0 or self.shared:
            return self.full
        if encoder_sms not in self.splits:
            raise ValueError(f"encoder_sms={encoder_sms} is not a created split; splits: "
                             f"{sorted(self.splits)}")
        return self.splits[encoder_sms]

    def switch(self, target: Partition) -> Partition:
        """Make `target` current; its streams wait (on the device) for everything issued to the
        old partition's streams, so no work of two splits overlaps. Returns the old one."""
        old = self.current
        if target is old:
            return old
        same = (old.encoder_stream, old.decoder_stream) == (target.encoder_stream,
                                                            target.decoder_stream)
        sources = [] if same else [s for s in (old.encoder_stream, old.decoder_stream)
                                   if s is not None]
        if sources:
            events = []
            for s in sources:
                ev = torch.cuda.Event()
                ev.record(s)
                events.append(ev)
            for dst in {target.encoder_stream, target.decoder_stream} - {None}:
                for ev in events:
                    dst.wait_event(ev)
        self.current = target
        return old

    def _streams(self, attr: str) -> list[Any]:
        seen: list[Any] = []
        for p in self.partitions():
            s = getattr(p, attr)
            if s is not None and s not in seen:
                seen.append(s)
        return seen

    def decoder_streams(self) -> list[Any]:
        """Every distinct decoder stream (a hand-off is recorded on each)."""
        return self._streams("decoder_stream")

    def decoder_wait(self, event: Any) -> None:
        """Order every decoder stream after `event` on the device, without a host wait: what
        is launched on them next runs after the work before it. Without CUDA launches run in
        the order they are made."""
        if isinstance(event, torch.cuda.Event):
            for stream in self.decoder_streams():
                stream.wait_event(event)

    def encoder_streams(self) -> list[Any]:
        """Every distinct encoder stream (an upload is waited for on each)."""
        return self._streams("encoder_stream")

    @contextlib.contextmanager
    def staged(self) -> Iterator[Callable[[Any], Any]]:
        """Run set-up work for the encoder on the upload stream (CUDA only). Inside, pass the
        object holding what was made to the yielded function: on leaving, every encoder stream
        waits for the upload's event and its CUDA tensors are marked used on each (so the
        allocator keeps them until the encoder streams are done with them)."""
        made: list[Any] = []

        def done(obj: Any) -> Any:
            made.append(obj)
            return obj

        with torch.cuda.stream(self.upload_stream):
            yield done
            ready = torch.cuda.Event()
            ready.record()
        tensors = [t for obj in made for t in _device_tensors(obj)]
        for stream in self.encoder_streams():
            stream.wait_event(ready)
            for t in tensors:
                t.record_stream(stream)

    @contextlib.contextmanager
    def capture_scope(self, part: Partition) -> Iterator[None]:
        """Capture CUDA graphs for `part`'s decoder: its stream is the capture stream (a green
        graph stays bound to its partition) and its programs per SM apply."""
        if part.decoder_stream is None or not part.green:
            with part.decoder_scope():
                yield
            return
        graph_cls = torch.cuda.graph
        saved = getattr(graph_cls, "default_capture_stream", None)
        graph_cls.default_capture_stream = part.decoder_stream
        try:
            with part.decoder_scope():
                yield
        finally:
            graph_cls.default_capture_stream = saved

    def describe(self) -> dict[str, Any]:
        """Splits, granted budgets (the counts every launch gets), whether each is green, and
        why not or what its probe saw (for logs and benchmarks)."""
        splits: dict[int, dict[str, Any]] = {}
        for p in self.partitions():
            row: dict[str, Any] = {"encoder_sms": p.encoder_sms, "decoder_sms": p.decoder_sms,
                                   "green": p.green}
            if p.reason is not None:
                row["reason"] = p.reason
            if p.probe is not None:
                row["probe"] = p.probe
            splits[p.requested] = row
        return {"green": self.green, "fallback_reason": self.reason, "total_sms": self.total,
                "splits": splits}


def default_splits(total_sms: int, step: int = 8) -> tuple[int, ...]:
    """A small set of encoder splits: about a quarter, half and three quarters of the device,
    rounded to multiples of `step` (Hopper's SM group size), kept inside ``1..total - 1``."""
    out = set()
    for frac in (0.25, 0.5, 0.75):
        e = max(step, int(round(total_sms * frac / step)) * step)
        if e < total_sms:
            out.add(e)
    if not out and total_sms > 1:
        out.add(max(1, total_sms // 2))
    return tuple(sorted(out))
