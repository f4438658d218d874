"""The engine users drive: `Engine`, `EngineConfig` and the front ends.

engine.py (`Engine`: add_request, step, abort; pipelined steps), config.py (`EngineConfig`,
every field validated; a leaf), frontends.py (`from_pretrained`, `generate`, `stream`),
outputs.py (detokenisation, stop strings, streamed outputs), load_runner.py (which runner
serves a checkpoint).
"""
