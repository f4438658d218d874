"""SpaceServe's OpenAI-compatible server (`spaceserve serve`).

The HTTP layer only: parse, admit, stream, map errors.

    app.py            FastAPI routes, `create_app`, `build_server`, the single-engine command
    serve.py          `spaceserve serve`: one engine in this process, or replicas
    flags.py          the command's flags (engine flags come from their `EngineConfig` fields)
    settings.py       what the flags set beside the engine, shared by both entry points
    media_args.py     video and remote-media flags
    engine_client.py  `AsyncEngine`: the engine on a background thread
    engine_load.py    `load_engine`, `resolve_mode`, the device label, `tune_interpreter`
    handles.py        admission, the preprocessing pool and pixel budget, request handles
    metrics.py        Prometheus text: queues, SM split, latency histograms
    openai/           the wire format: request models and builders (protocol.py), chat
                      preprocessing (preprocess.py), sampling fields (sampling.py), logprobs,
                      /v1/completions (completions.py), body reading and streaming (streams.py)
    transport/        below the routes: `APIError` (errors.py), the admission middleware
                      (guard.py), uvicorn's connection cap and header deadline
                      (connections.py), bounded shutdown (shutdown.py), `ServerThread`
    replicas/         engine replicas on Ray Serve, `ReplicaClient`

Chat templates, media decoding and limits are input processing (`spaceserve.runtime.inputs`);
the `--model tiny` checkpoint is built by `spaceserve.models.tiny`.
"""
