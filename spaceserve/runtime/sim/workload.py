"""Simulated requests and the workloads that generate them.

Image sizes follow the model's preprocessing: one LLM token per (patch x merge)^2 pixels after
the processor's resize (28x28 for Qwen2-VL / Qwen2.5-VL, 32x32 for Qwen3-VL), four ViT patches
per LLM token. `RESOLUTIONS` is Qwen2-VL's table; `resolution_tokens` builds any model's.
Arrivals are Poisson (burstiness 1) or gamma (burstiness < 1 is burstier), as `vllm bench
serve` draws them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# LLM tokens per image with the hub preprocessor (max_pixels 12.8M).
RESOLUTIONS: dict[str, int] = {
    "448x448": 256,
    "1280x720": 1196,
    "1024x1024": 1369,
    "1920x1080": 2691,
    "3840x2160": 10549,
}
PATCHES_PER_TOKEN = 4


def image_tokens(width: int, height: int, *, patch: int = 14, merge: int = 2,
                 min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 16384) -> int:
    """LLM tokens of one `width` x `height` image: the Qwen-VL processors' resize (sides rounded
    to multiples of ``patch * merge``, pixels kept within [min_pixels, max_pixels], the aspect
    ratio kept), one token per ``(patch * merge)^2`` pixels."""
    f = patch * merge
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return (h // f) * (w // f)


def resolution_tokens(patch: int = 14, merge: int = 2, min_pixels: int = 56 * 56,
                      max_pixels: int = 28 * 28 * 16384) -> dict[str, int]:
    """LLM tokens of each of `RESOLUTIONS`' sizes under a model's preprocessing (the defaults:
    Qwen2-VL's hub processor, which gives `RESOLUTIONS` itself)."""
    out = {}
    for res in RESOLUTIONS:
        w, h = (int(x) for x in res.split("x"))
        out[res] = image_tokens(w, h, patch=patch, merge=merge, min_pixels=min_pixels,
                                max_pixels=max_pixels)
    return out

DEFAULT_MIX: dict[str, float] = {"448x448": 0.25, "1280x720": 0.25, "1024x1024": 0.25,
                                 "1920x1080": 0.25}


@dataclass
class Request:
    """One request and what happened to it in the simulation (times in seconds)."""

    rid: int
    arrival: float
    image_tokens: int
    text_tokens: int
    output_tokens: int
    kind: str  # "image", "text" or "background"
    resolution: str = ""
    prefilled: int = 0
    generated: int = 0
    encoded_at: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finish: float | None = None
    gpu: int = 0
    itls: list[float] = field(default_factory=list)
    # caching (multi-turn chat): image tokens the encoder cache holds, and leading prompt
    # tokens whose K/V the prefix cache holds (prefill starts after them)
    cached_image_tokens: int = 0
    cached_tokens: int = 0
    shed: str = ""  # SLO-aware admission: "refused" at arrival, "ended" while waiting

    @property
    def prompt_tokens(self) -> int:
        return self.image_tokens + self.text_tokens

    @property
    def patches(self) -> int:
        """ViT patches to encode (cached images are zero encoder work)."""
        return (self.image_tokens - self.cached_image_tokens) * PATCHES_PER_TOKEN

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass(frozen=True)
class Workload:
    """Arrival process and request shapes of one run."""

    image_rate: float  # image requests per second
    duration_s: float  # arrivals stop after this
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 = Poisson
    image_mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    text_rate: float = 0.0  # text-only requests per second
    text_tokens: int = 64  # text prompt tokens of every request
    output_tokens: int = 128
    seed: int = 0
    # LLM tokens per resolution under the model's preprocessing (None: `RESOLUTIONS`, Qwen2-VL's)
    tokens_per_image: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.image_rate < 0 or self.text_rate < 0:
            raise ValueError("image_rate and text_rate must be >= 0")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be positive, got {self.duration_s}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if not self.image_mix or any(w < 0 for w in self.image_mix.values()) or \
                sum(self.image_mix.values()) <= 0:
            raise ValueError(f"image_mix needs non-negative weights, got {self.image_mix}")
        unknown = set(self.image_mix) - set(RESOLUTIONS)
        if unknown:
            raise ValueError(f"image_mix: unknown resolutions {sorted(unknown)}; "
                             f"known: {sorted(RESOLUTIONS)}")
        if self.text_tokens < 1 or self.output_tokens < 1:
            raise ValueError("text_tokens and output_tokens must be >= 1")
        if self.tokens_per_image is not None:
            missing = set(self.image_mix) - set(self.tokens_per_image)
            bad = [r for r, n in self.tokens_per_image.items()
                   if not isinstance(n, int) or isinstance(n, bool) or n < 1]
            if missing or bad:
                raise ValueError(f"tokens_per_image: needs a positive int for each resolution "
                                 f"of the mix (missing {sorted(missing)}, bad {sorted(bad)})")

    def tokens(self, resolution: str) -> int:
        """LLM tokens of one image of `resolution` under this workload's model."""
        return (self.tokens_per_image or RESOLUTIONS)[resolution]

    def mean_image_tokens(self) -> float:
        total = sum(self.image_mix.values())
        return sum(self.tokens(r) * w for r, w in self.image_mix.items()) / total


def arrival_times(rate: float, duration: float, burstiness: float, rng: random.Random
                  ) -> list[float]:
    """Arrival instants in [0, duration) with mean rate `rate`."""
    if rate <= 0:
        return []
    out, t = [], 0.0
    scale = 1.0 / (rate * burstiness)
    while True:
        t += rng.gammavariate(burstiness, scale)
        if t >= duration:
            return out
        out.append(t)


def generate(w: Workload, first_rid: int = 0) -> list[Request]:
    """Image and text-only requests of workload `w`, in arrival order."""
    rng = random.Random(w.seed)
    names = list(w.image_mix)
    weights = [w.image_mix[n] for n in names]
    reqs = []
    for t in arrival_times(w.image_rate, w.duration_s, w.burstiness, rng):
        res = rng.choices(names, weights)[0]
        reqs.append(("image", t, w.tokens(res), res))
    for t in arrival_times(w.text_rate, w.duration_s, w.burstiness, rng):
        reqs.append(("text", t, 0, ""))
    reqs.sort(key=lambda r: (r[1], r[0]))
    return [Request(first_rid + i, t, tokens, w.text_tokens, w.output_tokens, kind, res)
            for i, (kind, t, tokens, res) in enumerate(reqs)]

