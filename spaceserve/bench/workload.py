"""Requests of a serving benchmark: arrivals, image-size mix, text-only and probe requests.

Load requests arrive as a gamma process (burstiness 1 = Poisson, < 1 burstier), as `vllm bench
serve` draws them (the arrival sampler is the simulator's); each is an image request of a
resolution drawn from the mix, or text-only for the mix's ``text`` entry. Probe requests are
tiny text-only requests on their own Poisson stream (their own random stream too, so adding
probes leaves the load unchanged): their TTFT and TPOT show head-of-line blocking directly.
Everything is a function of the seed.
"""

from __future__ import annotations

import functools
import io
import random
from dataclasses import dataclass, field

from spaceserve.runtime.sim.workload import arrival_times

TEXT = "text"
DEFAULT_MIX: dict[str, float] = {"112x112": 0.4, "224x224": 0.3, "448x448": 0.1, TEXT: 0.2}
_WORDS = ("red house tree sky cat dog river street bus plate bread apple mountain lake snow "
          "cloud bird roof window garden bridge boat train flower stone table chair lamp book "
          "clock").split()


def parse_resolution(name: str) -> tuple[int, int]:
    """``"WxH"`` -> (width, height); ValueError otherwise."""
    w, sep, h = name.partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
        raise ValueError(f"resolution {name!r} is not WIDTHxHEIGHT")
    return int(w), int(h)


def parse_mix(text: str) -> dict[str, float]:
    """``"112x112=0.5,text=0.5"`` -> {resolution or "text": weight}; ValueError otherwise."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, weight = part.strip().partition("=")
        if not sep:
            raise ValueError(f"image mix entry {part!r} is not NAME=WEIGHT")
        if name != TEXT:
            parse_resolution(name)
        try:
            out[name] = float(weight)
        except ValueError:
            raise ValueError(f"image mix entry {part!r}: weight is not a number") from None
    _check_mix(out)
    return out


def _check_mix(mix: dict[str, float]) -> None:
    if not mix or any(not w >= 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"image_mix needs non-negative weights with a positive sum, got {mix}")
    for name in mix:
        if name != TEXT:
            parse_resolution(name)


@dataclass(frozen=True)
class ServeWorkload:
    """One benchmark run's request stream (rates per second, lengths in tokens or words)."""

    request_rate: float
    duration_s: float
    burstiness: float = 1.0
    image_mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    probe_rate: float = 0.0
    input_words: int = 12
    output_len: int = 32
    probe_output_len: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate >= 0 or not self.probe_rate >= 0:
            raise ValueError("request_rate and probe_rate must be >= 0")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be positive, got {self.duration_s}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        _check_mix(self.image_mix)
        for name in ("input_words", "output_len", "probe_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(frozen=True)
class BenchRequest:
    """One request to send `arrival` seconds after the run starts."""

    idx: int
    kind: str  # "image", "text" or "probe"
    arrival: float
    prompt: str
    max_tokens: int
    resolution: str = ""
    image_seed: int = 0


def _prompt(rng: random.Random, words: int) -> str:
    return "Describe " + " ".join(rng.choice(_WORDS) for _ in range(words)) + "."


def build_requests(w: ServeWorkload) -> list[BenchRequest]:
    """The run's requests in arrival order."""
    rng = random.Random(w.seed)
    probe_rng = random.Random(w.seed * 7919 + 1)
    names = list(w.image_mix)
    weights = [w.image_mix[n] for n in names]
    raw: list[tuple[float, str, str, int, str, int]] = []
    for t in arrival_times(w.request_rate, w.duration_s, w.burstiness, rng):
        name = rng.choices(names, weights)[0]
        kind = TEXT if name == TEXT else "image"
        raw.append((t, kind, "" if kind == TEXT else name, rng.randrange(8),
                    _prompt(rng, w.input_words), w.output_len))
    for t in arrival_times(w.probe_rate, w.duration_s, 1.0, probe_rng):
        raw.append((t, "probe", "", 0, _prompt(probe_rng, 2), w.probe_output_len))
    raw.sort(key=lambda r: (r[0], r[1]))
    return [BenchRequest(i, kind, t, prompt, n, res, seed)
            for i, (t, kind, res, seed, prompt, n) in enumerate(raw)]


@functools.lru_cache(maxsize=64)
def image_png(resolution: str, seed: int) -> bytes:
    """A seeded random image of `resolution` as PNG bytes (smooth blocks, not pure noise, so
    it compresses like a picture)."""
    import numpy as np
    from PIL import Image

    width, height = parse_resolution(resolution)
    g = np.random.default_rng(seed)
    small = g.integers(0, 256, (max(1, height // 8), max(1, width // 8), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((width, height), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
