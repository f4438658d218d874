"""SpaceServe's OpenAI-compatible server (`spaceserve serve`).

The HTTP layer only: parse, admit, stream, map errors. app.py (FastAPI routes, `create_app`,
the single-engine command), flags.py (the command's flags) and settings.py (what they set,
shared by both entry points), serve.py (one engine or replicas), protocol.py (request models,
response and chunk builders, input errors mapped to statuses), errors.py (`APIError`),
guard.py (the admission middleware: body budget, body timeouts, request ids, draining, the
one JSON 500), connections.py (uvicorn's protocol with a connection cap and a header
deadline), handles.py (admission, the preprocessing pool and pixel budget, request handles:
shared by both engine clients), preprocess.py (a request's staged preprocessing under the
pixel budget), streams.py (the routes' request and response plumbing), shutdown.py (bounded
graceful shutdown), thread.py (`ServerThread`), engine_client.py (`AsyncEngine`: the engine
on a background thread; `load_engine`), replicas/ (engine replicas on Ray Serve,
`ReplicaClient`), media_args.py (video and remote media flags), metrics.py (Prometheus
text). Chat templates, media decoding and limits are input processing:
`spaceserve.runtime.inputs`; the `--model tiny` checkpoint is built by `spaceserve.models.tiny`.
"""
