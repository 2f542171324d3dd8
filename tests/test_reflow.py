"""Figures re-laid for a phone (capslib.book.reflow), written beside the players' frames, found by the book."""
import base64
import io
import json
import pickle
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest

from capslib.book import reflow, viz, widgets

PHONE = reflow.PHONE_COLUMN_PX


@pytest.fixture(autouse=True)
def _frames_out_of_the_book(monkeypatch, tmp_path):
    monkeypatch.setenv("CAPSBOOK_FRAMES_DIR", str(tmp_path / "frames-of-the-tests"))
    yield
    plt.close("all")


def _css_width(png: bytes) -> float:
    return widgets.png_size(png)[0] * viz.FIGURE_DPI / reflow.RETINA_DPI


def _three_panels(**kw):
    fig, axes = plt.subplots(1, 3, figsize=(7.2, 2.9), layout="constrained", **kw)
    for k, ax in enumerate(axes):
        ax.plot(np.arange(10), np.arange(10) * (k + 1), label=f"a curve of run {k}")
        ax.set_title(f"panel {k + 1}")
        ax.set_xlabel("epoch")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3)
    return fig, axes


def _relaid(fig, draw: bool = True):
    copy = pickle.loads(pickle.dumps(fig))
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(copy)
    assert reflow._relayout(copy, PHONE)
    if draw:
        copy.canvas.draw()
    return copy


def test_panels_side_by_side_stack_into_one_column_that_reads_on_a_phone():
    fig, axes = _three_panels()
    wide = viz.text_on_page(fig, column_px=PHONE)          # draws it: the layout engine has placed the panels
    before = [tuple(ax.get_position().bounds) for ax in axes], tuple(fig.get_size_inches())
    assert wide["smallest_px"] < 9            # scaled to the phone, the figure itself would not read
    png, info = reflow.narrow_png(fig)
    assert _css_width(png) <= PHONE + 1 and info["scale"] == 1.0 and info["smallest_px"] >= viz.MIN_TEXT_PX
    # the figure the notebook shows is untouched (the drawing is made from a copy)
    assert [tuple(ax.get_position().bounds) for ax in axes] == [pytest.approx(b) for b in before[0]]
    assert tuple(fig.get_size_inches()) == before[1]
    copy = _relaid(fig)
    boxes = sorted((ax.get_position() for ax in copy.axes), key=lambda b: -b.y0)
    assert all(a.y0 > b.y1 for a, b in zip(boxes, boxes[1:]))       # one above the other, in reading order
    top_down = sorted(copy.axes, key=lambda a: -a.get_position().y0)
    assert [ax.get_title() for ax in top_down] == ["panel 1", "panel 2", "panel 3"]


def test_a_grid_of_small_images_keeps_each_column_together_and_several_to_a_row():
    fig, axes = plt.subplots(2, 8, figsize=(7.2, 2.6), layout="constrained")
    rng = np.random.default_rng(0)
    for k in range(8):
        axes[0, k].imshow(rng.random((28, 28)), cmap="gray")
        axes[1, k].imshow(rng.random((6, 6)))
        axes[0, k].set_label(f"digit {k}")
        axes[1, k].set_label(f"map {k}")
        axes[0, k].axis("off"), axes[1, k].axis("off")
    copy = _relaid(fig)
    pos = {ax.get_label(): ax.get_position() for ax in copy.axes}
    for k in range(8):                       # each digit right above its own map
        assert pos[f"digit {k}"].y0 > pos[f"map {k}"].y1
        assert pos[f"digit {k}"].x0 == pytest.approx(pos[f"map {k}"].x0, abs=0.02)
    columns = {round(p.x0, 2) for p in pos.values()}
    assert 1 < len(columns) < 8                # several panels to a row, fewer than the original eight
    assert reflow.narrow_png(fig) is None      # no text: scaled down, it loses nothing a reader must read


def test_shared_axes_show_their_tick_labels_and_a_wide_legend_goes_to_one_column():
    fig, axes = _three_panels(sharey=True)
    fig.canvas.draw()
    assert not axes[1].yaxis.get_ticklabels()     # sharing y, the second panel shows no tick labels
    copy = _relaid(fig)
    reflow._fit_legends(copy)
    copy.canvas.draw()
    for ax in copy.axes:
        assert any(t.get_visible() and t.get_text() for t in ax.yaxis.get_ticklabels())
    (legend,) = copy.legends
    assert legend._ncols == 1 and [t.get_text() for t in legend.texts] == [f"a curve of run {k}" for k in range(1)]
    assert legend.get_window_extent().width <= copy.bbox.width


def test_a_figure_that_reads_on_a_phone_or_is_placed_by_hand_gets_no_second_drawing():
    small, ax = plt.subplots(figsize=(3.2, 2.4))
    ax.plot([0, 1], [1, 0])
    assert reflow.narrow_png(small) is None
    by_hand = plt.figure(figsize=(7.2, 3))
    by_hand.add_axes((0.1, 0.1, 0.8, 0.8)).plot([0, 1], [1, 0])
    assert reflow.narrow_png(by_hand) is None
    with pytest.raises(ValueError, match="column_px"):
        reflow.narrow_png(small, column_px=0)


def test_the_drawing_is_named_by_the_wide_pngs_digest_and_the_book_finds_it(tmp_path):
    import hashlib

    from capslib.tools import reproduce, sphinx_figures

    static = tmp_path / "_static"
    static.mkdir()
    path = widgets.write_narrow(b"wide png", b"narrow png", root=static / "frames")
    h = hashlib.sha256(b"wide png").hexdigest()
    assert path == f"frames/{h[:16]}/narrow.png" and (static / path).read_bytes() == b"narrow png"
    assert reproduce.FRAME_FILE.fullmatch(path) and reproduce.FRAME_FILE.fullmatch(f"frames/{h[:16]}/n12.png")
    # myst-nb names the figure's image by the same digest; the extension marks it
    assert sphinx_figures.phone_drawing(f"../_build/jupyter_execute/{h}.png", [static]) == h[:16]
    assert sphinx_figures.phone_drawing(f"{'0' * 64}.png", [static]) is None
    assert sphinx_figures.phone_drawing("logo.png", [static]) is None
    assert widgets.write_narrow(b"x", b"y", root=tmp_path / "no" / "book" / "frames") is None


def test_the_kernels_formatter_writes_the_drawing_and_records_it(monkeypatch, tmp_path):
    from IPython.core.formatters import PNGFormatter
    from matplotlib.figure import Figure

    from capslib.book import session

    root = tmp_path / "_static" / "frames"
    monkeypatch.setenv("CAPSBOOK_FRAMES_DIR", str(root))
    monkeypatch.setenv("CAPSBOOK_PHONE_FIGURES", "1")      # what the executions whose outputs go into the book set
    fmt = PNGFormatter()
    fmt.for_type(Figure, lambda fig: (base64.b64encode(b"the wide png").decode(), {"width": 720}))
    measuring = session._measuring(fmt.lookup_by_type(Figure))
    fig, _ = _three_panels()
    _, meta = measuring(fig)
    info = meta["capsbook"]
    assert info["narrow"].endswith("/narrow.png") and info["narrow_px"] >= viz.MIN_TEXT_PX
    assert (root.parent / info["narrow"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setenv("CAPSBOOK_PHONE_FIGURES", "0")          # runs whose outputs are not kept skip it
    assert not widgets.phone_figures() and "narrow" not in measuring(fig)[1]["capsbook"]
    monkeypatch.delenv("CAPSBOOK_PHONE_FIGURES")               # and so does a reader's own run
    assert not widgets.phone_figures() and "narrow" not in measuring(fig)[1]["capsbook"]


def test_only_the_executions_that_write_the_book_make_phone_drawings(monkeypatch):
    from capslib.tools.execute import environment

    monkeypatch.delenv("CAPSBOOK_PHONE_FIGURES", raising=False)
    assert environment("ci")["CAPSBOOK_PHONE_FIGURES"] == "1"            # reproduce, make book
    monkeypatch.setenv("CAPSBOOK_PHONE_FIGURES", "0")
    assert environment("ci")["CAPSBOOK_PHONE_FIGURES"] == "1"            # whatever the caller's shell says
    assert environment("ci", CAPSBOOK_PHONE_FIGURES="0")["CAPSBOOK_PHONE_FIGURES"] == "0"   # smoke runs


def test_a_player_carries_its_frames_phone_drawings(tmp_path):
    frames = []
    for k in range(3):
        fig, axes = _three_panels()
        axes[0].set_title(f"frame {k}")
        frames.append(fig)
    (tmp_path / "_static").mkdir()
    narrow, pngs = [], []
    for fig in frames:
        narrow.append(reflow.narrow_png(fig))
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=widgets.FRAME_DPI, bbox_inches="tight")
        pngs.append(buf.getvalue())
    files = widgets.write_frames(pngs, root=tmp_path / "_static" / "frames", narrow=[n[0] for n in narrow])
    folder = tmp_path / "_static" / files[0].rsplit("/", 1)[0]
    assert sorted(p.name for p in folder.iterdir()) == ["0.png", "1.png", "2.png", "n0.png", "n1.png", "n2.png"]
    page = widgets.player_html(pngs, ["a", "b", "c"], 0, "t", files=files, narrow=[n[0] for n in narrow],
                               narrow_smallest_text_px=min(n[1]["smallest_px"] for n in narrow))
    data = json.loads(re.search(r'<script type="application/json">(.*?)</script>', page).group(1))
    assert data["narrow"] == [f.replace(f"/{k}.png", f"/n{k}.png") for k, f in enumerate(files)]
    assert data["narrowWidth"] <= PHONE + 1 < data["width"]
    assert 'data-narrow-smallest-text-px="' in page
    with pytest.raises(ValueError, match="narrow frames go with frame files"):
        widgets.player_html(pngs, ["a", "b", "c"], 0, "t", narrow=[n[0] for n in narrow])
    with pytest.raises(ValueError, match="one narrow frame per frame"):
        widgets.write_frames(pngs, root=tmp_path / "_static" / "frames", narrow=[narrow[0][0]])


def test_a_diagram_is_not_re_laid():
    fig, ax = plt.subplots(figsize=(9, 4.6))
    ax.axis("off")
    ax.set_xlim(0, 10)
    ax.text(1, 1, "a box", fontsize=12, bbox=dict(boxstyle="round"))
    ax.annotate("", (5, 1), (1.5, 1), arrowprops=dict(arrowstyle="->"))
    ax.text(5.5, 1, "another box", fontsize=10)
    assert reflow.is_diagram(fig) and reflow.narrow_png(fig) is None
    plot, axes = _three_panels()
    assert not reflow.is_diagram(plot)


def test_a_wide_legend_goes_under_its_panel_and_crowded_ticks_thin_out():
    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    angles = np.arange(0, 181, 15)
    ax.plot(angles, np.ones(len(angles)), label="a first model with a long description (mean; thin lines: seeds)")
    ax.plot(angles, np.cos(angles / 60), label="a second model, described at length as well")
    ax.set_xticks(angles)
    ax.set_xlabel("turn (degrees)")
    ax.legend(loc="lower left")
    png, info = reflow.narrow_png(fig)
    assert _css_width(png) <= PHONE + 1 and info["smallest_px"] >= viz.MIN_TEXT_PX
    copy = _relaid(fig, draw=False)       # drawn with its legend inside, the panel would collapse
    reflow._legends_below(copy)
    reflow._thin_ticks(copy)
    copy.canvas.draw()
    (panel,) = copy.axes
    legend = panel.get_legend()
    assert legend.get_window_extent().y1 < panel.xaxis.get_tightbbox().y0       # under the axis label
    assert all("\n" in t.get_text() for t in legend.texts)                          # wrapped to the column
    shown = [t for t in panel.get_xticklabels() if t.get_visible()]
    assert 3 <= len(shown) < len(angles)
    boxes = [t.get_window_extent() for t in shown]
    assert all(b.x0 > a.x1 for a, b in zip(boxes, boxes[1:]))


def test_a_grid_with_an_unused_cell_and_one_colour_bar_for_all_is_re_laid():
    rng = np.random.default_rng(1)
    fig = viz.heatmap_grid([rng.random((8, 4)) for _ in range(5)], [f"epoch {k}" for k in range(5)], "route j",
                           "class", "mean r(j)", per_row=3)
    png, info = reflow._narrow(fig, PHONE)                # raises where the layout engine cannot place it
    assert _css_width(png) <= PHONE + 1 and info["smallest_px"] >= viz.MIN_TEXT_PX


def test_a_colour_bar_made_for_some_panels_goes_under_them_and_clear_of_every_title():
    """A colour bar that the layout engine placed beside the panels it was made for would stay at the side of
    the re-laid column, over the titles of the panels below: it is drawn again, horizontal, under its own
    panels (and under no others)."""
    rng = np.random.default_rng(2)
    fig, axes = plt.subplots(2, 2, figsize=(7.2, 5.0), layout="constrained")
    for k, ax in enumerate(axes.flat):
        im = ax.imshow(rng.random((6, 6)), vmin=0, vmax=1)
        ax.set_title(f"a long title over panel {k + 1}, a' = 0.53")
    fig.colorbar(im, ax=axes[0, :], label="the top row's scale")
    copy = pickle.loads(pickle.dumps(fig))
    assert reflow._relayout(copy, PHONE)
    copy.canvas.draw()
    bars = [ax for ax in copy.axes if reflow._is_colorbar(ax)]
    panels = [ax for ax in copy.axes if not reflow._is_colorbar(ax)]
    assert len(bars) == 1 and bars[0]._colorbar.orientation == "horizontal"
    assert bars[0].get_xlabel() == "the top row's scale"
    renderer = copy.canvas.get_renderer()
    bar = bars[0].get_window_extent(renderer)
    top_row = [p.get_window_extent(renderer) for p in panels[:2]]
    assert bar.y1 <= min(b.y0 for b in top_row) + 1              # under the panels it belongs to
    for p in panels:                                             # and over no title
        assert not bar.overlaps(p.title.get_window_extent(renderer)), p.get_title()
    assert bar.y0 > panels[2].get_window_extent(renderer).y1     # above the panels it was not made for


def test_a_colour_bar_for_panels_that_end_up_in_rows_apart_goes_under_the_whole_grid():
    """Chapter 1's figure: a map under each of eight digits, one colour bar for the maps. On a phone the pairs
    follow in chunks of three, so the maps stand in rows apart; a bar placed for them by the layout engine
    squeezed every panel to a fraction of its column. It now goes under the whole grid."""
    rng = np.random.default_rng(3)
    fig, axes = plt.subplots(2, 8, figsize=(7.2, 2.6), layout="constrained")
    for k in range(8):
        axes[0, k].imshow(rng.random((28, 28)), cmap="gray")
        im = axes[1, k].imshow(rng.random((6, 6)), vmin=0, vmax=1)
        axes[0, k].axis("off"), axes[1, k].axis("off")
    axes[1, 0].set_title("a long caption over the first map", loc="left")
    fig.colorbar(im, ax=axes[1, :], label="the maps' scale")
    copy = pickle.loads(pickle.dumps(fig))
    assert reflow._relayout(copy, PHONE)
    copy.canvas.draw()
    renderer = copy.canvas.get_renderer()
    bars = [ax for ax in copy.axes if reflow._is_colorbar(ax)]
    panels = [ax for ax in copy.axes if not reflow._is_colorbar(ax)]
    assert len(bars) == 1 and bars[0]._colorbar.orientation == "horizontal"
    assert bars[0].get_xlabel() == "the maps' scale"
    bar = bars[0].get_window_extent(renderer)
    boxes = [p.get_window_extent(renderer) for p in panels]
    assert bar.y1 <= min(b.y0 for b in boxes) + 1                    # under every panel
    width = copy.get_size_inches()[0] * copy.dpi
    first_row = sorted(boxes, key=lambda b: (-b.y1, b.x0))[:3]
    assert sum(b.width for b in first_row) >= 0.55 * width, [b.width for b in first_row]   # the panels fill their row


def test_a_legend_label_with_maths_is_wrapped_between_its_formulas_never_inside_one():
    label = r"vanilla +Q: $H$ = 1.23 bits, mean and $y = r(j)$ over $I(\mathrm{route};\ \mathrm{class})$ here"
    wrapped = reflow._wrap_label(label, 14)
    lines = wrapped.split("\n")
    assert len(lines) > 2 and all(line.count("$") % 2 == 0 for line in lines), lines
    assert wrapped.replace("\n", " ") == label            # only spaces became line breaks
    assert "$y = r(j)$" in lines and r"$I(\mathrm{route};\ \mathrm{class})$" in lines
    # plain labels wrap as before; an unbalanced $ leaves the label whole
    assert reflow._wrap_label("noise-fed parents of every class", 12) == "noise-fed\nparents of\nevery class"
    assert reflow._wrap_label("costs $5 and more words than fit", 8) == "costs $5 and more words than fit"


def test_the_book_gives_each_figure_the_text_alternative_its_kernel_recorded(monkeypatch, tmp_path):
    import hashlib

    from IPython.core.formatters import PNGFormatter
    from matplotlib.figure import Figure

    from capslib.book import session
    from capslib.tools import sphinx_figures

    monkeypatch.setenv("CAPSBOOK_FRAMES_DIR", str(tmp_path / "frames"))
    fmt = PNGFormatter()
    fmt.for_type(Figure, lambda fig: (base64.b64encode(b"the png").decode(), {"width": 720}))
    fig, axes = _three_panels()
    fig.suptitle("Three panels")
    data, meta = session._measuring(fmt.lookup_by_type(Figure))(fig)
    assert meta["capsbook"]["alt"] == viz.alt_text(fig) and meta["capsbook"]["alt"].startswith("Three panels. 3 panels")
    notebook = {"cells": [{"cell_type": "markdown", "source": "text"},
                          {"cell_type": "code", "outputs": [
                              {"output_type": "display_data", "data": {"image/png": data}, "metadata": {"image/png": meta}},
                              {"output_type": "display_data", "data": {"image/png": base64.b64encode(b"old").decode()},
                               "metadata": {}}]}]}
    found = sphinx_figures.text_alternatives(notebook)
    assert found == {hashlib.sha256(b"the png").hexdigest(): meta["capsbook"]["alt"]}
