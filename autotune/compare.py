"""Point-by-point error of modelled curves (e.g. `spaceserve.runtime.policy.analytic.model`) against
measured ones: how far SIS would be off if it planned with the model instead."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from spaceserve.runtime.policy.curves import STAGE_AXES, CurveSet

from .points import Point


def point_errors(measured: dict[str, float], points: Iterable[Point], reference: CurveSet
                 ) -> list[dict[str, Any]]:
    """One row per measured point: measured and modelled seconds per unit and the relative
    error ``modelled / measured - 1`` (positive: the model is pessimistic)."""
    rows = []
    for p in points:
        if p.key not in measured:
            continue
        got = measured[p.key]
        other = p.other_sms if p.corun else False
        if p.stage == "encoder":  # per layer, the curves' unit
            model = reference.encoder(p.work[0], 1, p.sms, other)
        elif p.stage == "prefill":  # measured beside an encoder pass: the decode side
            model = reference.prefill(*p.work, p.sms, other, side="decoder")
        else:
            model = reference.decode(*p.work, p.sms, other)
        rows.append({"stage": p.stage, **dict(zip(STAGE_AXES[p.stage], p.work, strict=True)),
                     "sms": p.sms, "mode": "corun" if p.corun else "isolated",
                     "measured_ms": got * 1e3, "modelled_ms": model * 1e3,
                     "rel_err": model / got - 1.0})
    return rows


def summarize_errors(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (stage, mode): point count, median and largest |relative error|, median signed."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r["stage"], r["mode"]), []).append(r["rel_err"])
    return [{"stage": stage, "mode": mode, "points": len(errs),
             "median_abs_err": statistics.median(abs(e) for e in errs),
             "max_abs_err": max(abs(e) for e in errs),
             "median_err": statistics.median(errs)}
            for (stage, mode), errs in groups.items()]
