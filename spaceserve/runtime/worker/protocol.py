"""The model-runner protocol the engine drives, and where its parts live.

The engine owns requests, KV bookkeeping and sampling; a `ModelRunner` owns weights, caches and
kernels. Per step the engine hands the runner a `ScheduledBatch` (host-side: which tokens of
which requests, their cached counts, their block ids) and gets logits back, one row per
``batch.sample_reqs`` entry. `PreemptibleEncoder` is the optional part that lets an encoder stage
run images layer by layer.

Re-exported here, the public surface of runners: `ModelInfo` (`model_info.py`), `StepLimits`,
`StepPlan` and the generic `StepPlanner` (`step_plan.py`). The deterministic test double,
`NullModelRunner`, lives in `null.py` beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from spaceserve.runtime.core.batch import WHOLE_DEVICE, Budgets, ScheduledBatch
from spaceserve.runtime.core.request import MultiModalData, Request
from spaceserve.runtime.worker.model_info import ModelInfo
from spaceserve.runtime.worker.step_plan import StepLimits, StepPlan, StepPlanner

__all__ = [
    "ModelInfo", "ModelRunner", "PreemptibleEncoder",
    "StepLimits", "StepPlan", "StepPlanner",
]


@runtime_checkable
class ModelRunner(Protocol):
    """Weights, caches and kernels of one model, driven by the engine.

    Call order: `profile_peak_bytes` (weights already loaded) -> `allocate_kv_cache` ->
    `capture_decode_graphs` -> per request `prepare_request`, per image request `encode`
    (before its first prefill), per step `execute`. `execute` must not synchronise with the
    host; its logits rows follow ``batch.sample_reqs`` and have exactly ``info.vocab_size``
    columns.

    SM budgets travel with the work, never as runner state: a step runs under the budget of
    its stage in ``batch.partition`` (`ScheduledBatch.num_sms`), graphs are captured for the
    decoder budget of the partition given, and encoder calls take theirs as ``num_sms``
    (None: the whole device).
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

    def capture_decode_graphs(self, batch_sizes: Sequence[int], *,
                              partition: Budgets = WHOLE_DEVICE) -> tuple[int, ...]:
        """Capture decode graphs for these batch sizes under the decoder budget of `partition`;
        returns the sizes captured (() when the runner runs eagerly). Pure-decode batches are
        then padded to the next captured size."""
        ...

    def prepare_request(self, req: Request) -> None:
        """Per-request precomputation (e.g. M-RoPE positions) into ``req.model_state``; raises
        ValueError for a prompt the model cannot take."""
        ...

    def encode(self, mms: Sequence[MultiModalData], *, num_sms: int | None = None
               ) -> list[torch.Tensor]:
        """Image embeddings, one ``[mm.num_tokens, width]`` tensor per request, in order, each
        launch under `num_sms` SMs (width: the hidden size; Qwen3-VL appends its DeepStack
        features, ``(1 + taps) * hidden``)."""
        ...

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step under ``batch.num_sms("decoder")``; logits
        ``[len(batch.sample_reqs), vocab]`` on the device."""
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
        """The rows ``[mm.num_tokens, width]`` of a job advanced to its last layer (as
        `encode`'s)."""
        ...
