"""Sweeps over request rates: rates.py (capacity, the sweep, crossings, pooled goodput),
tune.py (best-temporal: the time-multiplexed configuration tuned per rate), plots.py (the
sweep's figures)."""
