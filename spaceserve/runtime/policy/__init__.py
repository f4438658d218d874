"""Scheduling policy: pure Python (no torch at import), shared by the engine and the simulator.

sis.py (`SpaceInferenceScheduler`: the SM split chosen online, or a whole-GPU encoder window),
sis_goodput.py (its goodput objective), sis_state.py (what SIS sees), sis_view.py (one round's
view of it, looked up once), twsrft.py (encoder jobs ordered by time-weighted shortest remaining
first), scheduling.py (`SchedulingPolicy`: curves, SLO and knobs together), curves.py and
curve_fields.py (resource-utility curves and their file format), model_curves.py (an engine's
curves: file or analytic), analytic/ (the roofline model; one rank at TP), contention.py
(co-run slowdown), slo.py (latency SLOs and goodput).
"""
