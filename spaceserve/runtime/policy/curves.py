"""Resource-utility curves: stage latency as a function of SM count, and their JSON file format.

SIS, TWSRFT's cost model and the simulator all ask the same question: how long does this piece of
work take on this many SMs, alone or while the other stage runs? A `CurveSet` answers it from a
grid of latencies (measured by the profiler or modelled by `analytic.py`) for three stages:

- ``encoder``: one vision-layer equivalent (a full pass divided by the depth, so patch embedding
  and merger are spread over the layers), by ``patches`` (ViT sequence length of the batch);
- ``prefill``: one prompt chunk through the whole LLM, by ``tokens`` and ``context`` (tokens
  already in the KV cache before the chunk);
- ``decode``: one decode step of the whole batch, by ``batch`` and ``context`` (mean per request).

Each stage has an ``isolated`` grid; latency while the other stage runs (``corun``) is the
isolated one times ``1 + slowdown`` from the file's contention table (`contention.py`), per
(encoder SMs, decoder SMs) pair. File layout (latencies in seconds, nested as
``[sms][axis0][axis1]...``)::

    {"format": "spaceserve-curves-v2",
     "device": {"name": "H200", "num_sms": 132}, "model": {...}, "dtype": "bfloat16",
     "source": "measured" | "modelled",
     "curves": {"encoder": {"axes": ["patches"], "grid": {"patches": [...]}, "sms": [...],
                            "isolated": [[...]]},
                "prefill": {"axes": ["tokens", "context"], ...},
                "decode":  {"axes": ["batch", "context"], ...}},
     "contention": {"source": ..., "default": {"encoder": s, "decoder": s}, "pairs": [...]}}

Version 1 files (``spaceserve-curves-v1``) still load: they have no contention table but a
``corun`` grid per stage (measured beside the other stage at the rest of the device), which
their co-running lookups keep using until a table replaces it (`CurveSet.with_contention`).

A measured stage may list ``"host_bound"`` points (``[{"sms": 8, "batch": 1, "context": 0,
"corun": false}, ...]``): eager host time >= device time. Their latency is the device's (from a
graph replay); an eager engine waits on the host. Absent: not known; empty: none.

Lookups interpolate multilinearly on a monotone envelope of the data (latency never rises with
SMs, never falls with work), so noisy measurements cannot make SIS see "more SMs, slower".
Outside the grid: fewer SMs than measured scale latency by ``sms_min / sms``; more work than
measured scales it proportionally; otherwise values clamp to the edge.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spaceserve.runtime.policy.contention import Contention
from spaceserve.runtime.policy.curve_fields import check_axis as _check_axis
from spaceserve.runtime.policy.curve_fields import check_grid as _check_grid
from spaceserve.runtime.policy.curve_fields import check_host_bound as _check_host_bound
from spaceserve.runtime.policy.curve_fields import fail as _fail

FORMAT = "spaceserve-curves-v2"
FORMAT_V1 = "spaceserve-curves-v1"
FORMATS = (FORMAT_V1, FORMAT)
SOURCES = ("measured", "modelled")
STAGE_AXES: dict[str, tuple[str, ...]] = {
    "encoder": ("patches",),
    "prefill": ("tokens", "context"),
    "decode": ("batch", "context"),
}


def _envelope(values: list, axis: int, depth: int, op) -> list:
    """Running `op` (min or max) along `axis` of a nested list `depth` levels deep."""
    if axis == 0:
        out = [values[0]]
        for v in values[1:]:
            out.append(_combine(out[-1], v, op))
        return out
    return [_envelope(v, axis - 1, depth - 1, op) for v in values]


def _combine(a: Any, b: Any, op) -> Any:
    if isinstance(a, list):
        return [_combine(x, y, op) for x, y in zip(a, b, strict=True)]
    return op(a, b)


def _bracket(axis: list[float], x: float) -> tuple[int, int, float]:
    """Indices (lo, hi) around `x` and the weight of `hi`; clamped to the axis ends."""
    if x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        n = len(axis) - 1
        return n, n, 0.0
    hi = bisect.bisect_right(axis, x)
    lo = hi - 1
    return lo, hi, (x - axis[lo]) / (axis[hi] - axis[lo])


@dataclass
class Curve:
    """One stage's latency grid over SMs and its workload axes: isolated, and (version 1 files
    only) co-running."""

    axes: tuple[str, ...]
    grid: dict[str, list[float]]
    sms: list[float]
    isolated: list
    corun: list | None = None
    host_bound: list[dict[str, Any]] | None = None
    _env: dict[bool, list] = field(default_factory=dict, init=False, repr=False)
    _cache: dict[tuple, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        depth = 1 + len(self.axes)
        for corun, raw in ((False, self.isolated), (True, self.corun)):
            if raw is None:
                continue
            env = raw
            for a in range(len(self.axes)):
                env = _envelope(env, a + 1, depth, max)
            self._env[corun] = _envelope(env, 0, depth, min)

    def __call__(self, sms: float, *work: float, corun: bool = False) -> float:
        """Latency in seconds of this stage's unit of work on `sms` SMs (`corun`: from the
        version-1 co-running grid; ValueError when the curve has none)."""
        key = (sms, work, corun)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if len(work) != len(self.axes):
            raise ValueError(f"expected {len(self.axes)} workload values {self.axes}, got {work}")
        if sms <= 0:
            raise ValueError(f"sms must be positive, got {sms}")
        if corun not in self._env:
            raise ValueError("this curve has no co-running grid: co-running latency comes from "
                             "the curve set's contention table")
        scale = 1.0
        if sms < self.sms[0]:
            scale *= self.sms[0] / sms
        brackets = [_bracket(self.sms, sms)]
        for name, x in zip(self.axes, work, strict=True):
            axis = self.grid[name]
            if x > axis[-1] and axis[-1] > 0:
                scale *= x / axis[-1]
            brackets.append(_bracket(axis, x))
        value = scale * self._interp(self._env[corun], brackets)
        if len(self._cache) > 200_000:
            self._cache.clear()
        self._cache[key] = value
        return value

    def _interp(self, values: Any, brackets: list[tuple[int, int, float]]) -> float:
        if not brackets:
            return values
        lo, hi, w = brackets[0]
        a = self._interp(values[lo], brackets[1:])
        if w == 0.0:
            return a
        return (1.0 - w) * a + w * self._interp(values[hi], brackets[1:])

    def to_dict(self, *, with_corun: bool = False) -> dict[str, Any]:
        out = {"axes": list(self.axes), "grid": {k: list(v) for k, v in self.grid.items()},
               "sms": list(self.sms), "isolated": self.isolated}
        if with_corun:
            out["corun"] = self.corun
        if self.host_bound is not None:
            out["host_bound"] = [dict(p) for p in self.host_bound]
        return out

    @classmethod
    def from_dict(cls, data: Any, stage: str, num_sms: int, path: str, *,
                  version: int = 2) -> Curve:
        if not isinstance(data, dict):
            raise _fail(path, "expected an object")
        axes = STAGE_AXES[stage]
        if data.get("axes") != list(axes):
            raise _fail(f"{path}.axes", f"expected {list(axes)}, got {data.get('axes')!r}")
        sms = _check_axis(data.get("sms"), f"{path}.sms", integer=True, minimum=1)
        if sms[-1] > num_sms:
            raise _fail(f"{path}.sms[{len(sms) - 1}]", f"{sms[-1]:g} exceeds device num_sms "
                        f"{num_sms}")
        grid_in = data.get("grid")
        if not isinstance(grid_in, dict):
            raise _fail(f"{path}.grid", "expected an object")
        grid = {}
        for name in axes:
            integer = name != "context"
            minimum = 0 if name == "context" else 1
            grid[name] = _check_axis(grid_in.get(name), f"{path}.grid.{name}", integer=integer,
                                     minimum=minimum)
        shape = (len(sms), *(len(grid[a]) for a in axes))
        iso = _check_grid(data.get("isolated"), shape, f"{path}.isolated")
        cor = None
        if version == 1:
            cor = _check_grid(data.get("corun"), shape, f"{path}.corun")
        elif "corun" in data:
            raise _fail(f"{path}.corun", f"{FORMAT} carries co-running slowdown in "
                        "$.contention, not per stage")
        host = data.get("host_bound")
        if host is not None:
            host = _check_host_bound(host, axes, sms, grid, f"{path}.host_bound")
        return cls(axes, grid, sms, iso, cor, host)


@dataclass
class CurveSet:
    """Latency curves of the three stages for one device, model and dtype, and the co-running
    contention table (None only for a version-1 file, whose curves carry co-running grids)."""

    device: str
    num_sms: int
    model: dict[str, Any]
    dtype: str
    source: str
    encoder_curve: Curve
    prefill_curve: Curve
    decode_curve: Curve
    contention: Contention | None = None

    def __post_init__(self) -> None:
        if self.contention is None and any(c.corun is None for c in self._curves()):
            raise ValueError("curves: a contention table is needed where the stages have no "
                             "co-running grids")

    def _curves(self) -> tuple[Curve, Curve, Curve]:
        return self.encoder_curve, self.prefill_curve, self.decode_curve

    def _other(self, sms: float, corun: bool | float) -> float:
        """The other side's SMs: given, or (True) the rest of the device."""
        if corun is True:
            return max(1.0, self.num_sms - sms)
        return float(corun)

    def _lookup(self, curve: Curve, side: str, sms: float, work: tuple[float, ...],
                corun: bool | float) -> float:
        if corun is False or corun == 0:
            return curve(sms, *work)
        if self.contention is None:  # a version-1 file: its measured co-running grid
            return curve(sms, *work, corun=True)
        other = self._other(sms, corun)
        pair = (sms, other) if side == "encoder" else (other, sms)
        return curve(sms, *work) * (1.0 + self.contention.slowdown(side, *pair))

    def encoder(self, patches: float, layers: float, sms: float,
                corun: bool | float = False) -> float:
        """Seconds for `layers` vision layers over a batch of `patches` ViT tokens. `corun`:
        False alone; the decoder side's SM count while it runs beside (True: the rest of the
        device)."""
        if layers <= 0 or patches <= 0:
            return 0.0
        return layers * self._lookup(self.encoder_curve, "encoder", sms, (patches,), corun)

    def prefill(self, tokens: float, context: float, sms: float, corun: bool | float = False,
                side: str = "encoder") -> float:
        """Seconds for one prompt chunk of `tokens` after `context` cached tokens; `side` says
        which side's contention applies (the compute partition by default)."""
        if tokens <= 0:
            return 0.0
        return self._lookup(self.prefill_curve, side, sms, (tokens, context), corun)

    def decode(self, batch: float, context: float, sms: float,
               corun: bool | float = False) -> float:
        """Seconds for one decode step of `batch` requests at mean context `context`; `corun`:
        the encoder side's SM count while it runs beside (True: the rest of the device)."""
        if batch <= 0:
            return 0.0
        return self._lookup(self.decode_curve, "decoder", sms, (batch, context), corun)

    def mixed_step(self, batch: float, context: float, chunk: float, chunk_context: float,
                   sms: float, corun: bool | float = False) -> float:
        """A decode step carrying a prefill chunk (chunked prefill beside decode).

        The chunk adds its marginal cost over the smallest measured prefill pass, which already
        streams the weights the decode step streams anyway.
        """
        step = self.decode(batch, context, sms, corun)
        if chunk <= 0:
            return step
        tokens0 = self.prefill_curve.grid["tokens"][0]
        base = self.prefill(tokens0, chunk_context, sms, corun, "decoder")
        whole = self.prefill(chunk, chunk_context, sms, corun, "decoder")
        return (step + max(0.0, whole - base)) if batch > 0 else whole

    def slowdown(self, side: str, encoder_sms: float, decoder_sms: float) -> float:
        """The contention table's slowdown (0.08: 8% slower) of `side` at this SM pair."""
        if self.contention is None:
            raise ValueError("version-1 curves have no contention table (co-running grids)")
        return self.contention.slowdown(side, encoder_sms, decoder_sms)

    def with_contention(self, contention: Contention) -> CurveSet:
        """The same curves with another contention table (replacing version-1 grids)."""
        curves = [Curve(c.axes, c.grid, c.sms, c.isolated) for c in self._curves()]
        return CurveSet(self.device, self.num_sms, dict(self.model), self.dtype, self.source,
                        *curves, contention=contention)

    @property
    def encoder_depth(self) -> int:
        return int(self.model.get("vision_depth", 1))

    def to_dict(self) -> dict[str, Any]:
        """Version 2; a version-1 set (no contention table) is written as version 1."""
        v1 = self.contention is None
        out = {
            "format": FORMAT_V1 if v1 else FORMAT,
            "device": {"name": self.device, "num_sms": self.num_sms},
            "model": dict(self.model),
            "dtype": self.dtype,
            "source": self.source,
            "curves": {"encoder": self.encoder_curve.to_dict(with_corun=v1),
                       "prefill": self.prefill_curve.to_dict(with_corun=v1),
                       "decode": self.decode_curve.to_dict(with_corun=v1)},
        }
        if not v1:
            out["contention"] = self.contention.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any) -> CurveSet:
        """Validate and build; a malformed field raises ValueError naming its JSON path."""
        if not isinstance(data, dict):
            raise _fail("$", "expected a JSON object")
        if data.get("format") not in FORMATS:
            raise _fail("$.format", f"expected one of {FORMATS}, got {data.get('format')!r}")
        version = 1 if data["format"] == FORMAT_V1 else 2
        dev = data.get("device")
        if not isinstance(dev, dict):
            raise _fail("$.device", "expected an object")
        if not isinstance(dev.get("name"), str) or not dev["name"]:
            raise _fail("$.device.name", f"expected a non-empty string, got {dev.get('name')!r}")
        n = dev.get("num_sms")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _fail("$.device.num_sms", f"expected a positive integer, got {n!r}")
        if not isinstance(data.get("model"), dict):
            raise _fail("$.model", "expected an object")
        if not isinstance(data.get("dtype"), str) or not data["dtype"]:
            raise _fail("$.dtype", f"expected a non-empty string, got {data.get('dtype')!r}")
        if data.get("source") not in SOURCES:
            raise _fail("$.source", f"expected one of {SOURCES}, got {data.get('source')!r}")
        curves = data.get("curves")
        if not isinstance(curves, dict):
            raise _fail("$.curves", "expected an object")
        built = {}
        for stage in STAGE_AXES:
            if stage not in curves:
                raise _fail(f"$.curves.{stage}", "missing")
            built[stage] = Curve.from_dict(curves[stage], stage, n, f"$.curves.{stage}",
                                           version=version)
        contention = None
        if version == 2:
            if "contention" not in data:
                raise _fail("$.contention", "missing")
            contention = Contention.from_dict(data["contention"], n)
        return cls(dev["name"], n, dict(data["model"]), data["dtype"], data["source"],
                   built["encoder"], built["prefill"], built["decode"], contention)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> CurveSet:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise _fail("$", f"not valid JSON ({exc})") from None
        return cls.from_dict(data)
