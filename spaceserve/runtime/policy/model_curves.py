"""The resource-utility curves an engine schedules by: a curves file (`spaceserve profile`), else
the analytic roofline of its model, of one rank at tensor parallelism (what ``spaceserve sim
--tp`` simulates). Cached per model shape; pure Python until the analytic model is needed."""

from __future__ import annotations

from typing import Any

from spaceserve.runtime.policy.curves import CurveSet

_CURVES: dict[Any, CurveSet] = {}


def model_curves(path: str | None, model_config: Any = None, *, tp: int = 1,
                 mm_encoder_tp_mode: str = "data") -> CurveSet:
    """Curves from `path`, else the analytic roofline of `model_config` (a transformers
    Qwen2-VL config; Qwen2-VL-7B's when None or unreadable): at `tp` > 1 those of one rank of
    the group (`analytic_tp`: its share of the decoder plus the collectives, the vision encoder
    as `mm_encoder_tp_mode` runs it), what ``spaceserve sim --tp`` simulates. ValueError naming
    ``curves`` for a bad file."""
    if path is not None:
        try:
            return CurveSet.load(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"curves={path!r}: {exc}") from None
    from spaceserve.runtime.policy.analytic.model import (
        ModelShape,
        analytic_curves,
        qwen2_vl_7b_config,
    )

    config = model_config
    try:
        shape = ModelShape.from_config(config) if config is not None else None
    except (AttributeError, TypeError, ValueError):
        config = shape = None
    key = (shape, tp, mm_encoder_tp_mode if tp > 1 else None)
    if key not in _CURVES:
        if tp > 1:
            from spaceserve.runtime.policy.analytic.tp import tensor_parallel_curves

            name = None if config is not None else "Qwen2-VL-7B"
            config = qwen2_vl_7b_config() if config is None else config
            _CURVES[key] = tensor_parallel_curves(config, tp=tp, name=name,
                                                  mm_encoder_tp_mode=mm_encoder_tp_mode)
        else:
            _CURVES[key] = analytic_curves(config)
    return _CURVES[key]


def load_curves(path: str | None, runner: Any) -> CurveSet:
    """`model_curves` of the runner's model (Qwen2-VL-7B's when the runner has no model
    config), of one rank of a tensor-parallel runner."""
    config = getattr(getattr(runner, "model", None), "config", None)
    return model_curves(path, config, tp=getattr(runner, "tp_size", 1),
                        mm_encoder_tp_mode=getattr(runner, "mm_encoder_tp_mode", "data"))
