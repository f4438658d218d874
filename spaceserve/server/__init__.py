"""SpaceServe's OpenAI-compatible server (`spaceserve serve`).

The HTTP layer only: parse, admit, stream, map errors. app.py (FastAPI routes, `create_app`,
`ServerThread`, the CLI), protocol.py (request models, response and chunk builders, `APIError`,
input errors mapped to statuses), engine_client.py (`AsyncEngine`: the engine on a background
thread; `load_engine`), metrics.py (Prometheus text), tiny.py (the tiny checkpoint). Chat
templates, image decoding and limits are input processing: `spaceserve.runtime.inputs`.
"""
