"""Loading the engine a server runs: `load_engine` (the one assembly path, with the chat
preprocessor), the mode it falls back to (`resolve_mode`), the device's label and SM count
for /health and the gauges, and `tune_interpreter` once the model is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spaceserve.runtime.modes import MODES

if TYPE_CHECKING:  # the engine (torch) is imported only by whoever builds one
    from spaceserve.runtime.engine.engine import Engine

KNOWN_MODES = MODES  # every mode SpaceServe names (runtime/modes.py)


SWITCH_INTERVAL_S = 0.001  # the interpreter's thread switch interval while serving


def tune_interpreter() -> None:
    """Tune the interpreter for serving, once the engine is loaded:

    - collect, then move every object alive now (the model, tokenizer, processor, modules)
      out of the garbage collector's view (`gc.freeze`), so a collection scans only what
      requests allocate. Unfrozen, a full collection across them stopped the event loop and
      the engine thread for up to 0.4 s under load (`bench.attack.overload`);
    - a 1 ms thread switch interval (Python's default is 5 ms): the event loop shares the GIL
      with the engine and preprocessing threads, and each time it wakes it waits for the
      thread holding the GIL to yield, up to an interval per thread ahead of it."""
    import gc
    import sys

    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def device_label(device: Any) -> str:
    """``"NVIDIA H200 (132 SMs)"`` for a CUDA device, ``"CPU (16 cores)"`` otherwise."""
    import os

    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.multi_processor_count} SMs)"
    return f"{device.type.upper()} ({os.cpu_count()} cores)"


def device_sms(engine: Engine) -> int:
    """The engine's device SMs (an H200's 132 when the device cannot say)."""
    try:
        return int(engine.device_sms)
    except Exception:  # no device query possible: count the H200's
        return 132


def resolve_mode(mode: str) -> tuple[str, str | None]:
    """(mode to run, note): a known mode this engine build lacks runs as temporal, said so."""
    from spaceserve.runtime.engine import engine as engine_module

    available = tuple(getattr(engine_module, "MODES", ("temporal",)))
    if mode in available:
        return mode, None
    if mode in KNOWN_MODES:
        return "temporal", (f"mode {mode!r} is not available in this engine build "
                            f"(available: {', '.join(available)}); running 'temporal' instead")
    raise ValueError(f"mode={mode!r} is unknown; modes: {', '.join(KNOWN_MODES)}")


def load_engine(model: str, *, mode: str = "temporal", device: str | None = None,
                dtype: str | None = None, attention_backend: str | None = None,
                **config: Any) -> tuple[Engine, Any, str | None]:
    """(engine, chat preprocessor, mode note) for a checkpoint directory or ``tiny``, built by
    the one assembly path (`runtime.engine.assemble`): CUDA when present, the checkpoint's
    dtype, the default attention backend of the mode and device unless given."""
    from spaceserve.runtime.engine.assemble import assemble_engine
    from spaceserve.runtime.engine.engine import Engine, EngineConfig
    from spaceserve.runtime.engine.load_runner import load_runner
    from spaceserve.runtime.inputs import ChatPreprocessor

    from ..models.tiny import resolve_model

    run_mode, note = resolve_mode(mode)
    cfg = EngineConfig(mode=run_mode, **config)
    path = resolve_model(model)
    pres: list[Any] = []

    def processors(runner: Any) -> tuple[Any, Any]:
        pre = ChatPreprocessor.from_pretrained(path, image_token_id=runner.info.image_token_id,
                                               video_token_id=runner.info.video_token_id)
        pres.append(pre)
        return pre.tokenizer, pre

    def make_runner(backend: str, dev: Any) -> Any:
        return load_runner(path, cfg, attention_backend=backend, dtype=dtype, device=dev)

    engine = assemble_engine(Engine, cfg, make_runner, attention_backend=attention_backend,
                             device=device, processors=processors)
    pre = pres[0]
    cap_video_tokens(pre, engine.max_model_len)
    return engine, pre, note


def cap_video_tokens(pre: Any, max_model_len: int) -> None:
    """A video's total token budget is the context at most (frames get smaller to fit)."""
    if getattr(pre, "video_sampling", None) is not None:
        pre.video_sampling = pre.video_sampling.within_tokens(max_model_len)


__all__ = ["KNOWN_MODES", "cap_video_tokens", "device_label", "device_sms",
           "tune_interpreter", "load_engine", "resolve_mode"]
