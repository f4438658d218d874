"""Rank 0's side of the vision encoder in a tensor-parallel group (`TensorParallelRunner`'s
encoder methods).

``mm_encoder_tp_mode="data"`` (the default): the ViT is whole on every rank and each encoder
job (a request's media items that neither the encoder cache nor the prefix cache holds) is
encoded by one rank, its *owner*, which an encoder stage picks (`runtime/encoder/data_parallel.py`
balances the predicted work). Rank 0 checks the input first (a bad image never reaches a
worker), then sends the owner alone its pixels and commands, each numbered; rank 0's own images
run here, with no command to anyone. The owner's progress counter tells rank 0 when its work is
done (`group.RemoteEvent`, or for rank 0 the stage's own event); then `share_encoding` has every
rank take part in a broadcast from the owner on the decoder stream (`protocol.Share`), so each
rank holds the full embeddings for prefill. An encoding that failed on its owner is reported by
`share_encoding` (and in `encode`'s results) with the owner's message; nothing is broadcast.
A stage that knows nothing of ranks (`encoder_ranks`) encodes everything on rank 0, and a step
ships such embeddings to the workers through the pipe, as it does embeddings given with a
request: slower, never wrong.

``mm_encoder_tp_mode="replicate"``: every rank runs every encoder command on the same pixels
(the embeddings are then everywhere without a collective); kept as the reference.

Either way rank 0's encoder cache then splits a finished job's embeddings into one entry per
media item, and `split_encoding` has every rank do the same (`protocol.Split`): each entry's
rows live on every rank under the entry's key, readable after the job's broadcast, until
`release_encoding` drops them with rank 0's entry. A step names an item by its entry's key, so
an item found in the cache needs no encoder command and no broadcast on any rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spaceserve.runtime.core.request import MultiModalData
from spaceserve.runtime.encoder.data_parallel import EncodingFailed
from spaceserve.runtime.tp import protocol as P
from spaceserve.runtime.tp.group import RemoteEvent, TensorParallelError

MM_ENCODER_TP_MODES = ("data", "replicate")


@dataclass
class EncoderJob:
    """An encoder job on rank 0: the key the workers know its images by, the rank encoding
    them, rank 0's own job when that is rank 0 (else None), and the owner's progress."""

    key: int
    local: Any
    owner: int = 0
    num_tokens: int = 0
    layers_done: int = 0
    seq: int = 0  # the last command sent to a remote owner


class EncoderMethods:
    """The encoder half of `TensorParallelRunner` (module docstring). The runner provides
    `local`, `group`, `comms`, `size`, `mm_encoder_tp_mode` and the plumbing methods."""

    local: Any
    group: Any
    comms: dict[str, Any]
    size: int
    mm_encoder_tp_mode: str
    _seq: list[int]
    _owner_lock: Any
    _lock: Any  # guards _keys
    _keys: dict[int, tuple[int, Any]]  # id(job or entry) -> (workers' key, it)
    _dead: bool
    _ready: dict[int, Any]
    _shared: set[int]  # keys whose embeddings every rank holds (data-parallel)
    assigned: list[int]  # requests' images given to each rank to encode (data-parallel)

    @property
    def encoder_layers(self) -> int:
        return self.local.encoder_layers

    @property
    def encoder_ranks(self) -> int:
        """Ranks that encode images (the group's size when data-parallel, else 1)."""
        return self.size if self.mm_encoder_tp_mode == "data" else 1

    def _to_owner(self, rank: int, cmd: Any) -> int:
        """Send a numbered encoder command to worker `rank`; returns its number. Numbering and
        sending are one step (the engine thread and a thread driver both send), so a worker
        sees its commands in number order."""
        with self._owner_lock:
            self._seq[rank] += 1
            cmd.seq = self._seq[rank]
            self._send_to(rank, cmd)
        return cmd.seq

    # -- per-item embeddings (the encoder cache) ----------------------------------------------
    def split_encoding(self, job: MultiModalData, parts: Sequence[tuple[Any, int, int]]) -> None:
        """Rows ``lo..hi-1`` of `job`'s embeddings become those of each part's encoder-cache
        entry, on every rank (`Split`); the job's own key is dropped. Entries of a job every
        rank holds (shared from its data-parallel owner) are held everywhere too, readable
        after the same broadcast."""
        key = self._key(job, create=False)
        if key is None:
            return
        event, shared = self._ready.get(key), key in self._shared
        self._forget(job)
        if self._dead:
            return
        keys = [self._key(e) for e, _, _ in parts]
        for k in keys:
            if shared:
                self._shared.add(k)
            if event is not None:
                self._ready[k] = event
        try:
            self._send(P.Split(key, [(k, lo, hi) for k, (_, lo, hi) in zip(keys, parts,
                                                                              strict=True)]))
        except TensorParallelError:
            pass  # reported by the next call that needs the workers

    def release_encoding(self, obj: Any) -> None:
        """Forget the embeddings of a job (`MultiModalData`) or an encoder-cache entry on every
        rank (the job failed or was dropped; the entry is gone)."""
        if obj is None or self._dead:
            return
        key = self._forget(obj)
        if key is None:
            return
        try:
            self._send(P.Release([key]))
        except TensorParallelError:
            pass  # reported by the next call that needs the workers

    def _forget(self, obj: Any) -> int | None:
        """Drop `obj`'s key (and what rank 0 knows of its embeddings on the workers)."""
        with self._lock:
            entry = self._keys.get(id(obj))
            if entry is None or entry[1] is not obj:
                return None
            del self._keys[id(obj)]
            self._ready.pop(entry[0], None)
            self._shared.discard(entry[0])
            return entry[0]

    # -- whole images (the temporal stage) -------------------------------------------------------
    def encode(self, mms: Sequence[MultiModalData], ranks: Sequence[int] | None = None, *,
               num_sms: int | None = None) -> list[Any]:
        """Embeddings of each request's images, every launch under `num_sms` SMs. With `ranks`
        (data-parallel; one rank per request) each is encoded by its rank and shared (under
        the whole device: a temporal stage's); a failed one is an exception in its place.
        Without, every rank encodes every image (replicated)."""
        if ranks is None or self.encoder_ranks == 1:
            keys = [self._key(mm) for mm in mms]
            self._send(P.Encode(keys, [(mm.pixel_values, mm.image_grid_thw) for mm in mms],
                                num_sms))
            return self._run(self.local.encode, mms, num_sms=num_sms, fatal=False)
        if len(ranks) != len(mms) or any(not 0 <= r < self.size for r in ranks):
            raise ValueError(f"ranks={list(ranks)!r}: one rank in 0..{self.size - 1} per "
                             "request")
        out: list[Any] = [None] * len(mms)
        for i, mm in enumerate(mms):  # a bad image never reaches a worker
            try:
                self.local.check_encode(mm)
            except ValueError as exc:
                out[i] = exc
        keys = [self._key(mm) for mm in mms]
        for i, r in enumerate(ranks):
            if out[i] is None:
                self.assigned[r] += 1
        waits = {}
        for i, (mm, r) in enumerate(zip(mms, ranks, strict=True)):
            if out[i] is None and r != 0:
                seq = self._to_owner(r, P.Encode([keys[i]], [(mm.pixel_values,
                                                              mm.image_grid_thw)], num_sms))
                waits[r] = RemoteEvent(self.group, r, seq)
        for i, mm in enumerate(mms):
            if out[i] is None and ranks[i] == 0:
                try:
                    out[i] = self._run(self.local.encode, [mm], num_sms=num_sms,
                                       fatal=False)[0]
                except (ValueError, RuntimeError) as exc:
                    out[i] = exc
        for event in waits.values():
            event.synchronize()
        failed = self.group.encoder_failures()
        items = []
        for i, mm in enumerate(mms):
            if isinstance(out[i], Exception):
                continue
            if ranks[i] != 0 and keys[i] in failed:
                out[i] = EncodingFailed(f"image encoding failed on tensor-parallel "
                                        f"{failed.pop(keys[i])}")
                continue
            items.append((i, (keys[i], ranks[i], mm.num_tokens, out[i])))
        for (i, _), emb in zip(items, self._share([it for _, it in items]), strict=True):
            out[i] = emb
        return out

    # -- layer by layer (the spatial stage) ------------------------------------------------------
    def start_encode(self, mm: MultiModalData, pixel_values: torch.Tensor | None = None, *,
                     rank: int = 0) -> EncoderJob:
        """Set up `mm`'s job on `rank` (data-parallel; replicated: on every rank)."""
        if self.encoder_ranks == 1 or rank == 0:
            job = self._run(self.local.start_encode, mm, pixel_values, fatal=False)
            key = self._key(mm)
            if self.encoder_ranks == 1:
                self._send(P.StartEncode(key, mm.pixel_values, mm.image_grid_thw))
            else:
                self.assigned[0] += 1
            return EncoderJob(key, job, 0, mm.num_tokens)
        if not 0 < rank < self.size:
            raise ValueError(f"rank={rank} is outside 0..{self.size - 1}")
        self.local.check_encode(mm)
        self.assigned[rank] += 1
        key = self._key(mm)
        seq = self._to_owner(rank, P.StartEncode(key, mm.pixel_values, mm.image_grid_thw))
        return EncoderJob(key, None, rank, mm.num_tokens, seq=seq)

    def advance_encode(self, job: EncoderJob, layers: int, *, num_sms: int | None = None) -> int:
        if self.encoder_ranks == 1:
            self._send(P.AdvanceEncode(job.key, layers, num_sms))
        if job.owner == 0:
            return self._run(self.local.advance_encode, job.local, layers, num_sms=num_sms,
                             fatal=False)
        ran = max(0, min(layers, self.local.encoder_layers - job.layers_done))
        job.layers_done += ran
        job.seq = self._to_owner(job.owner, P.AdvanceEncode(job.key, ran, num_sms))
        return ran

    def finish_encode(self, job: EncoderJob, *, num_sms: int | None = None
                      ) -> torch.Tensor | None:
        """The embeddings (rank 0's job); None for another owner's (see `share_encoding`)."""
        if self.encoder_ranks == 1:
            self._send(P.FinishEncode(job.key, num_sms))
        if job.owner == 0:
            return self._run(self.local.finish_encode, job.local, num_sms=num_sms, fatal=False)
        job.seq = self._to_owner(job.owner, P.FinishEncode(job.key, num_sms))
        return None

    def encoder_event(self, job: EncoderJob) -> RemoteEvent | None:
        """An event completing when the work sent for a remote owner's job has run (None for
        rank 0's own job: its stage records one on its stream)."""
        return None if job.owner == 0 else RemoteEvent(self.group, job.owner, job.seq)

    def share_encoding(self, job: EncoderJob, embeds: torch.Tensor | None, *,
                       num_sms: int | None = None) -> torch.Tensor:
        """Every rank takes the finished embeddings of `job` from its owner (data-parallel; the
        job's event must have completed) on the decoder stream, under the decoder's budget
        `num_sms`; `embeds` is rank 0's result when it is the owner. Raises `EncodingFailed`
        with the owner's message when its encoding failed."""
        if self.encoder_ranks == 1:
            assert embeds is not None
            return embeds
        if job.owner != 0:
            failed = self.group.encoder_failures()
            if job.key in failed:
                raise EncodingFailed(f"image encoding failed on tensor-parallel "
                                     f"{failed.pop(job.key)}")
        elif embeds is None:
            raise EncodingFailed("image encoding on rank 0 gave no embeddings")
        return self._share([(job.key, job.owner, job.num_tokens, embeds)], num_sms)[0]

    def _share(self, items: list[tuple[int, int, int, torch.Tensor | None]],
               num_sms: int | None = None) -> list[torch.Tensor]:
        """Broadcast (key, owner, tokens, rank 0's embeddings or None) from each owner on
        the current (decoder) stream under the decoder's budget `num_sms`, every rank in the
        same order."""
        if not items:
            return []
        self._send(P.Share([(k, r, n) for k, r, n, _ in items], num_sms))
        return self._run(self._broadcast_all, items, num_sms)

    def _broadcast_all(self, items: list[tuple[int, int, int, torch.Tensor | None]],
                       budget: int | None) -> list[torch.Tensor]:
        model, out = self.local.model, []
        for key, owner, tokens, emb in items:
            if owner == 0:
                buf = emb.contiguous()
                if buf.is_cuda:
                    buf.record_stream(torch.cuda.current_stream(buf.device))
            else:
                buf = torch.empty((tokens, model.language.embed_width), dtype=model.dtype,
                                  device=self.local.device)
            self.comms["decoder"].broadcast(buf, owner, num_sms=budget)
            self._shared.add(key)
            if buf.is_cuda:
                event = torch.cuda.Event()
                event.record()
                self._ready[key] = event
            out.append(buf)
        return out

    def wait_shared(self, key: int, emb: torch.Tensor) -> None:
        """Make the current stream wait for the broadcast that brought `emb` (GPU)."""
        event = self._ready.get(key)
        if event is not None:
            stream = torch.cuda.current_stream(emb.device)
            stream.wait_event(event)
            emb.record_stream(stream)
