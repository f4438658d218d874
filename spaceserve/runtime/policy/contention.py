"""Co-running contention as data: how much each stage slows while the other one runs.

Encoder and decoder on disjoint SMs still share HBM, L2 and the power budget, so each runs
slower beside the other than alone. A `Contention` table gives that slowdown per (encoder SMs,
decoder SMs) pair, for the two sides of the GPU:

- ``encoder``: the compute side (vision-encoder layers, and prefill placed in the compute
  partition);
- ``decoder``: the decode side (decode steps, and the prefill chunks carried in them).

A slowdown ``s`` means co-running work takes ``(1 + s)`` times its isolated latency. A lookup
between measured pairs weighs every pair of that side by inverse squared distance in the
(encoder SMs, decoder SMs) plane (exact at a measured pair); a side with no pair takes the
table's ``default``. Sources:

- ``modelled``: the analytic presets' single entry, a flat 8% on both sides (H200, H100, A100:
  `analytic.DevicePreset.contention`) - a guess at the order of magnitude, not a measurement;
- ``measured``: `spaceserve profile` (autotune/profile.py) derives one pair per co-running
  measurement: the median over the workload grid of ``corun / isolated - 1``, encoder points at
  (their SMs, the background's), decode points at (the background's, theirs);
- ``override``: `spaceserve sim --contention X` (a flat X on both sides).

JSON (inside a curves file, ``$.contention``)::

    {"source": "modelled", "note": "...", "default": {"encoder": 0.08, "decoder": 0.08},
     "pairs": [{"encoder_sms": 64, "decoder_sms": 68, "encoder": 0.05, "decoder": 0.11}, ...]}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spaceserve.checks import require_choice

SIDES = ("encoder", "decoder")
SOURCES = ("modelled", "measured", "override")


def _fail(path: str, msg: str) -> ValueError:
    return ValueError(f"curves: {path}: {msg}")


def _slowdown(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise _fail(path, f"expected a slowdown >= 0 (0.08 = 8% slower), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Pair:
    """Measured slowdowns at one (encoder SMs, decoder SMs) pair; a side may be missing."""

    encoder_sms: int
    decoder_sms: int
    encoder: float | None = None
    decoder: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"encoder_sms": self.encoder_sms, "decoder_sms": self.decoder_sms}
        for side in SIDES:
            if getattr(self, side) is not None:
                out[side] = getattr(self, side)
        return out


@dataclass(frozen=True)
class Contention:
    """Co-running slowdown per side and SM pair (module docstring)."""

    default: Mapping[str, float]
    pairs: tuple[Pair, ...] = ()
    source: str = "modelled"
    note: str = ""
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if set(self.default) != set(SIDES):
            raise ValueError(f"contention default needs exactly {SIDES}, got {dict(self.default)}")
        for side in SIDES:
            _slowdown(self.default[side], f"$.contention.default.{side}")
        require_choice("contention source", self.source, SOURCES)
        object.__setattr__(self, "default", {s: float(self.default[s]) for s in SIDES})
        object.__setattr__(self, "pairs", tuple(self.pairs))

    @classmethod
    def flat(cls, slowdown: float, *, source: str = "override", note: str = "") -> Contention:
        """One entry for every pair and both sides."""
        value = _slowdown(slowdown, "contention")
        return cls({s: value for s in SIDES}, (), source,
                   note or f"flat {100 * value:g}% on both sides")

    @property
    def flat_value(self) -> float | None:
        """The slowdown when the table is one flat entry, else None."""
        values = set(self.default.values())
        return values.pop() if not self.pairs and len(values) == 1 else None

    def slowdown(self, side: str, encoder_sms: float, decoder_sms: float) -> float:
        """Fractional slowdown of `side`'s work while both run on this pair of SM counts."""
        key = (side, encoder_sms, decoder_sms)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        require_choice("side", side, SIDES)
        pts = [(p.encoder_sms, p.decoder_sms, getattr(p, side)) for p in self.pairs
               if getattr(p, side) is not None]
        if not pts:
            value = self.default[side]
        else:
            num = den = 0.0
            value = math.nan
            for e, d, s in pts:
                dist2 = (e - encoder_sms) ** 2 + (d - decoder_sms) ** 2
                if dist2 == 0:
                    value = s
                    break
                num += s / dist2
                den += 1.0 / dist2
            else:
                value = num / den
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[key] = value
        return value

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "note": self.note, "default": dict(self.default),
                "pairs": [p.to_dict() for p in self.pairs]}

    @classmethod
    def from_dict(cls, data: Any, num_sms: int, path: str = "$.contention") -> Contention:
        """Validate and build; a malformed field raises ValueError naming its JSON path."""
        if not isinstance(data, dict):
            raise _fail(path, "expected an object")
        if data.get("source") not in SOURCES:
            raise _fail(f"{path}.source", f"expected one of {SOURCES}, got "
                        f"{data.get('source')!r}")
        default = data.get("default")
        if not isinstance(default, dict) or set(default) != set(SIDES):
            raise _fail(f"{path}.default", f"expected an object with exactly {list(SIDES)}")
        dflt = {s: _slowdown(default[s], f"{path}.default.{s}") for s in SIDES}
        raw = data.get("pairs", [])
        if not isinstance(raw, list):
            raise _fail(f"{path}.pairs", "expected a list")
        pairs = []
        for i, p in enumerate(raw):
            where = f"{path}.pairs[{i}]"
            if not isinstance(p, dict):
                raise _fail(where, "expected an object")
            sms = []
            for name in ("encoder_sms", "decoder_sms"):
                v = p.get(name)
                if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= num_sms:
                    raise _fail(f"{where}.{name}", f"expected an integer in 1..{num_sms}, "
                                f"got {v!r}")
                sms.append(v)
            sides = {s: _slowdown(p[s], f"{where}.{s}") for s in SIDES if s in p}
            if not sides:
                raise _fail(where, f"expected a slowdown for at least one of {list(SIDES)}")
            unknown = set(p) - {"encoder_sms", "decoder_sms", *SIDES}
            if unknown:
                raise _fail(where, f"unknown fields {sorted(unknown)}")
            pairs.append(Pair(sms[0], sms[1], sides.get("encoder"), sides.get("decoder")))
        note = data.get("note", "")
        if not isinstance(note, str):
            raise _fail(f"{path}.note", f"expected a string, got {note!r}")
        return cls(dflt, tuple(pairs), data["source"], note)


def from_measurements(points: Sequence[tuple[str, int, int, float, float]], *,
                      note: str = "") -> Contention:
    """A measured table from ``(side, encoder_sms, decoder_sms, isolated_s, corun_s)`` rows:
    per side and pair, the median of ``corun / isolated - 1`` (at least 0); the default per side
    is the median over that side's pairs (0 where a side has none)."""
    groups: dict[tuple[int, int], dict[str, list[float]]] = {}
    for side, e, d, iso, cor in points:
        require_choice("side", side, SIDES)
        groups.setdefault((e, d), {}).setdefault(side, []).append(max(0.0, cor / iso - 1.0))
    pairs = []
    per_side: dict[str, list[float]] = {s: [] for s in SIDES}
    for (e, d), sides in sorted(groups.items()):
        med = {s: _median(v) for s, v in sides.items()}
        for s, v in med.items():
            per_side[s].append(v)
        pairs.append(Pair(e, d, med.get("encoder"), med.get("decoder")))
    default = {s: _median(v) if v else 0.0 for s, v in per_side.items()}
    return Contention(default, tuple(pairs), "measured", note)


def _median(values: Sequence[float]) -> float:
    xs = sorted(values)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
