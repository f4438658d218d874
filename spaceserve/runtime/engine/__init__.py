"""The engine users drive: `Engine`, `EngineConfig` and the front ends.

engine.py (`Engine`: add_request, step, abort; pipelined steps), config.py (`EngineConfig`:
every field declared once with its doc and flag, and validated; a leaf), setting.py (how a
field declares its doc and flag), args.py (the fields' flags for a parser, and parsed flags
back to an `EngineConfig`), assemble.py (the one path from a config and a runner to an engine;
the default attention backend), frontends.py (`from_pretrained`, `generate`, `stream`),
outputs.py (detokenisation, stop strings, streamed outputs), load_runner.py (which runner
serves a checkpoint).
"""
