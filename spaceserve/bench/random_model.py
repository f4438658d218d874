"""Random-weight engines of real model shapes, for benchmarks with no checkpoint at hand.

``--model qwen2-vl-7b-random`` (or ``qwen2.5-vl-7b-random``) builds the model from its config
(`policy.analytic.model`) through `spaceserve.models.from_state_dict` on one draw of
random weights, optionally with the LLM cut to `llm_layers` layers to save time (the vision
tower stays whole). There is no tokenizer or image processor: requests become token-id prompts
(`TokenPrompts`). Engines per mode share the weights: one model per attention backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from spaceserve.bench.prompts import TokenPrompts

if TYPE_CHECKING:
    import torch


def _qwen2_vl_7b() -> Any:
    from spaceserve.runtime.policy.analytic.model import qwen2_vl_7b_config

    return qwen2_vl_7b_config()


def _qwen2_5_vl_7b() -> Any:
    from spaceserve.runtime.policy.analytic.model import qwen2_5_vl_7b_config

    return qwen2_5_vl_7b_config()


RANDOM_MODELS: dict[str, Callable[[], Any]] = {
    "qwen2-vl-7b-random": _qwen2_vl_7b,
    "qwen2.5-vl-7b-random": _qwen2_5_vl_7b,
}


def is_random_model(name: str) -> bool:
    return name in RANDOM_MODELS


def random_config(name: str, llm_layers: int | None = None) -> Any:
    """The config of random-weight model `name`, its LLM cut to `llm_layers` layers when
    given; ValueError naming ``--model`` / ``--llm-layers`` otherwise."""
    if name not in RANDOM_MODELS:
        raise ValueError(f"--model {name!r} is not a random-weight model; those are: "
                         f"{', '.join(RANDOM_MODELS)}")
    config = RANDOM_MODELS[name]()
    text = config.text_config
    depth = int(text.num_hidden_layers)
    if llm_layers is not None:
        if isinstance(llm_layers, bool) or not isinstance(llm_layers, int) or \
                not 1 <= llm_layers <= depth:
            raise ValueError(f"--llm-layers {llm_layers!r} must be an int in 1..{depth} "
                             f"({name} has {depth} LLM layers)")
        text.num_hidden_layers = llm_layers
        if isinstance(getattr(text, "layer_types", None), list):
            text.layer_types = text.layer_types[:llm_layers]
    return config


def default_backend(mode: str, device: torch.device) -> str:
    """The engine's default attention backend of `mode` on `device` (one rule for every engine:
    `runtime.engine.config.default_attention_backend`)."""
    from spaceserve.runtime.engine.config import default_attention_backend

    return default_attention_backend(mode, device.type)


def _device(device: str | torch.device | None) -> torch.device:
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class RandomModels:
    """Model `name` with random weights, one instance per attention backend in `backends`
    (all from one draw of weights); bf16 on CUDA and fp32 on CPU unless `dtype` says."""

    def __init__(self, name: str, *, llm_layers: int | None = None,
                 backends: Iterable[str] = ("triton",), device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, seed: int = 0,
                 tensor_parallel_size: int = 1) -> None:
        import torch

        from spaceserve.models import from_state_dict, random_state_dict

        self.name, self.seed = name, seed
        self.config = random_config(name, llm_layers)
        self.llm_layers = int(self.config.text_config.num_hidden_layers)
        self.device = _device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.tensor_parallel_size = tensor_parallel_size
        self.backends = tuple(dict.fromkeys(backends))
        self.models: dict[str, Any] = {}
        if tensor_parallel_size > 1:  # every engine's ranks draw their own shards
            return
        state = random_state_dict(self.config, dtype=self.dtype, device=self.device, seed=seed)
        self.models = {b: from_state_dict(self.config, state, attention_backend=b,
                                          dtype=self.dtype, device=self.device)
                       for b in dict.fromkeys(backends)}
        del state

    def engine(self, mode: str, *, attention_backend: str | None = None, **config: Any
               ) -> tuple[Any, TokenPrompts, str | None]:
        """(engine, prompt maker, mode note) for `mode`; a mode this engine build lacks runs
        as temporal and the note says so. `config`: EngineConfig fields."""
        from spaceserve.runtime.engine.assemble import assemble_engine
        from spaceserve.runtime.engine.engine import Engine, EngineConfig
        from spaceserve.runtime.worker.qwen2_vl import Qwen2VLRunner
        from spaceserve.server.engine_client import resolve_mode

        run_mode, note = resolve_mode(mode)
        cfg = EngineConfig(mode=run_mode, **config)
        if cfg.tensor_parallel_size != self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size}: these models "
                             f"were set up for {self.tensor_parallel_size}")

        def make_runner(backend: str, device: torch.device) -> Any:
            if backend not in self.backends:
                raise ValueError(f"attention_backend={backend!r}: this model was built for "
                                 f"{', '.join(self.backends)}")
            if cfg.tensor_parallel_size > 1:
                from spaceserve.runtime.tp import TensorParallelRunner

                return TensorParallelRunner.for_engine(
                    cfg, model_config=self.config.to_dict(), seed=self.seed,
                    attention_backend=backend, dtype=self.dtype, device=device)
            return Qwen2VLRunner(self.models[backend], eos_token_ids=())

        engine = assemble_engine(Engine, cfg, make_runner, attention_backend=attention_backend,
                                 device=self.device)
        return engine, TokenPrompts(engine.runner.info, self.config, seed=self.seed), note
