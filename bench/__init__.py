"""Benchmarks run from the source tree (``python -m bench.<room>.<script>``); not installed.

- `serving/`: the engine and the server under load, and their host-side costs.
- `kernels/`: kernel and model-stage benchmarks (GPU harness sections), the kernel demo.
- `sim/`: simulator studies on analytic curves.
- `attack/`: a hostile client against a live tiny server.
- `gpu/`: the GPU harness (sections, runner, facts); `kernel_suite/`: the pytest kernel suite.
- `common`, `rows`: timing, tables and result rows shared by all of the above.
"""
