"""SpaceServe: spatial multiplexing of a vision encoder and an LLM decoder on one GPU."""

__version__ = "0.1.0"

# Engine front door (imported lazily so `import spaceserve.kernels` stays light).
_ENGINE_EXPORTS = {
    "Engine": "spaceserve.runtime.engine.engine",
    "EngineConfig": "spaceserve.runtime.engine.engine",
    "SamplingParams": "spaceserve.runtime.core.request",
    "RequestOutput": "spaceserve.runtime.core.request",
}


def __getattr__(name: str):
    if name in _ENGINE_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_ENGINE_EXPORTS[name]), name)
    raise AttributeError(f"module 'spaceserve' has no attribute {name!r}")
