"""Which runner serves a checkpoint: `load_runner` picks the single-process `Qwen2VLRunner`
or, at ``tensor_parallel_size`` > 1, the tensor-parallel one (`runtime/tp`)."""

from __future__ import annotations

import os
from typing import Any


def load_runner(path: str | os.PathLike, config: Any, *, attention_backend: str = "triton",
                dtype: Any = None, device: Any = None) -> Any:
    """The runner of a checkpoint directory for an `EngineConfig`: a `Qwen2VLRunner`, or at
    ``tensor_parallel_size`` > 1 a `tp.TensorParallelRunner` (worker processes started; close
    it when done)."""
    if config.tensor_parallel_size > 1:
        from spaceserve.runtime.tp.runner import TensorParallelRunner

        return TensorParallelRunner.for_engine(config, path=os.fspath(path),
                                               attention_backend=attention_backend, dtype=dtype,
                                               device=device)
    from spaceserve.runtime.worker.qwen2_vl import Qwen2VLRunner

    return Qwen2VLRunner.from_pretrained(path, attention_backend=attention_backend, dtype=dtype,
                                         device=device)
