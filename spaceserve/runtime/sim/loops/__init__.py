"""The simulator's step loops, each the engine's own loop priced by curves.

stepped.py (the time-multiplexed modes' step loop), pipelined.py (the same loop with the
engine's asynchronous scheduling: the host one step ahead), spatial_loop.py (the co-located
modes' step: the host, the decode lane), compute_lane.py (its compute stream: prefill chunks and
the encoder driver's launches), sis_window.py (SIS's whole-GPU window).
"""
