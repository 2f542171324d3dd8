"""Interactive figures. Every widget has a static twin: call ``draw`` yourself with fixed values.

``interactive_figure(draw, **sliders)`` wraps a function that draws a figure
from keyword values into ipywidgets sliders; outside a live kernel (the HTML
book) the committed static figures carry the same content.
"""
from __future__ import annotations

from typing import Callable

import matplotlib.pyplot as plt


def interactive_figure(draw: Callable, **controls):
    """``draw(**values) -> Figure`` driven by ipywidgets controls.

    Each control is an ipywidgets widget, or a ``(min, max, step[, value])`` tuple
    (int slider if all ints, float slider otherwise), or a list of options.
    Returns the ``ipywidgets.interactive`` object (display it, or let the cell show it).
    """
    import ipywidgets as w

    made = {}
    for name, spec in controls.items():
        if isinstance(spec, w.Widget):
            made[name] = spec
        elif isinstance(spec, list):
            made[name] = w.Dropdown(options=spec, description=name)
        elif isinstance(spec, tuple) and len(spec) in (3, 4):
            lo, hi, step = spec[:3]
            value = spec[3] if len(spec) == 4 else lo
            cls = w.IntSlider if all(isinstance(v, int) for v in spec) else w.FloatSlider
            made[name] = cls(min=lo, max=hi, step=step, value=value, description=name, continuous_update=False)
        else:
            raise TypeError(f"control {name!r} must be a widget, a list of options or a (min, max, step[, value]) "
                            f"tuple; got {spec!r}")

    def show(**values):
        fig = draw(**values)
        plt.show()
        return None

    return w.interactive(show, **made)
