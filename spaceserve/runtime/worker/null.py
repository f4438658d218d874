"""`NullModelRunner`: a deterministic stand-in model for engine tests and benchmarks.

Its "KV cache" stores one integer per token (the token id, or a value derived from an image
embedding) through the slot mapping, and its logits are a hash of the whole cached sequence read
back through the block table. Any bookkeeping error (a block shared by two live requests, a stale
or unwritten slot, a wrong image row) changes its outputs, which is what the engine's tests
check. `reference_generate` is the oracle: one request run alone over an unpaged sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spaceserve.checks import require_int
from spaceserve.runtime.core.batch import WHOLE_DEVICE, Budgets, ScheduledBatch
from spaceserve.runtime.core.request import MultiModalData, Request, SamplingParams
from spaceserve.runtime.sample.ops import M32, mix32, reference_next_token
from spaceserve.runtime.worker.model_info import ModelInfo
from spaceserve.runtime.worker.step_plan import StepLimits, StepPlanner

__all__ = ["NullEncodeJob", "NullModelRunner"]

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
                 encoder_layers: int = 4, video_token_id: int | None = None) -> None:
        self.info = ModelInfo(vocab_size, max_model_len, (eos_token_id,), image_token_id,
                              spatial_merge_size, patch_dim, video_token_id)
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
        require_int("encoder_layers", encoder_layers)
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

    def capture_decode_graphs(self, batch_sizes: Sequence[int], *,
                              partition: Budgets = WHOLE_DEVICE) -> tuple[int, ...]:
        assert self.planner is not None, "allocate_kv_cache first"
        sizes = tuple(s for s in self._graph_sizes if s <= self.planner.limits.max_num_seqs)
        self.planner.graph_batch_sizes = sizes
        return sizes

    def prepare_request(self, req: Request) -> None:
        req.model_state = None

    def encode(self, mms: Sequence[MultiModalData], *, num_sms: int | None = None
               ) -> list[torch.Tensor]:
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
        """(tokens, finish reason) of one request run alone over an unpaged sequence, every
        token picked by `sampling_ops.reference_next_token`: the oracle the engine's outputs
        are checked against (stop strings aside: no tokenizer here)."""
        embeds = self.encode([mm])[0] if mm is not None else None
        seq, out = list(token_ids), []
        eos = self.info.eos_token_ids
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        while True:
            logits = self.reference_logits(self.token_values(seq, mm, embeds))
            tok = reference_next_token(logits, params, seed, token_ids, out, eos)
            seq.append(tok)
            out.append(tok)
            if tok in stops and len(out) > params.min_tokens:
                return out, "stop"
            if len(out) >= params.max_tokens or len(seq) >= max_len:
                return out, "length"

    def execute(self, batch: ScheduledBatch, *, stage: str = "decoder") -> torch.Tensor:
        assert self.planner is not None and self.cache is not None, "allocate_kv_cache first"
        if batch.block_copies:  # copy on write of blocks shared by forked sequences
            blocks = self.cache.view(-1, self.block_size)
            src, dst = zip(*batch.block_copies, strict=True)
            blocks[list(dst)] = blocks[list(src)]
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
