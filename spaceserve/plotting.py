"""matplotlib for the package's figures: headless, optional, and captioned.

`pyplot()` selects the non-interactive Agg backend before pyplot is imported (servers and CI
have no display) and returns None when matplotlib is not installed, so a figure is skipped,
never a run failed.

`caption()` gives every figure the same two lines of provenance: its title (what ran, on which
device) and, where the numbers are not a GPU's measurement, a caveat annotated along its bottom
edge, so a figure copied out of its run folder still says what it is.
"""

from __future__ import annotations

import textwrap
from typing import Any

# Caveats: off a GPU a run shows that every path works, not how fast it is; a simulator's
# figure is a model's answer, not a measurement.
PLUMBING = "this proves plumbing, not performance"
MODELLED = "MODELLED by the SpaceServe simulator from resource-utility curves, not measured"
NOMINAL_SMS = "SM counts are nominal: a CPU has no SMs"


def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _wrap(text: str, fig: Any, fontsize: float, em: float) -> str:
    """`text` with each of its lines wrapped to the figure's width (`em`: a character's mean
    width in font sizes), so that no part of a title or caveat falls off the image."""
    width = max(20, int(fig.get_figwidth() * 72 / (fontsize * em)))
    return "\n".join(textwrap.fill(line, width) for line in text.split("\n"))


def caption(fig: Any, title: str, caveat: str = "", *, fontsize: float = 9
            ) -> tuple[float, float, float, float]:
    """Set `title` as `fig`'s suptitle and `caveat` (if any) as a bold annotation along its
    bottom edge, both wrapped to the figure's width; returns the rect (left, bottom, right,
    top) that `fig.tight_layout(rect=...)` should keep the axes inside (tight_layout makes room
    for the suptitle itself, not for the annotation)."""
    if title:
        fig.suptitle(_wrap(title, fig, fontsize, 0.55), fontsize=fontsize)
    bottom = 0.0
    if caveat:
        caveat = _wrap(caveat, fig, fontsize, 0.65)
        fig.text(0.5, 0.01, caveat, ha="center", va="bottom", fontsize=fontsize,
                 fontweight="bold", color="firebrick", gid="caveat")
        bottom = (0.06 + 0.17 * (caveat.count("\n") + 1)) / fig.get_figheight()
    return 0.0, bottom, 1.0, 1.0
