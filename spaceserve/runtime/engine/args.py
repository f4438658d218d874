"""Engine arguments declared once: the flags of `EngineConfig`'s fields, and the one way back.

Each flag is declared beside its field (`config.py`, `setting.Flag`): name, help (the field's
doc) and default (the field's, in the flag's unit). `add_engine_args` puts the chosen fields'
flags on a parser; `engine_kwargs` reads them back as `EngineConfig` keywords (checking a
``--curves`` file at once) and `engine_config` builds the config. ``spaceserve serve`` (one
engine or replicas), ``spaceserve bench serve`` and ``spaceserve sim`` (where it shares a knob)
all go through here. The loader's flags (``--device``, ``--dtype``, ``--attention-backend``) are
declared here too. argparse only: ``--help`` imports nothing heavy.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, fields
from typing import Any

from spaceserve.runtime.engine.config import ATTENTION_BACKENDS, EngineConfig
from spaceserve.runtime.engine.setting import Flag

# the engine flags of `spaceserve serve` (one engine or replicas), in its help's order
SERVE_FIELDS = ("mode", "tensor_parallel_size", "mm_encoder_tp_mode", "max_num_seqs",
                "max_num_batched_tokens", "num_kv_blocks", "max_model_len", "seed",
                "encoder_cache_bytes", "enable_prefix_caching", "fair_share", "slo",
                "encoder_window_s", "encoder_policy", "admission")
# the SM budget of the co-located modes
SM_BUDGET_FIELDS = ("encoder_sms", "encoder_splits", "curves", "sis_objective",
                    "sis_actions", "green_contexts")
SM_BUDGET_TITLE = "SM budget (co-located modes: spatial, spatial-static)"

# the loader's flags: not config fields, the same everywhere an engine is loaded
LOAD_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "device": (("--device",), "cuda or cpu (default: cuda when present)"),
    "dtype": (("--dtype",), "float32, float16, bfloat16 (default: the checkpoint's; "
                            "random-weight models: bfloat16 on CUDA, float32 on CPU)"),
    "attention_backend": (("--attention-backend",),
                          f"{' or '.join(ATTENTION_BACKENDS)} (default: triton on CUDA except "
                          "in shared mode, torch on CPU)"),
}


def engine_fields() -> dict[str, Field]:
    """{name: field} of every `EngineConfig` field that has a flag."""
    return {f.name: f for f in fields(EngineConfig) if f.metadata.get("flag") is not None}


def _flag(name: str) -> tuple[Field, Flag]:
    f = engine_fields().get(name)
    if f is None:
        raise KeyError(f"EngineConfig.{name} has no flag")
    return f, f.metadata["flag"]


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` with its ValueError shown as argparse's message (the flag and the reason)."""
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    wrapped.__name__ = getattr(parse, "__name__", "value")
    return wrapped


def add_engine_args(parser: Any, names: Iterable[str], *, prefix: str = "") -> None:
    """Add the flags of the `EngineConfig` fields `names` to `parser` (or an argument group),
    each with its field's doc as help (`prefix` before it) and its field's default."""
    for name in names:
        f, flag = _flag(name)
        text = prefix + (flag.help or f.metadata["doc"]).replace("%", "%%")
        default = f.default if f.default is not MISSING else None
        if flag.negate:
            parser.add_argument(*flag.names, dest=flag.dest, action="store_false",
                                default=bool(default), help=text)
            continue
        if default is not None and flag.from_field is not None:
            default = flag.from_field(default)
        kw: dict[str, Any] = {"dest": flag.dest, "default": default, "help": text}
        if flag.type is not None:
            kw["type"] = _argparse_type(flag.type) if flag.type not in (int, float) \
                else flag.type
        if flag.choices is not None:
            kw["choices"] = flag.choices
        if flag.metavar is not None:
            kw["metavar"] = flag.metavar
        parser.add_argument(*flag.names, **kw)


def add_sm_budget_args(parser: argparse.ArgumentParser, *, prefix: str = "") -> None:
    """The SM-budget flags, in a group of their own."""
    add_engine_args(parser.add_argument_group(SM_BUDGET_TITLE), SM_BUDGET_FIELDS,
                    prefix=prefix)


def add_load_args(parser: Any, names: Iterable[str] = tuple(LOAD_FLAGS), *,
                  prefix: str = "") -> None:
    """The loader's flags `names` (device, dtype, attention_backend); defaults None."""
    for name in names:
        option, text = LOAD_FLAGS[name]
        parser.add_argument(*option, dest=name, help=prefix + text)


def check_curves(path: str) -> str:
    """`path` made absolute (replicas may run elsewhere), once it is read as a curves file;
    ValueError naming the file and the field when it is not a valid one."""
    import os

    from spaceserve.runtime.policy.curves import CurveSet

    try:
        CurveSet.load(path)
    except OSError as exc:
        raise ValueError(f"--curves {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"--curves {path}: {exc}") from None
    return os.path.abspath(path)


def engine_kwargs(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """`EngineConfig` keywords from parsed flags: the fields `names` (those whose flags the
    parser was given), converted to the field's unit; a flag left None keeps the field's own
    default. A ``--curves`` file is read and checked here, so a malformed one is refused
    before anything loads."""
    out: dict[str, Any] = {}
    names = tuple(names)
    for name, f in engine_fields().items():
        flag: Flag = f.metadata["flag"]
        if name not in names:
            continue
        value = getattr(args, flag.dest)
        if value is not None and flag.to_field is not None:
            value = flag.to_field(value)
        if value is None and f.default is not None:  # keep the field's own default
            continue
        out[name] = value
    if out.get("curves"):
        out["curves"] = check_curves(out["curves"])
    return out


def load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The loader's keywords (device, dtype, attention_backend) the parser declared."""
    return {name: getattr(args, name) for name in LOAD_FLAGS if hasattr(args, name)}


def engine_config(args: argparse.Namespace, names: Iterable[str], **overrides: Any
                  ) -> EngineConfig:
    """The `EngineConfig` of parsed flags (`engine_kwargs` of `names`), `overrides` on top."""
    return EngineConfig(**{**engine_kwargs(args, names), **overrides})


__all__ = ["LOAD_FLAGS", "SERVE_FIELDS", "SM_BUDGET_FIELDS", "add_engine_args",
           "add_load_args", "add_sm_budget_args", "check_curves", "engine_config",
           "engine_fields", "engine_kwargs", "load_kwargs"]
