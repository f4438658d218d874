"""SpaceServe's OpenAI-compatible server (`spaceserve serve`).

app.py (FastAPI routes, `create_app`, `ServerThread`, the CLI), protocol.py (request models,
response and chunk builders, `APIError`), chat.py (`ChatPreprocessor`: chat template, image
tokens), images.py (image URLs under limits), engine_client.py (`AsyncEngine`: the engine on a
background thread; `load_engine`), metrics.py (Prometheus text), tiny.py (the tiny checkpoint).
"""
