"""What `bench serve` writes: tables.py (the console tables and JSON rows), plots.py (latency
and goodput against rate), timeline.py (the SM split over time)."""
