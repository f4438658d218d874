"""The names the settings take: engine modes, prefill placements, encoder drivers, SIS
objectives. A leaf (imports nothing of SpaceServe), shared by `EngineConfig`, the engine, the
simulator and the command lines, so each list is written once."""

from __future__ import annotations

from enum import Enum


class Mode(str, Enum):
    """How the vision encoder and the LLM decoder share the GPU.

    ``temporal``: whole encoder passes on the whole GPU inside the step (vLLM / SGLang);
    ``temporal-chunked``: encoder layer chunks on the whole GPU for a bounded window before each
    decode step (Sarathi-style); ``shared``: two streams, no partition (MPS-like);
    ``spatial-static``: a fixed SM split; ``spatial``: SIS chooses the split online.
    """

    TEMPORAL = "temporal"
    TEMPORAL_CHUNKED = "temporal-chunked"
    SHARED = "shared"
    SPATIAL_STATIC = "spatial-static"
    SPATIAL = "spatial"

    @property
    def is_temporal(self) -> bool:
        """The encoder takes turns with the decoder on the whole GPU."""
        return self in (Mode.TEMPORAL, Mode.TEMPORAL_CHUNKED)

    @property
    def is_colocated(self) -> bool:
        """Encoder and decoder run at the same time (streams, SM partitions)."""
        return not self.is_temporal

    @classmethod
    def of(cls, name: str | Mode) -> Mode:
        """The mode named `name`; ValueError lists the modes."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"mode={name!r} is not available; modes: {', '.join(MODES)}") \
                from None

    def __str__(self) -> str:
        return self.value


MODES: tuple[str, ...] = tuple(m.value for m in Mode)
TEMPORAL_MODES: tuple[str, ...] = tuple(m.value for m in Mode if m.is_temporal)
COLOCATED_MODES: tuple[str, ...] = tuple(m.value for m in Mode if m.is_colocated)
# where a prompt's prefill runs in the co-located modes ("auto": SIS decides in ``spatial``)
PLACEMENTS: tuple[str, ...] = ("auto", "compute", "decode")
PARTITIONS: tuple[str, ...] = ("compute", "decode")  # the placements SIS chooses between
DRIVERS: tuple[str, ...] = ("cooperative", "thread")  # how the encoder stage is launched
OBJECTIVES: tuple[str, ...] = ("goodput", "tpot")  # what SIS maximises
SIS_ACTIONS: tuple[str, ...] = ("share", "superset")  # pure sharing; + whole-GPU encoder windows
ENCODER_POLICIES: tuple[str, ...] = ("twsrft", "fifo")  # temporal-chunked's encoder order
# what happens to a request that cannot meet its TTFT bound: queue it anyway (vLLM), or refuse
# it at once with a Retry-After (SLO-aware admission, policy/admission.py)
ADMISSIONS: tuple[str, ...] = ("queue", "slo")
