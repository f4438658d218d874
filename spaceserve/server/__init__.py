"""SpaceServe's OpenAI-compatible server (`spaceserve serve`).

The HTTP layer only: parse, admit, stream, map errors. app.py (FastAPI routes, `create_app`,
the CLI), protocol.py (request models, response and chunk builders, `APIError`, input errors
mapped to statuses), guard.py (the admission middleware: body budget, body timeouts, request
ids, draining, the one JSON 500), connections.py (uvicorn's protocol with a connection cap and
a header deadline), preprocess.py (a request's staged preprocessing under the pixel budget),
streams.py (the routes' request and response plumbing), shutdown.py (bounded graceful
shutdown, `ServerThread`), engine_client.py (`AsyncEngine`: the engine on a background thread;
`load_engine`), metrics.py (Prometheus text), tiny.py (the tiny checkpoint). Chat templates,
image decoding and limits are input processing: `spaceserve.runtime.inputs`.
"""
