"""Figures re-laid for a phone: the same figure drawn for a column of 350 CSS px.

A chapter's figure is drawn for the book's 688-px column (:data:`capslib.book.viz.COLUMN_PX`), its smallest
text 12 px there. On a phone the column is about half as wide, and a figure scaled to it would show its
tick labels 6-7 px high. Instead, the book keeps a second drawing of every such figure, made here from a
copy of the figure: its panels flow into as many columns as fit the phone's column (one, for the book's
usual two- and three-panel figures; several, for a grid of small images), each panel at least as large as
before, the fonts unchanged. The page shows it where its column is narrow (``book/_static/capsbook.js``).

Nothing here changes the figure the notebook shows: the copy is made by pickling.
"""
from __future__ import annotations

import io
import math
import pickle

from .viz import FIGURE_DPI, MIN_TEXT_PX, PAD_INCHES, text_on_page

# a 400-px window gives the text 368 px (tests/test_browser.py); a little less leaves room for smaller phones
PHONE_COLUMN_PX = 350
MAX_PANEL_GROWTH = 1.6     # a panel grows at most this much when it gets a row of its own
RETINA_DPI = 2 * FIGURE_DPI


def _is_colorbar(ax) -> bool:
    return hasattr(ax, "_colorbar") or getattr(ax, "_label", "") == "<colorbar>"


def _panels(fig):
    """The figure's visible panels grouped by the cell of the figure's grid they occupy, in reading order:
    a list of ``(top spec, [axes])``; None where the figure is not one grid of panels (axes placed by hand,
    panels of two different grids)."""
    groups: dict = {}
    grids = set()
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        if spec is None:
            if _is_colorbar(ax):         # placed by the layout engine beside its parents
                continue
            return None
        top = spec.get_topmost_subplotspec()   # a colour bar made beside a panel nests both in the panel's cell
        grids.add(id(top.get_gridspec()))
        cell = (top.rowspan.start, top.colspan.start, top.rowspan.stop, top.colspan.stop)   # reading order
        groups.setdefault(cell, (top, []))[1].append(ax)
    if len(grids) != 1:
        return None
    visible = [(cell, g) for cell, g in groups.items() if any(ax.get_visible() for ax in g[1])]
    if not visible:
        return None
    hidden = [ax for g in groups.values() if not any(a.get_visible() for a in g[1]) for ax in g[1]]
    shown = [g for _, g in sorted(visible, key=lambda kv: kv[0])]
    shown[-1][1].extend(hidden)   # a hidden panel (an unused grid cell) shares the last one's cell, unseen; a colour
    return shown                  # bar made for the whole grid still finds it among its parents


def _cell_inches(top, fig) -> tuple[float, float]:
    """Width and height (inches) that the original grid gives the cell ``top``."""
    gs = top.get_gridspec()
    nrows, ncols = gs.get_geometry()
    wr = gs.get_width_ratios() or [1] * ncols
    hr = gs.get_height_ratios() or [1] * nrows
    w, h = fig.get_size_inches()
    return (w * sum(wr[top.colspan.start:top.colspan.stop]) / sum(wr),
            h * sum(hr[top.rowspan.start:top.rowspan.stop]) / sum(hr))


def _move(group, spec) -> None:
    """Put every axes of ``group`` into ``spec``: an axes directly in the old cell takes ``spec``; one in a grid
    nested in the old cell (a panel and its colour bar) moves with its grid."""
    for ax in group:
        own = ax.get_subplotspec()
        if own.get_topmost_subplotspec() is own:
            ax.set_subplotspec(spec)
            continue
        gs = own.get_gridspec()
        while getattr(gs, "_subplot_spec", None) is not None:
            parent = gs._subplot_spec
            if parent.get_topmost_subplotspec() is parent:
                gs._subplot_spec = spec
                break
            gs = parent.get_gridspec()


def _png(fig, dpi: float = RETINA_DPI) -> bytes:
    """The figure as a retina PNG of at most 256 colours (a plot's flat colours and antialiased edges survive;
    the file is about a third of matplotlib's, so the phone drawings add little to the published site)."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", pad_inches=PAD_INCHES)
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                                     dither=Image.Dither.NONE)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True, dpi=(dpi, dpi))
    return out.getvalue()


def _drawn_width_px(fig) -> float:
    fig.canvas.draw()
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    return (box.width + 2 * PAD_INCHES) * FIGURE_DPI


def is_diagram(fig) -> bool:
    """Whether ``fig`` holds a diagram: a panel without axes or images, its boxes and labels placed by hand in
    its own coordinates (two or more texts or arrows). Shrinking its geometry around unchanged fonts would
    pile the labels onto the boxes, so a diagram is not re-laid: it is drawn narrow enough to be scaled into a
    phone's column legibly (tests/test_outputs.py holds it to that)."""
    for ax in fig.axes:
        if ax.get_visible() and not ax.axison and not ax.images and not _is_colorbar(ax):
            if len(ax.texts) + len([p for p in ax.patches if type(p).__name__ == "FancyArrowPatch"]) >= 2:
                return True
    return False


def _image_height(group, width: float) -> float | None:
    """The height (inches) a panel of images drawn at equal aspect needs at ``width``; None for other panels."""
    main = [ax for ax in group if not _is_colorbar(ax) and ax.get_visible()]
    if not main or not all(ax.images and ax.get_aspect() == 1.0 for ax in main):
        return None
    x0, x1 = main[0].get_xlim()
    y0, y1 = main[0].get_ylim()
    titles = max((1 + t.get_text().count("\n") for ax in main for t in (ax.title, ax._left_title, ax._right_title)
                  if t.get_text()), default=0)
    below = 0.55 if any(ax.axison and (ax.get_xlabel() or ax.get_xticks().size) for ax in main) else 0.0
    return width * abs(y1 - y0) / max(abs(x1 - x0), 1e-9) + 0.3 * titles + below + 0.05


def _legend_inches(group) -> float:
    """The height (inches) of the tallest legend inside a panel of ``group`` (0 for none), from its entries."""
    tallest = 0.0
    for ax in group:
        legend = ax.get_legend()
        if legend is None or not legend.get_visible():
            continue
        rows = math.ceil(len(legend.texts) / max(1, legend._ncols)) + bool(legend.get_title().get_text())
        tallest = max(tallest, rows * legend._fontsize * 1.7 / 72 + 0.1)
    return tallest


def _relayout(fig, column_px: float) -> bool:
    """Re-lay ``fig`` (a copy) for a column ``column_px`` CSS px wide; False where it cannot be.

    The figure's grid of ``R`` rows and ``C`` columns keeps as many of its columns side by side as fit
    (``m``); the rest follow below in chunks of ``m`` columns, each chunk with all ``R`` rows, so that a panel
    stays above the panel it stood above (a digit above its map). Where only one column fits, or a panel
    spans several columns, the panels follow one another in reading order. A panel that gets more room than
    before grows (at most :data:`MAX_PANEL_GROWTH`), its height with it; a panel of images takes the height
    its images need."""
    panels = _panels(fig)
    if not panels:
        return False
    width = column_px / FIGURE_DPI - 2 * PAD_INCHES - 0.05
    nrows, ncols = panels[0][0].get_gridspec().get_geometry()
    cells = [_cell_inches(top, fig) for top, _ in panels]
    spans = [top.colspan.stop - top.colspan.start for top, _ in panels]
    widest = max(w for w, _ in cells)
    m = max(1, min(ncols, int(width / widest + 0.1)))
    if m == 1 or max(spans) > 1:
        m = 1
        place = [(k, 0) for k in range(len(panels))]                 # one after another, reading order
    else:
        place = [((top.colspan.start // m) * nrows + top.rowspan.start, top.colspan.start % m) for top, _ in panels]
    rows = max(r for r, _ in place) + 1
    panel_width = width / m
    grow = min(MAX_PANEL_GROWTH, panel_width / widest)
    heights = [0.0] * rows
    for (r, _), (_, group), (w, h) in zip(place, panels, cells):
        need = _image_height(group, panel_width)
        if need is None:        # grown with its width, at least 0.85 of it high, no taller than it and before
            need = min(max(h * grow, 0.85 * panel_width), max(h, 1.1 * panel_width))
            need = max(need, 2.5 * _legend_inches(group) + 1.0)   # a legend inside covers at most 40 %
        heights[r] = max(heights[r], need)
    used = [k for k in range(rows) if heights[k] > 0]
    heights = [heights[k] for k in used]
    place = [(used.index(r), c) for r, c in place]
    extra = 0.0
    if fig._suptitle is not None and fig._suptitle.get_text():
        fig._suptitle.set_wrap(True)
        extra += 0.3 * (1 + fig._suptitle.get_text().count("\n"))
    for legend in list(fig.legends):
        legend = _legend_columns(fig, legend, min(legend._ncols, 2))
        extra += 0.25 * math.ceil(len(legend.get_texts()) / legend._ncols) + 0.1
    from matplotlib.gridspec import GridSpec

    gs = GridSpec(len(heights), m, figure=fig, height_ratios=heights)
    for (r, c), (_, group) in zip(place, panels):
        _move(group, gs[r, c])
        for ax in group:
            if _is_colorbar(ax):
                continue
            if len(ax.get_shared_x_axes().get_siblings(ax)) > 1:    # shared axes show their own ticks again
                ax.tick_params(labelbottom=True)
            if c == 0 and len(ax.get_shared_y_axes().get_siblings(ax)) > 1:
                ax.tick_params(labelleft=True)
    for ax in fig.axes:
        for text in (ax.title, ax.xaxis.label):       # long titles and axis labels break into lines
            if text.get_text():
                text.set_wrap(True)
        if ax._left_title.get_text():      # a row's caption over its first panel: it may run over the next ones
            ax._left_title.set_in_layout(False)
    try:
        fig.set_layout_engine("constrained")
    except RuntimeError:      # a colour bar made beside a panel under tight_layout: that engine again
        fig.set_layout_engine("tight")
    else:
        extra += _grid_colorbars_below(fig)
    fig.set_size_inches(width, sum(heights) + extra)
    return True


def _grid_colorbars_below(fig) -> float:
    """Colour bars that the layout engine placed beside their panels (``fig.colorbar(..., ax=axes)``) keep
    to the side of the re-laid panels, where the panels' titles run under them: each is drawn again,
    horizontal, under the panels it was made for, or under the whole grid where those panels now stand in rows
    apart (a map under each digit, the digits in chunks: placed for them, the bar would make the layout engine
    squeeze every panel). Returns the height (inches) they add."""
    added = 0.0
    panels = [ax for ax in fig.axes if not _is_colorbar(ax) and ax.get_subplotspec() is not None]
    for ax in list(fig.axes):
        info = getattr(ax, "_colorbar_info", None)        # only on colour bars the layout engine places
        if info is None or not hasattr(ax, "_colorbar"):
            continue
        cb = ax._colorbar
        label = ax.get_ylabel() if cb.orientation == "vertical" else ax.get_xlabel()
        parents = list(info["parents"])
        rows = {r for p in parents for r in p.get_subplotspec().get_topmost_subplotspec().rowspan}
        if rows and max(rows) - min(rows) + 1 > len(rows):
            parents = panels
        for parent in info["parents"]:                    # the layout engine keeps room for a parent's bars
            if ax in getattr(parent, "_colorbars", []):
                parent._colorbars.remove(ax)
        fig.delaxes(ax)
        fig.colorbar(cb.mappable, ax=parents, orientation="horizontal", location="bottom",
                     label=label, aspect=30, shrink=0.9)
        added += 0.7
    return added


_KEEP = "\x00"   # stands for a space inside $...$ while a label is wrapped


def _wrap_label(label: str, chars: int) -> str:
    """``label`` broken at its spaces into lines of about ``chars`` characters, never inside ``$...$`` (a label
    with an odd number of ``$`` is left whole)."""
    import textwrap

    parts = label.split("$")
    if len(parts) == 1:
        return "\n".join(textwrap.wrap(label, chars)) or label
    if len(parts) % 2 == 0:
        return label
    guarded = "$".join(p.replace(" ", _KEEP) if k % 2 else p for k, p in enumerate(parts))
    # no break inside a word or at a hyphen: either could fall inside $...$
    lines = textwrap.wrap(guarded, chars, break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines).replace(_KEEP, " ") or label


def _wrapped(labels: list[str], fig, fontsize: float, ncols: int = 1) -> list[str]:
    """Legend labels broken into lines that fit ``ncols`` columns of the figure's width (:func:`_wrap_label`)."""
    chars = max(12, int((fig.get_size_inches()[0] / ncols - 0.6) * 72 / (0.52 * fontsize)))
    return [_wrap_label(label, chars) for label in labels]


def _legend_kwargs(fig, legend, ncols: int) -> dict:
    """What a legend is made again from: its entries (labels wrapped to ``ncols`` columns), font, frame, title."""
    return dict(handles=list(legend.legend_handles), ncols=ncols, fontsize=legend._fontsize,
                labels=_wrapped([t.get_text() for t in legend.texts], fig, legend._fontsize, ncols),
                frameon=legend.get_frame_on(), title=legend.get_title().get_text() or None)


def _legend_columns(fig, legend, ncols: int):
    """The figure legend ``legend`` made again with ``ncols`` columns (matplotlib packs a legend once, when it
    is made); returns the new legend."""
    if legend._ncols == ncols:
        return legend
    from matplotlib.legend import Legend

    name = {code: text for text, code in Legend.codes.items()}.get(legend._loc_real, "best")
    outside = getattr(legend, "_outside_loc", None)
    if outside in ("lower", "upper"):
        loc = f"outside {name}"
    elif outside in ("left", "right"):
        loc = f"outside {outside} {name.split()[0]}"
    else:
        loc = legend._loc_real
    kept = _legend_kwargs(fig, legend, ncols)
    if legend._bbox_to_anchor is not None and not outside:
        kept["bbox_to_anchor"] = legend.get_bbox_to_anchor()
    legend.remove()
    return fig.legend(loc=loc, **kept)


def _legends_below(fig) -> None:
    """A panel's legend wider than half its panel (it would cover the data, or push the panel narrow) goes
    under the panel, below its axis labels, in one column."""
    from matplotlib.transforms import ScaledTranslation

    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend() is not None and not _is_colorbar(ax)]
    for _, legend in legends:       # the layout engine would shrink a panel to make room for its wide legend
        legend.set_in_layout(False)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    grown = 0.0
    for ax, legend in legends:
        if not legend.get_visible() or legend.get_window_extent(renderer).width <= 0.5 * ax.bbox.width:
            legend.set_in_layout(True)
            continue
        below = (ax.bbox.y0 - ax.xaxis.get_tightbbox(renderer).y0) / fig.dpi + 0.08 if ax.xaxis.get_visible() else 0.08
        kept = _legend_kwargs(fig, legend, 1)
        legend.remove()
        new = ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0),
                        bbox_transform=ax.transAxes + ScaledTranslation(0, -below, fig.dpi_scale_trans), **kept)
        grown += new.get_window_extent(renderer).height / fig.dpi + 0.1
    if grown:
        w, h = fig.get_size_inches()
        fig.set_size_inches(w, h + grown)


def _thin_ticks(fig) -> None:
    """Where a panel's x tick labels now run into each other, only every k-th is shown (the smallest k that
    parts them)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        if len(labels) < 3:
            continue
        boxes = [t.get_window_extent(renderer) for t in labels]
        gap = 0.15 * fig.dpi * labels[0].get_fontsize() / 72
        for k in range(1, len(labels)):
            kept = boxes[::k]
            if all(b.x0 >= a.x1 + gap for a, b in zip(kept, kept[1:])):
                break
        for i, t in enumerate(labels):
            t.set_visible(i % k == 0)


def _fit_legends(fig) -> None:
    """A figure legend wider than the figure goes to one column."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for legend in list(fig.legends):
        if legend._ncols > 1 and legend.get_window_extent(renderer).width > 0.98 * fig.bbox.width:
            _legend_columns(fig, legend, 1)
            w, h = fig.get_size_inches()
            fig.set_size_inches(w, h + 0.25 * (len(legend.get_texts()) - 1))


def narrow_png(fig, column_px: float = PHONE_COLUMN_PX) -> tuple[bytes, dict] | None:
    """The figure re-laid for a ``column_px``-wide column, as a retina PNG, with what
    :func:`capslib.book.viz.text_on_page` measures of it there; None where the figure already reads at that
    width (its smallest text 12 px or more, scaled to the column) or cannot be re-laid."""
    if not column_px > 0:
        raise ValueError(f"column_px must be positive; got {column_px}")
    here = text_on_page(fig, column_px=column_px)
    if here["smallest_px"] is None or here["smallest_px"] >= MIN_TEXT_PX or is_diagram(fig):
        return None
    try:
        return _narrow(fig, column_px)
    except Exception:   # a figure this cannot re-lay keeps its one drawing (tests/test_outputs.py names it)
        return None


def _narrow(fig, column_px: float) -> tuple[bytes, dict] | None:
    try:
        copy = pickle.loads(pickle.dumps(fig))
    except Exception:                         # a figure holding something that cannot be pickled: left as it is
        return None
    import warnings

    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(copy)
    with warnings.catch_warnings(record=True) as said:      # nothing of the second drawing reaches the notebook
        warnings.simplefilter("always")
        if not _relayout(copy, column_px):
            plt.close(copy)
            return None
        _legends_below(copy)
        _fit_legends(copy)
        _thin_ticks(copy)
        drawn = _drawn_width_px(copy)
        if drawn > column_px + 1:     # labels wider than planned: narrow the panels by as much, at most by 15 %
            w, h = copy.get_size_inches()
            copy.set_size_inches(max(0.85 * w, w - (drawn - column_px) / FIGURE_DPI), h)
        for _ in range(4):            # a layout engine that found no room for the labels: a taller figure
            said.clear()
            copy.canvas.draw()
            if not any("collapsed" in str(warning.message) for warning in said):
                break
            w, h = copy.get_size_inches()
            copy.set_size_inches(w, h + 0.6)
        else:
            plt.close(copy)
            return None
        info = text_on_page(copy, column_px=column_px)
        data = _png(copy)
    plt.close(copy)
    return data, info
