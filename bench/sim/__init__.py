"""Simulator studies: ``spaceserve sim`` sweeps on analytic curves (CPU, no GPU needed).

- `goodput_sweep`: requests within SLO, spatial against time-multiplexing, per SLO.
- `contention`: which conclusions survive co-running slowdowns of 0 to 35%.
- `routers`: request routers across many simulated GPUs.
- `tp`: Qwen2-VL-72B at TP 8, the vision encoder data-parallel against sharded.
"""
