"""The Qwen2-VL model runner: `spaceserve.models.Qwen2VL` behind the engine's runner protocol.

Per step the engine's `ScheduledBatch` becomes the model's step context through one
preallocated planner (`runner.StepPlanner` over `models.context.ContextPlanner`: M-RoPE
positions sliced from each prompt's precomputed table, rope deltas after it, the flattened
token ids), plus the embedding rows of the image and video tokens the step covers, in token
order. A request's images and videos are one encoder job (a video is an item of t temporal
patches; the vision tower attends within each of them).
Decode-only steps replay the CUDA graph of the smallest captured (batch size, block-table width)
bucket that holds them (`models.cuda_graph.DecodeGraphSet`: one shared memory pool, a bound on
graph memory); the graphs are captured on the planner's own buffers, so a replay copies
nothing.
Images are encoded one request at a time, so a request's embeddings never depend on which
other requests arrived with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spaceserve.runtime.core.batch import WHOLE_DEVICE, Budgets, ScheduledBatch
from spaceserve.runtime.core.memory import kv_block_bytes
from spaceserve.runtime.core.request import MultiModalData, Request
from spaceserve.runtime.worker.model_info import ModelInfo
from spaceserve.runtime.worker.step_plan import StepInputs, StepLimits, StepPlanner

# Where media-token embedding rows come from: (source, lo, hi), see `image_pieces`: a media
# item's encoder-cache entry (`encoder_cache.CacheEntry`) and rows of it.
ImagePiece = tuple[Any, int, int]


@dataclass
class PreparedStep:
    """A step after its host half (`Qwen2VLRunner.prepare_step`): the stage and budget it runs
    under (the batch's, of the partition in `partition`), the captured batch size it replays
    (None: eager; the graph's table width is ``inputs.width``), its planner inputs and image
    pieces. Everything but the pieces' sources is plain data another process can run."""

    stage: str
    budget: int | None
    graph: int | None
    inputs: StepInputs
    pieces: list[ImagePiece]
    partition: Budgets = WHOLE_DEVICE


def _eos_ids(config: Any, path: str | None) -> tuple[int, ...]:
    """EOS ids from the generation config when present, else from the text config."""
    ids: Any = None
    if path is not None:
        try:
            from transformers import GenerationConfig

            ids = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
        except (OSError, ValueError):
            ids = None
    if ids is None:
        ids = getattr(config.text_config, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids]))


class Qwen2VLRunner:
    """Runs a loaded `Qwen2VL` for the engine (see `ModelRunner` for the call order)."""

    def __init__(self, model: Any, *, eos_token_ids: Sequence[int] | None = None,
                 path: str | None = None) -> None:
        self.model = model
        self.device = torch.device(model.device)
        cfg = model.config
        tcfg, vcfg = cfg.text_config, cfg.vision_config
        eos = tuple(eos_token_ids) if eos_token_ids is not None else _eos_ids(cfg, path)
        self.info = ModelInfo(
            vocab_size=int(tcfg.vocab_size),
            max_model_len=int(getattr(tcfg, "max_position_embeddings", 32768)),
            eos_token_ids=eos,
            image_token_id=int(cfg.image_token_id),
            spatial_merge_size=int(vcfg.spatial_merge_size),
            patch_dim=int(vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2),
            video_token_id=None if getattr(cfg, "video_token_id", None) is None
            else int(cfg.video_token_id),
        )
        self._media_ids = np.array([t for t in (self.info.image_token_id,
                                                self.info.video_token_id) if t is not None])
        self._media_set = frozenset(self._media_ids.tolist())
        lm = model.language
        self._lm_shape = (lm.num_layers, lm.num_kv_heads, lm.head_dim)
        self.kv: Any = None
        self.limits: StepLimits | None = None
        self.planner: StepPlanner | None = None
        self._encoder_planner: StepPlanner | None = None  # prefills on the encoder's stream
        # No SM budget is kept here: a step runs under the one its batch carries, an encoder
        # call under its `num_sms`.
        self.graphs: Any = ()  # DecodeGraphSet once allocate_kv_cache ran: keys (b, width, sms)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, attention_backend: str = "triton",
                        dtype: Any = None, device: Any = None) -> Qwen2VLRunner:
        from spaceserve.models import from_pretrained

        model = from_pretrained(path, attention_backend=attention_backend, dtype=dtype,
                                device=device)
        return cls(model, path=os.fspath(path))

    def kv_block_bytes(self, block_size: int) -> int:
        layers, heads, dim = self._lm_shape
        return kv_block_bytes(layers, heads, dim, block_size, self.model.dtype)

    def profile_peak_bytes(self, limits: StepLimits, max_encoder_tokens: int) -> int:
        """Peak extra memory of the largest prefill step and the largest encoder pass, run
        once on dummy inputs (CUDA only; 0 elsewhere)."""
        if self.device.type != "cuda":
            return 0
        model, bs = self.model, limits.block_size
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        t = limits.max_num_batched_tokens
        cache = model.allocate_kv_cache(-(-t // bs), bs)
        cache_bytes = torch.cuda.memory_allocated(self.device) - base
        ctx = model.plan_step([0], [t], [list(range(-(-t // bs)))], block_size=bs)
        model.forward(torch.zeros(t, dtype=torch.long, device=self.device), ctx, cache)
        del cache, ctx
        merge = self.info.spatial_merge_size
        patches = max_encoder_tokens * merge * merge
        pv = torch.zeros(patches, self.info.patch_dim, dtype=model.dtype, device=self.device)
        model.encode_images(pv, [[1, merge, merge * max_encoder_tokens]])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - cache_bytes
        torch.cuda.empty_cache()
        return max(0, int(peak))

    def allocate_kv_cache(self, num_blocks: int, limits: StepLimits) -> None:
        self.limits = limits
        self.kv = self.model.allocate_kv_cache(num_blocks, limits.block_size)
        self.planner = StepPlanner(limits, self.device, backend=self.model.backend,
                                   rope=lambda req: req.model_state)
        self._encoder_planner = None
        from spaceserve.models import DecodeGraphSet

        self.graphs = DecodeGraphSet(self.model, self.kv, (), limits.graph_table_widths,
                                     planner=self.planner.core,
                                     max_bytes=limits.graph_memory_bytes)

    def capture_decode_graphs(self, batch_sizes: Sequence[int], *,
                              partition: Budgets = WHOLE_DEVICE) -> tuple[int, ...]:
        """Capture decode graphs for the decoder budget of `partition` (CUDA only): every batch
        size in `batch_sizes` (up to `max_num_seqs`) x every table width of the limits."""
        if self.device.type != "cuda" or self.limits is None:
            return ()
        if not self.model.backend.graph_capturable:  # decode runs eagerly with this backend
            return ()
        sizes = tuple(sorted({b for b in batch_sizes if b <= self.limits.max_num_seqs}))
        graphs = self.graphs
        if sizes != graphs.batch_sizes:
            if len(graphs):
                raise ValueError(f"decode graphs were captured for batch sizes "
                                 f"{graphs.batch_sizes}, not {sizes}")
            graphs.batch_sizes = sizes
        return graphs.capture(partition[1])

    def prepare_request(self, req: Request) -> None:
        mm = req.mm
        if mm is None or not mm.num_videos:
            grid = mm.image_grid_thw if mm is not None else None
            req.model_state = self.model.mrope_positions(req.prompt_token_ids, grid)
            return
        req.model_state = self.model.mrope_positions(
            req.prompt_token_ids, mm.grid_of("image"), video_grid_thw=mm.grid_of("video"),
            second_per_grid_ts=list(mm.second_per_grid_ts))

    def encode(self, mms: Sequence[MultiModalData], *, num_sms: int | None = None
               ) -> list[torch.Tensor]:
        out = []
        for mm in mms:
            pv = mm.pixel_values.to(device=self.device, dtype=self.model.dtype)
            out.append(self.model.encode_images(pv, mm.image_grid_thw, num_sms=num_sms))
        return out

    # Preemptible encoding (the spatial encoder stage runs a request's images layer by layer).

    @property
    def encoder_layers(self) -> int:
        return int(self.model.vision.num_layers)

    def start_encode(self, mm: MultiModalData, pixel_values: torch.Tensor | None = None) -> Any:
        """Set up `mm`'s encoder job (validates; ValueError). `pixel_values` may already be on
        the device (uploaded on the encoder stream); it is cast to the model's dtype there."""
        pv = mm.pixel_values if pixel_values is None else pixel_values
        pv = pv.to(device=self.device, dtype=self.model.dtype, non_blocking=True)
        return self.model.vision.start(pv, mm.image_grid_thw)

    def check_encode(self, mm: MultiModalData) -> None:
        """What `start_encode` refuses (ValueError), without setting anything up: the check a
        tensor-parallel rank 0 runs on images another rank encodes."""
        self.model.vision.check(mm.pixel_values, mm.image_grid_thw)

    def advance_encode(self, job: Any, layers: int, *, num_sms: int | None = None) -> int:
        return self.model.vision.advance(job, layers, num_sms=self.model._budget(num_sms))

    def finish_encode(self, job: Any, *, num_sms: int | None = None) -> torch.Tensor:
        return self.model.vision.finish(job, num_sms=self.model._budget(num_sms))

    def image_pieces(self, batch: ScheduledBatch, ids: np.ndarray) -> list[ImagePiece]:
        """Where the embedding row of each image- or video-token id among the step's token ids
        `ids` comes from, in token order: rows ``lo..hi-1`` of one media item's embeddings
        (source: its encoder-cache entry), or, for media-token ids the model generated (plain
        text then), ``hi`` copies of token ``lo``'s own embedding row (source None). A decode's
        token is its entry of `ids` (its input, which may have been read from the device)."""
        if not np.isin(ids, self._media_ids).any():
            return []
        pieces: list[ImagePiece] = []
        nd = batch.num_decodes
        for i, (req, s, n) in enumerate(zip(batch.reqs, batch.num_cached, batch.num_new,
                                            strict=True)):
            p, mm = req.num_prompt_tokens, req.mm
            if mm is not None and s < p:
                lo, hi = np.searchsorted(mm.positions, [s, min(s + n, p)])
                if hi > lo:
                    pieces += mm.pieces(int(lo), int(hi))
            if s + n > p:
                for tok in [int(ids[i])] if i < nd else req.token_ids[max(s, p):s + n]:
                    if tok not in self._media_set:
                        continue
                    if pieces and pieces[-1][0] is None and pieces[-1][1] == tok:
                        pieces[-1] = (None, tok, pieces[-1][2] + 1)  # a run of the same token
                    else:
                        pieces.append((None, tok, 1))
        return pieces

    def image_rows(self, pieces: Sequence[ImagePiece],
                   embeds_of: Callable[[Any], torch.Tensor] | None = None
                   ) -> torch.Tensor | None:
        """The embedding rows of `pieces` (see `image_pieces`) in one tensor, or None;
        `embeds_of(source)` gives a source's embeddings (default: ``source.tensor``)."""
        if not pieces:
            return None
        rows: list[torch.Tensor] = []
        for src, lo, hi in pieces:
            if src is None:  # `hi` generated copies of media token `lo`
                row = self.model.language.media_token_rows[lo]
                rows.append(row.expand(hi, row.shape[0]))
            else:
                rows.append((embeds_of(src) if embeds_of is not None else src.tensor)[lo:hi])
        return torch.cat(rows)

    def prepare_step(self, batch: ScheduledBatch, *, stage: str = "decoder") -> PreparedStep:
        """The host half of `execute`: the stage's budget (the batch's), the graph a
        decode-only step replays (None: eager), the planner's `StepInputs` (row state written)
        and the image pieces."""
        assert self.kv is not None and self.planner is not None, "allocate_kv_cache first"
        budget = batch.num_sms(stage)  # ValueError for an unknown stage
        nb, graph = batch.num_seqs, None
        width = None
        if batch.num_decodes == nb and stage == "decoder" and len(self.graphs):
            found = self.graphs.pick(nb, self.planner.decode_need(batch), budget)
            if found is not None:
                graph, width = found.batch_size, found.max_blocks_per_seq
        inputs = self._planner(stage).prepare(batch, pad_to=graph, width=width)
        pieces: list[ImagePiece] = []
        if graph is None and inputs.input_ids is not None:
            pieces = self.image_pieces(batch, inputs.input_ids)
            if pieces and inputs.pending:
                # A decode input still on the device may be a media token, which must get its
                # own row among the embeddings: read the pending inputs back (a sync, only in
                # steps that also carry media embeddings) and plan them as known tokens.
                table, slots = inputs.source
                idx = torch.tensor(inputs.pending, dtype=torch.int64)
                real = table.index_select(0, slots.index_select(0, idx.to(slots.device)))
                inputs.input_ids[idx.numpy()] = real.cpu().numpy()
                inputs.pending, inputs.source = [], None
                pieces = self.image_pieces(batch, inputs.input_ids)
        return PreparedStep(stage, budget, graph, inputs, pieces, batch.partition)

    def _planner(self, stage: str) -> StepPlanner:
        assert self.planner is not None, "allocate_kv_cache first"
        if stage == "decoder":
            return self.planner
        if self._encoder_planner is None:  # may run beside a decoder step: buffers of its own
            self._encoder_planner = StepPlanner(
                self.limits, self.device, backend=self.model.backend, rope=self.planner.rope,
                share_rows_with=self.planner)
        return self._encoder_planner

    def run_step(self, step: PreparedStep, *, embeds_of: Callable[[Any], torch.Tensor] |
                 None = None, comm: Any = None, apply_sync: bool = False) -> torch.Tensor:
        """The device half of `execute`: plan the prepared step (after applying its row-state
        changes when `apply_sync`: a step prepared by another process) and run it, replaying
        its graph or eagerly under its budget (`comm`: the stage's communicator, TP only; it
        also brings every rank the decode inputs rank 0 took from its device)."""
        planner = self._planner(step.stage)
        if apply_sync:
            planner.apply(step.inputs.sync)
        ctx = planner.plan_inputs(step.inputs).context
        if step.inputs.block_copies is not None:  # copy on write, before anything is stored
            self.kv.copy_blocks(step.inputs.block_copies)
        if step.inputs.pending and comm is not None:  # rank 0's device inputs to every rank
            comm.broadcast(ctx.input_ids[:step.inputs.num_decodes], 0, num_sms=step.budget)
        if step.graph is not None:  # the graph captured the planner's buffers: nothing to copy
            width = step.inputs.width
            graph = self.graphs.graphs.get((step.graph, width, step.budget)) \
                if len(self.graphs) else None
            if graph is None:
                raise RuntimeError(f"no decode graph of batch {step.graph} x {width} blocks "
                                   f"for budget {step.budget}")
            return graph.replay(ctx.input_ids, ctx)
        embeds = self.image_rows(step.pieces, embeds_of)
        return self.model.forward(ctx.input_ids, ctx, self.kv, image_embeds=embeds,
                                  num_sms=step.budget, comm=comm)

    def execute(self, batch: ScheduledBatch, *, stage: str = "decoder") -> torch.Tensor:
        """One step under the decoder's budget of the batch's partition, or under the encoder's
        with ``stage="encoder"`` (prefill placed in the compute partition; never a graph)."""
        return self.run_step(self.prepare_step(batch, stage=stage))
