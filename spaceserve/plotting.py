"""matplotlib for the package's figures: headless, and optional.

`pyplot()` selects the non-interactive Agg backend before pyplot is imported (servers and CI
have no display) and returns None when matplotlib is not installed, so a figure is skipped,
never a run failed.
"""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
