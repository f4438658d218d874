"""A hostile client against a live ``spaceserve serve --model tiny`` (``python -m bench.attack``).

- `run`: the server's lifecycle, the context and rows, the table; `main`.
- `cases`: the attacks, one coroutine each (`bounds`: those on the per-request and per-client
  bounds).
- `probe`: the "hi" probe, run in its own process.
- `fairness`: the fair-share rows (parallel-sampling requests holding the batch, and a "hi").
"""
