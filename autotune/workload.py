"""What the profiler times: one unit of each stage's work under an SM budget.

A `Workload` prepares, per grid point, a `StageRun` whose ``run(num_sms)`` executes one unit of
a stage (one encoder pass over a batch of ``patches`` ViT tokens, one prefill chunk of
``tokens`` after ``context`` cached tokens, one decode step of ``batch`` sequences at
``context``), and hands out the *other* stage's work as a background callable for co-running
measurements: decode steps beside the encoder, encoder passes beside prefill and decode.

`FunctionWorkload` wraps three plain callables (tests, other models); `Qwen2VLWorkload` runs a
`spaceserve.models.Qwen2VL`: encoder jobs set up once and rerun, prefill chunks and decode steps
through `forward` on a step planned once. Every run launches device work only (no host
planning, no sync), so the timer can capture it in a CUDA graph and replay it on the stream of
the partition it measures (`timers.CudaTimer`), as the runtime replays its decode steps.
`load_model` builds the models the CLI names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from .points import STAGES, Point

__all__ = ["BACKGROUND_DECODE", "BACKGROUND_PATCHES", "STAGES", "FunctionWorkload", "Point",
           "Qwen2VLWorkload", "StageRun", "Workload", "image_grid", "load_model", "tiny_config"]
BACKGROUND_PATCHES = 4096  # the encoder pass run beside prefill / decode points
BACKGROUND_DECODE = (32, 1024)  # (batch, context) of the decode step run beside encoder points


@dataclass
class StageRun:
    """A prepared grid point: `run(num_sms)` executes one unit (the first call of a budget may
    set up, e.g. capture a graph); `units` divides its time; `close` frees what it holds."""

    run: Callable[[int], Any]
    units: float = 1.0
    close: Callable[[], None] = field(default=lambda: None)


class Workload(Protocol):
    """The profiler's view of a model on a device."""

    device_name: str
    num_sms: int
    dtype: str

    def model_meta(self) -> dict[str, Any]:
        """The curves file's "model" object (must hold "vision_depth")."""

    def background_meta(self) -> dict[str, Any]:
        """What runs beside co-running points (part of the checkpoint's identity)."""

    def prepare(self, stage: str, work: tuple[int, ...]) -> StageRun:
        """Set up one grid point of `stage`."""

    def background(self, stage: str, num_sms: int) -> Callable[[], Any]:
        """A zero-argument callable running the other stage's work once under `num_sms`."""


@dataclass
class FunctionWorkload:
    """A workload from three callables: ``encoder(patches, num_sms)`` (one full pass, timed per
    layer through ``model["vision_depth"]``), ``prefill(tokens, context, num_sms)``,
    ``decode(batch, context, num_sms)``."""

    model: dict[str, Any]
    encoder: Callable[[int, int], Any]
    prefill: Callable[[int, int, int], Any]
    decode: Callable[[int, int, int], Any]
    device_name: str = "cpu"
    num_sms: int = 132
    dtype: str = "float32"
    background_patches: int = BACKGROUND_PATCHES
    background_decode: tuple[int, int] = BACKGROUND_DECODE

    def model_meta(self) -> dict[str, Any]:
        return dict(self.model)

    def background_meta(self) -> dict[str, Any]:
        return {"encoder_patches": self.background_patches,
                "decode": list(self.background_decode)}

    def prepare(self, stage: str, work: tuple[int, ...]) -> StageRun:
        fn = {"encoder": self.encoder, "prefill": self.prefill, "decode": self.decode}[stage]
        units = float(self.model.get("vision_depth", 1)) if stage == "encoder" else 1.0
        return StageRun(lambda n: fn(*work, n), units)

    def background(self, stage: str, num_sms: int) -> Callable[[], Any]:
        if stage == "encoder":
            return lambda: self.decode(*self.background_decode, num_sms)
        return lambda: self.encoder(self.background_patches, num_sms)


def image_grid(patches: int, merge: int = 2) -> tuple[int, int, int]:
    """A near-square single-frame patch grid (1, h, w) with h * w = `patches`, h and w
    multiples of `merge`; ValueError naming `patches` when there is none."""
    if patches < merge * merge or patches % (merge * merge):
        raise ValueError(f"patches={patches} must be a positive multiple of {merge * merge}")
    for h in range(math.isqrt(patches), 0, -1):
        if patches % h == 0 and h % merge == 0 and (patches // h) % merge == 0:
            return (1, h, patches // h)
    raise ValueError(f"patches={patches} has no grid of multiples of {merge}")  # unreachable


class Qwen2VLWorkload:
    """Qwen2-VL stages on SpaceServe (`spaceserve.models.Qwen2VL`) with random inputs.

    Runs are plain device work (module docstring): the timer decides whether they replay from
    a graph. A decode step's block tables are as wide as its context needs, as the runtime's
    graph buckets make them.
    """

    def __init__(self, model: Any, *, name: str = "qwen2-vl", block_size: int = 16,
                 seed: int = 0,
                 background_patches: int = BACKGROUND_PATCHES,
                 background_decode: tuple[int, int] = BACKGROUND_DECODE) -> None:
        from spaceserve.kernels.budget import device_num_sms

        self.model = model
        self.name = name
        self.block_size = block_size
        self.device = torch.device(model.device)
        self.seed = seed
        self.background_patches = background_patches
        self.background_decode = tuple(background_decode)
        self.num_sms = device_num_sms(self.device)
        self.device_name = (torch.cuda.get_device_name(self.device)
                            if self.device.type == "cuda" else "cpu")
        self.dtype = str(model.dtype).removeprefix("torch.")
        self._bg: dict[tuple[str, int], Callable[[], Any]] = {}
        self._bg_runs: dict[str, StageRun] = {}

    def model_meta(self) -> dict[str, Any]:
        from spaceserve.runtime.policy.analytic.model import ModelShape

        return {"name": self.name, **asdict(ModelShape.from_config(self.model.config, self.name))}

    def background_meta(self) -> dict[str, Any]:
        return {"encoder_patches": self.background_patches,
                "decode": list(self.background_decode), "block_size": self.block_size}

    def _gen(self, salt: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed * 1000 + salt)

    def prepare(self, stage: str, work: tuple[int, ...]) -> StageRun:
        if stage == "encoder":
            return self._encoder(*work)
        if stage == "prefill":
            return self._prefill(*work)
        if stage == "decode":
            return self._decode(*work)
        raise ValueError(f"stage={stage!r} is not one of {STAGES}")

    def _encoder(self, patches: int) -> StageRun:
        vision = self.model.vision
        grid = image_grid(patches, vision.merge)
        pv = torch.randn(patches, vision.patch_dim, generator=self._gen(patches),
                         device=self.device).to(self.model.dtype)
        job = vision.start(pv, [grid])

        def run(num_sms: int) -> Any:
            # Rerun the same job from its start: device work only, no host planning.
            job.hidden, job.layers_done, job.embeddings, job.pixel_values = None, 0, None, pv
            vision.advance(job, vision.num_layers, num_sms=num_sms)
            return vision.finish(job, num_sms=num_sms)

        return StageRun(run, float(vision.num_layers))

    def _cache(self, blocks: int, salt: int) -> tuple[Any, list[int]]:
        cache = self.model.allocate_kv_cache(blocks, self.block_size)
        order = torch.randperm(blocks, generator=torch.Generator().manual_seed(salt)).tolist()
        return cache, order

    def _ids(self, n: int, salt: int) -> torch.Tensor:
        vocab = self.model.language.vocab_size
        return torch.randint(0, vocab, (n,), generator=self._gen(salt), device=self.device)

    def _prefill(self, tokens: int, context: int) -> StageRun:
        blocks = -(-(tokens + context) // self.block_size)
        cache, table = self._cache(blocks, tokens * 7 + context)
        ctx = self.model.plan_step([context], [tokens], [table], block_size=self.block_size)
        ids = self._ids(tokens, tokens + 3 * context)
        state = {"cache": cache, "ctx": ctx}

        def run(num_sms: int) -> Any:
            return self.model.forward(ids, state["ctx"], state["cache"], num_sms=num_sms)

        return StageRun(run, 1.0, state.clear)

    def _decode(self, batch: int, context: int) -> StageRun:
        per_seq = -(-(context + 1) // self.block_size)
        cache, order = self._cache(batch * per_seq, batch * 13 + context)
        tables = [order[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
        ids = self._ids(batch, batch + 5 * context)
        state: dict[str, Any] = {"cache": cache}
        ctx = self.model.plan_step([context] * batch, [1] * batch, tables,
                                   block_size=self.block_size)

        def run(num_sms: int) -> Any:
            return self.model.forward(ids, ctx, state["cache"], num_sms=num_sms)

        return StageRun(run, 1.0, state.clear)

    def background(self, stage: str, num_sms: int) -> Callable[[], Any]:
        """The other stage at `num_sms` (an encoder pass of `background_patches` beside
        prefill and decode, a decode step of `background_decode` beside the encoder), set up
        and run once before it is returned, so nothing is planned while a measurement runs."""
        other = "decode" if stage == "encoder" else "encoder"
        key = (other, num_sms)
        if key not in self._bg:
            if other not in self._bg_runs:
                work = (self.background_decode if other == "decode"
                        else (self.background_patches,))
                self._bg_runs[other] = self.prepare(other, tuple(work))
            runner = self._bg_runs[other]
            self._bg[key] = lambda: runner.run(num_sms)
            self._bg[key]()
        return self._bg[key]

    def close(self) -> None:
        """Free the background work's jobs and caches."""
        for run in self._bg_runs.values():
            run.close()
        self._bg.clear()
        self._bg_runs.clear()


def tiny_config() -> Any:
    """A tiny Qwen2-VL (2 + 2 layers) for smoke runs of the profiler on any device."""
    from transformers import Qwen2VLConfig

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, bos_token_id=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=250,
                         video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)


def load_model(spec: str, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, backend: str | None = None) -> tuple[Any, str]:
    """(model, name) for `spec`: "tiny", "qwen2-vl-7b" (random weights) or a checkpoint
    directory (random weights when it holds only a config.json). On CPU the torch backend runs
    (the interpreter would take hours); on CUDA the Triton kernels, bf16 unless `dtype` says
    otherwise."""
    from spaceserve.models import from_config, from_pretrained
    from spaceserve.runtime.policy.analytic.model import qwen2_vl_7b_config

    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    backend = backend or ("triton" if dev.type == "cuda" else "torch")
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if spec == "tiny":
        return from_config(tiny_config(), attention_backend=backend, dtype=dt, device=dev), "tiny"
    if spec == "qwen2-vl-7b":
        return (from_config(qwen2_vl_7b_config(), attention_backend=backend, dtype=dt,
                            device=dev), "Qwen2-VL-7B")
    name = Path(spec).resolve().name
    if (Path(spec) / "config.json").is_file() and not any(Path(spec).glob("*.safetensors")):
        from transformers import Qwen2VLConfig

        config = Qwen2VLConfig.from_pretrained(spec)
        return from_config(config, attention_backend=backend, dtype=dt, device=dev), name
    return from_pretrained(spec, attention_backend=backend, dtype=dtype, device=dev), name
