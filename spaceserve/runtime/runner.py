"""The model-runner protocol the engine drives, a generic step planner, and a null model.

The engine owns requests, KV bookkeeping and sampling; a `ModelRunner` owns weights, caches and
kernels. Per step the engine hands the runner a `ScheduledBatch` (host-side: which tokens of
which requests, their cached counts, their block ids) and gets logits back, one row per
``batch.sample_reqs`` entry. `StepPlanner` turns a batch into flat device metadata (token ids,
positions, slot mapping, block tables, ...) in preallocated buffers with vectorised host work,
padding pure-decode batches to a CUDA-graph bucket; runners may use it or plan their own way.

`NullModelRunner` is a deterministic stand-in: its "KV cache" stores one integer per token
(the token id, or a value derived from an image embedding) through the slot mapping, and its
logits are a hash of the whole cached sequence read back through the block table. Any
bookkeeping error (a block shared by two live requests, a stale or unwritten slot, a wrong
image row) changes its outputs, which is what the engine's tests check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .request import MultiModalData, Request, SamplingParams
from .sampler import M32, fold_seed, mix32, sample
from .scheduler import ScheduledBatch

__all__ = [
    "ModelInfo", "ModelRunner", "NullModelRunner", "PreemptibleEncoder", "StepLimits", "StepPlan",
    "StepPlanner",
]


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a model to validate and finish requests.

    `image_token_id` None means text only. `patch_dim` is the width of a ``pixel_values`` row
    (Qwen2-VL: 3 * 2 * 14 * 14 = 1176); one LLM image token covers ``spatial_merge_size ** 2``
    patches.
    """

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    image_token_id: int | None = None
    spatial_merge_size: int = 2
    patch_dim: int | None = None


@runtime_checkable
class ModelRunner(Protocol):
    """Weights, caches and kernels of one model, driven by the engine.

    Call order: `profile_peak_bytes` (weights already loaded) -> `allocate_kv_cache` ->
    `capture_decode_graphs` -> per request `prepare_request`, per image request `encode`
    (before its first prefill), per step `execute`. `execute` must not synchronise with the
    host; its logits rows follow ``batch.sample_reqs`` and have exactly ``info.vocab_size``
    columns.
    """

    info: ModelInfo
    device: torch.device

    def kv_block_bytes(self, block_size: int) -> int:
        """Device bytes of one KV block (every layer, K and V)."""
        ...

    def profile_peak_bytes(self, limits: StepLimits, max_encoder_tokens: int) -> int:
        """Peak activation bytes of the largest step and the largest encoder pass (0 on CPU)."""
        ...

    def allocate_kv_cache(self, num_blocks: int, limits: StepLimits) -> None:
        ...

    def capture_decode_graphs(self, batch_sizes: Sequence[int]) -> tuple[int, ...]:
        """Capture decode graphs for these batch sizes; returns the sizes captured (() when the
        runner runs eagerly). Pure-decode batches are then padded to the next captured size."""
        ...

    def prepare_request(self, req: Request) -> None:
        """Per-request precomputation (e.g. M-RoPE positions) into ``req.model_state``; raises
        ValueError for a prompt the model cannot take."""
        ...

    def encode(self, mms: Sequence[MultiModalData]) -> list[torch.Tensor]:
        """Image embeddings, one ``[mm.num_tokens, hidden]`` tensor per request, in order."""
        ...

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; logits ``[len(batch.sample_reqs), vocab]`` on the device."""
        ...


@runtime_checkable
class PreemptibleEncoder(Protocol):
    """Optional runner methods that let an encoder stage run a request's images layer by layer
    (the spatial stage preempts at layer boundaries); a runner without them is encoded whole.

    A job advanced in any chunking must give bitwise the embeddings of `ModelRunner.encode`.
    Runners that have them also take ``execute(batch, stage="encoder")``: the step under the
    encoder's SM budget (prefill placed in the compute partition) instead of the decoder's.
    """

    encoder_layers: int

    def start_encode(self, mm: MultiModalData, pixel_values: torch.Tensor | None = None) -> Any:
        """Validate `mm` (ValueError) and set up its job; `pixel_values` replaces
        ``mm.pixel_values`` (e.g. already uploaded to the device). Launches nothing heavy."""
        ...

    def advance_encode(self, job: Any, layers: int, *, num_sms: int | None = None) -> int:
        """Run up to `layers` more layers of `job`; returns how many ran."""
        ...

    def finish_encode(self, job: Any, *, num_sms: int | None = None) -> torch.Tensor:
        """The embeddings ``[mm.num_tokens, hidden]`` of a job advanced to its last layer."""
        ...


@dataclass(frozen=True)
class StepLimits:
    """Capacities fixed at start-up; the planner's buffers are sized from them."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_tokens(self) -> int:
        return max(self.max_num_batched_tokens, self.max_num_seqs)


@dataclass
class StepPlan:
    """Flat metadata of one step (layout as `spaceserve.models.context`): sequence ``i`` owns
    tokens ``query_start_loc[i] .. query_start_loc[i + 1] - 1``; padding sequences (seq_len 0,
    slot -1) follow the real ones when the batch was padded to a graph bucket, and get logits
    rows too (``num_logits`` counts the real ones). Tensors live on the runner's device and are
    views of the planner's fixed buffers, valid until its next plan; `host` holds numpy views of
    the same values and `context` the model-facing `StepContext` of the same step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, the token's index in its sequence (+ rope delta)
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    logits_indices: torch.Tensor  # [R] int64, token index of each logits row
    logits_seqs: torch.Tensor  # [R] int64, sequence of each logits row
    seq_lens: torch.Tensor  # [B] int32, cached + new (0 = padding)
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_tables: torch.Tensor  # [B, width] int32
    num_tokens: int
    num_seqs: int
    num_real_seqs: int
    num_decodes: int
    num_logits: int
    max_seqlen_q: int
    max_seqlen_k: int
    # The step's image-token pieces: token indices (host) and embedding rows (device) per
    # covered image span; gathered only by a runner that asks (`mm_index` / `mm_embeds`).
    mm_parts: tuple[list[np.ndarray], list[torch.Tensor]] = ((), ())
    host: dict[str, np.ndarray] = field(default_factory=dict)
    context: Any = None  # spaceserve.models.StepContext

    @property
    def mm_index(self) -> torch.Tensor | None:
        """[M] int64 token indices taking image embeddings (a host tensor), or None."""
        idx = self.mm_parts[0]
        return torch.from_numpy(np.concatenate(idx)) if len(idx) else None

    @property
    def mm_embeds(self) -> torch.Tensor | None:
        """[M, hidden] embedding rows for `mm_index`, or None."""
        emb = self.mm_parts[1]
        return torch.cat(emb) if len(emb) else None


class StepPlanner:
    """Turns a `ScheduledBatch` into a `StepPlan` through the models' `ContextPlanner`, the
    one planner (numpy into preallocated buffers, two non-blocking copies, the attention plan
    refilled in place).

    Block tables persist per sequence slot (``req.row``) and only newly allocated blocks are
    written, so a decode step costs a few numpy operations over the batch, not a Python loop
    per token or per block. `rope` maps a request to (its prompt's ``[3, L]`` M-RoPE positions
    or None, its rope delta) and is asked when the request takes its slot; without it
    positions are token indices. `backend` (an attention backend) gets its plan refilled for
    every step not padded for a graph. A stage running steps beside another one's (on another
    stream) takes a planner of its own with ``share_rows_with=`` the other's, so both see every
    request's slot state.
    """

    def __init__(self, limits: StepLimits, device: torch.device | str,
                 graph_batch_sizes: Sequence[int] = (), *, backend: Any = None,
                 rope: Callable[[Request], tuple[Any, int]] | None = None,
                 share_rows_with: StepPlanner | None = None) -> None:
        from spaceserve.models.context import ContextPlanner

        self.limits = limits
        self.device = torch.device(device)
        self.graph_batch_sizes = tuple(sorted(graph_batch_sizes))
        self.rope = rope
        self.core = ContextPlanner(limits.max_num_seqs, limits.max_tokens,
                                   limits.max_blocks_per_seq, limits.block_size,
                                   device=self.device, backend=backend,
                                   rows=share_rows_with.core if share_rows_with else None)
        self.table = self.core.table  # persistent block table per slot

    def plan(self, batch: ScheduledBatch, *, pad_to: int | None = None) -> StepPlan:
        """The plan of `batch`. A decode-only batch is padded to `pad_to` sequences, or else
        to the next of `graph_batch_sizes`, with block tables as wide as the limits allow and
        no attention plan (a graph replays its own)."""
        reqs, nd, nb = batch.reqs, batch.num_decodes, len(batch.reqs)
        core, table, rope = self.core, self.table, self.rope
        for r in reqs:
            k, s = len(r.block_ids), r.synced_blocks
            if k != s:
                if s == 0:  # the request (re)took its slot
                    mpos, delta = rope(r) if rope is not None else (None, 0)
                    core.set_row(r.row, rope_delta=delta, mrope_positions=mpos)
                table[r.row, s:k] = r.block_ids[s:]
                r.synced_blocks = k
        ids = [r.token_ids[-1] for r in reqs[:nd]]
        t = nd
        idx_parts: list[np.ndarray] = []
        emb_parts: list[torch.Tensor] = []
        for i in range(nd, nb):
            r, s, n = reqs[i], batch.num_cached[i], batch.num_new[i]
            ids += r.token_ids[s:s + n]
            mm = r.mm
            if mm is not None and mm.num_tokens:
                lo, hi = np.searchsorted(mm.positions, [s, s + n])
                if hi > lo:
                    idx_parts.append(mm.positions[lo:hi] - s + t)
                    emb_parts.append(mm.embeds[lo:hi])
            t += n
        buckets = self.graph_batch_sizes
        if pad_to is None and nd == nb and buckets and nb <= buckets[-1]:
            pad_to = next(x for x in buckets if x >= nb)
        graph = pad_to is not None
        ctx = core.plan([r.row for r in reqs], batch.num_cached, batch.num_new,
                        need_logits=None if nd == nb else batch.need_logits, input_ids=ids,
                        pad_seqs_to=pad_to,
                        width=self.limits.max_blocks_per_seq if graph else None,
                        plan_attention=not graph)
        h = ctx.host
        host = {"input_ids": h.input_ids, "positions": h.positions.numpy()[0],
                "slot_mapping": h.slot_mapping.numpy(), "logits_indices": h.logits_indices,
                "logits_seqs": h.logits_seqs, "seq_lens": h.seq_lens,
                "query_start_loc": h.cu_seqlens_q, "block_tables": h.block_tables}
        return StepPlan(ctx.input_ids, ctx.positions[0], ctx.slot_mapping, ctx.logits_indices,
                        ctx.logits_seqs, ctx.seq_lens, ctx.cu_seqlens_q, ctx.block_tables,
                        num_tokens=ctx.num_tokens, num_seqs=ctx.num_seqs, num_real_seqs=nb,
                        num_decodes=nd, num_logits=ctx.logits_indices.shape[0] - ctx.num_seqs + nb,
                        max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                        mm_parts=(idx_parts, emb_parts), host=host, context=ctx)


_P = (1 << 31) - 1


@dataclass
class NullEncodeJob:
    """A null-model encoder job: the request's images and how many layers have run."""

    mm: MultiModalData
    num_layers: int
    layers_done: int = 0


class NullModelRunner:
    """A model with no weights whose next-token logits are a hash of the cached sequence.

    ``check=False`` makes the logits depend on the newest token and its index only (no cache
    reads), which is what the step-time benchmark uses to measure the engine, not the model.
    `graph_batch_sizes` makes it pad pure-decode batches the way a graph-replaying runner
    does, so the padding path runs on CPU. An image whose pixels are not finite fails to
    encode (ValueError). The encoder is also preemptible (`PreemptibleEncoder`) over
    `encoder_layers` layers that do nothing but count (``num_encoder_layers_run``).
    """

    def __init__(self, *, vocab_size: int = 97, max_model_len: int = 4096,
                 eos_token_id: int = 0, image_token_id: int | None = 3,
                 spatial_merge_size: int = 2, patch_dim: int = 8, hidden: int = 4,
                 graph_batch_sizes: Sequence[int] = (), check: bool = True,
                 encoder_layers: int = 4) -> None:
        self.info = ModelInfo(vocab_size, max_model_len, (eos_token_id,), image_token_id,
                              spatial_merge_size, patch_dim)
        self.device = torch.device("cpu")
        self.hidden = hidden
        self.check = check
        self._graph_sizes = tuple(sorted(set(graph_batch_sizes)))
        self.planner: StepPlanner | None = None
        self.cache: torch.Tensor | None = None
        self.block_size = 0
        pos = torch.arange(max_model_len + 1, dtype=torch.int64)
        self._weights = (mix32(pos) & 0xFFFFF) + 1
        self._cols = mix32(torch.arange(vocab_size, dtype=torch.int64) * 0x2F0B3A49 & M32)
        self.num_executes = 0
        self.num_encoded = 0
        if isinstance(encoder_layers, bool) or not isinstance(encoder_layers, int) \
                or encoder_layers < 1:
            raise ValueError(f"encoder_layers={encoder_layers!r} must be an int >= 1")
        self.encoder_layers = encoder_layers
        self.num_encoder_layers_run = 0

    def kv_block_bytes(self, block_size: int) -> int:
        return 8 * block_size

    def profile_peak_bytes(self, limits: StepLimits, max_encoder_tokens: int) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks: int, limits: StepLimits) -> None:
        self.block_size = limits.block_size
        self.cache = torch.full((num_blocks * limits.block_size,), -1, dtype=torch.int64)
        self.planner = StepPlanner(limits, self.device)

    def capture_decode_graphs(self, batch_sizes: Sequence[int]) -> tuple[int, ...]:
        assert self.planner is not None, "allocate_kv_cache first"
        sizes = tuple(s for s in self._graph_sizes if s <= self.planner.limits.max_num_seqs)
        self.planner.graph_batch_sizes = sizes
        return sizes

    def prepare_request(self, req: Request) -> None:
        req.model_state = None

    def encode(self, mms: Sequence[MultiModalData]) -> list[torch.Tensor]:
        out = []
        group = self.info.spatial_merge_size ** 2
        for mm in mms:
            pv = mm.pixel_values.to(torch.float64)
            if not torch.isfinite(pv).all():
                raise ValueError("image holds non-finite pixel values")
            per_token = pv.reshape(-1, group * pv.shape[-1]).sum(dim=1)
            value = torch.remainder(torch.round(per_token * 1000), 1 << 20)
            emb = value.to(torch.float32)[:, None] + torch.arange(self.hidden)[None, :]
            out.append(emb)
            self.num_encoded += 1
        return out

    def start_encode(self, mm: MultiModalData, pixel_values: torch.Tensor | None = None
                     ) -> NullEncodeJob:
        pv = mm.pixel_values if pixel_values is None else pixel_values
        if not torch.isfinite(pv).all():
            raise ValueError("image holds non-finite pixel values")
        return NullEncodeJob(mm, self.encoder_layers)

    def advance_encode(self, job: NullEncodeJob, layers: int, *, num_sms: int | None = None
                       ) -> int:
        steps = max(0, min(layers, job.num_layers - job.layers_done))
        job.layers_done += steps
        self.num_encoder_layers_run += steps
        return steps

    def finish_encode(self, job: NullEncodeJob, *, num_sms: int | None = None) -> torch.Tensor:
        if job.layers_done != job.num_layers:
            raise ValueError(f"job has run {job.layers_done} of {job.num_layers} layers")
        return self.encode([job.mm])[0]

    def token_values(self, token_ids: Sequence[int], mm: MultiModalData | None = None,
                     embeds: torch.Tensor | None = None) -> torch.Tensor:
        """What the cache holds for a whole sequence (the reference for tests)."""
        vals = torch.tensor(list(token_ids), dtype=torch.int64)
        if mm is not None and embeds is not None:
            idx = torch.from_numpy(mm.positions).long()
            vals[idx] = self.info.vocab_size + embeds[:, 0].long()
        return vals

    def logits_from_hash(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, vocab]`` in [0, 8) from per-sequence 31-bit hashes ``[S]``."""
        bits = mix32(h[:, None] ^ self._cols[None, :])
        return (bits >> 8).to(torch.float32) * (8.0 / (1 << 24))

    def reference_logits(self, values: torch.Tensor) -> torch.Tensor:
        """Logits ``[vocab]`` for a full sequence of cache values (no paging involved)."""
        n = values.shape[0]
        if not self.check:
            h = (values[-1] * 0x9E37 + n) % _P
            return self.logits_from_hash(h.view(1))[0]
        h = (values * self._weights[:n]).sum() % _P
        return self.logits_from_hash(h.view(1))[0]

    def reference_generate(self, token_ids: Sequence[int], mm: MultiModalData | None,
                           params: SamplingParams, seed: int, max_len: int
                           ) -> tuple[list[int], str]:
        """(tokens, finish reason) of one request run alone over an unpaged sequence: the
        oracle the engine's outputs are checked against."""
        embeds = self.encode([mm])[0] if mm is not None else None
        seq, out = list(token_ids), []
        eos = set(self.info.eos_token_ids)
        scalars = (torch.tensor([params.temperature]), torch.tensor([params.top_p]),
                   torch.tensor([fold_seed(seed)]))
        while True:
            logits = self.reference_logits(self.token_values(seq, mm, embeds))[None]
            tok = int(sample(logits, *scalars, torch.tensor([len(seq)]),
                             use_top_p=params.top_p < 1.0)[0])
            seq.append(tok)
            out.append(tok)
            if (tok in eos and not params.ignore_eos) or tok in params.stop_token_ids:
                return out, "stop"
            if len(out) >= params.max_tokens or len(seq) >= max_len:
                return out, "length"

    def execute(self, batch: ScheduledBatch, *, stage: str = "decoder") -> torch.Tensor:
        assert self.planner is not None and self.cache is not None, "allocate_kv_cache first"
        plan = self.planner.plan(batch)
        self.num_executes += 1
        t, s = plan.num_tokens, plan.num_logits
        vals = plan.input_ids[:t]
        mm_index = plan.mm_index
        if mm_index is not None:
            vals = vals.clone()
            vals[mm_index.to(vals.device)] = self.info.vocab_size + plan.mm_embeds[:, 0].long()
        slots = plan.slot_mapping[:t]
        keep = slots >= 0
        self.cache[slots[keep]] = vals[keep]
        seqs = plan.logits_seqs[:s]
        lens = plan.seq_lens[seqs].long()
        if not self.check:
            last = vals[plan.logits_indices[:s]]
            return self.logits_from_hash((last * 0x9E37 + lens) % _P)
        width = plan.max_seqlen_k
        pos = torch.arange(width, dtype=torch.int64)
        inside = pos[None, :] < lens[:, None]
        table = plan.block_tables[seqs].long()
        col = (pos // self.block_size).clamp(max=table.shape[1] - 1)
        slot = table[:, col] * self.block_size + pos % self.block_size
        cached = torch.where(inside, self.cache[slot.clamp(min=0)], 0)
        if bool((cached[inside] < 0).any()):
            raise AssertionError("a sequence read a KV slot that was never written")
        h = (cached * self._weights[None, :width]).sum(dim=1) % _P
        return self.logits_from_hash(h)
