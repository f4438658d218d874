"""`ScheduledBatch`: one step's work as the scheduler hands it to the runner (the one type the
worker needs from the scheduler, so step planning does not depend on the scheduling logic)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spaceserve.runtime.core.request import Request

# The SM budgets of the partition a step runs on: (encoder SMs, decoder SMs), None meaning the
# whole device. A step runs under its stage's entry; CUDA graphs are keyed by the decoder's.
Budgets = tuple[int | None, int | None]
WHOLE_DEVICE: Budgets = (None, None)
STAGES = ("encoder", "decoder")


@dataclass
class ScheduledBatch:
    """One step's work, in batch order: single-token (decode) sequences first, then prefill
    chunks. Sequence ``i`` computes tokens ``num_cached[i] .. num_cached[i] + num_new[i] - 1``
    of ``reqs[i].token_ids``; `sample_reqs` (batch order) are those whose last new token ends
    their known tokens, so a next token is drawn for each."""

    reqs: list[Request] = field(default_factory=list)
    num_cached: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    need_logits: list[bool] = field(default_factory=list)
    sample_reqs: list[Request] = field(default_factory=list)
    num_decodes: int = 0
    num_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    # KV blocks to copy (source, destination) before the step runs (copy on write)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # sequences forked this step: (row of `sample_reqs` whose logits they draw from, sequence)
    forks: list[tuple[int, Request]] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # decodes whose input is on the device
    # requests given KV blocks (or a slot) this step; None: unknown, look at every request
    grown: list[Request] | None = None
    admissions: int = 0  # the scheduler's admission count when it was scheduled
    input_source: Any = None  # (last-token table, slots of the decodes): set by the engine
    # the partition the step runs on (set by a co-located mode's step; the temporal modes run
    # on the whole device): the runner takes the budget of the step's stage from here
    partition: Budgets = WHOLE_DEVICE

    @property
    def num_seqs(self) -> int:
        return len(self.reqs)

    @property
    def drawn_reqs(self) -> list[Request]:
        """Every request drawing a token this step: `sample_reqs`, then the forked sequences."""
        if not self.forks:
            return self.sample_reqs
        return self.sample_reqs + [child for _, child in self.forks]

    def num_sms(self, stage: str = "decoder") -> int | None:
        """The SM budget `stage` ("encoder" or "decoder") runs this step under (None: the
        whole device); ValueError for another stage."""
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r} must be 'decoder' or 'encoder'")
        return self.partition[STAGES.index(stage)]

    def __bool__(self) -> bool:
        return bool(self.reqs)
