"""Serving benchmarks: the engine and the server under load, and their host-side costs.

- `serving`: TPOT, ITL and TTFT against image rate per mode, beside the simulator ("serving").
- `colocation`: decode beside an image stream per mode, against the sim ("colocation"); its
  load is `colocation_load`; `colocation_driver` compares encoder drivers on the host (CPU).
- `server_overhead`: what HTTP adds per request over in-process ``Engine.generate``.
- `compare_aiperf`: ``spaceserve bench serve --backend http`` against aiperf; `sse_stub` is a
  chat server of known timing for measuring such clients.
- `multiturn`: multi-turn image chat, caches on and off.
- `engine_step`, `planner`: host time of one engine step and of planning one model step.
- `video_inputs`: CPU cost of decoding and patching a video input.
- `cli_help`: wall time of ``spaceserve <cmd> --help``.
"""
