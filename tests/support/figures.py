"""Checks of the figures the bench draws."""
from __future__ import annotations

from typing import Any


def cut_off(fig: Any) -> list[str]:
    """What of ``fig`` is drawn past its edges: per panel, its title, labels or legend (a pixel of
    anti-aliasing allowed), as ``"panel N: left 12 px"``; empty when everything fits."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for k, ax in enumerate(fig.axes):
        box = ax.get_tightbbox(renderer)
        for side, past in (("left", -box.x0), ("right", box.x1 - fig.bbox.x1), ("bottom", -box.y0),
                           ("top", box.y1 - fig.bbox.y1)):
            if past > 1:
                out.append(f"panel {k}: {side} {past:.0f} px")
    return out
