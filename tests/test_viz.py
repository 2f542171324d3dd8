import base64

import matplotlib

matplotlib.use("Agg")
import numpy as np
import pytest
import torch

from capslib.book import viz


@pytest.fixture(autouse=True)
def _frames_out_of_the_book(monkeypatch, tmp_path):
    """The players these tests make write their frames into a temporary folder, never into the book."""
    monkeypatch.setenv("CAPSBOOK_FRAMES_DIR", str(tmp_path / "frames-of-the-tests"))


def test_tile_places_each_image():
    imgs = torch.arange(6, dtype=torch.float32).view(6, 1, 1, 1).expand(6, 1, 2, 3).contiguous()
    m = viz.tile(imgs, ncol=4, pad=1, fill=-1)
    assert m.shape == (2 * 3 - 1, 4 * 4 - 1)
    assert m[0, 0] == 0 and m[0, 4] == 1 and m[3, 0] == 4 and m[3, 4] == 5
    assert m[2, 0] == -1 and m[3, 8] == -1  # padding row and the empty slot


def test_image_grid_both_layouts():
    imgs = torch.rand(2, 5, 1, 8, 8)
    fig = viz.image_grid(imgs, title="t")
    assert len(fig.axes) == 1
    fig2 = viz.image_grid(imgs[0], titles=list("abcde"))
    assert len(fig2.axes) == 5
    matplotlib.pyplot.close("all")


def _draw_calls():
    calls = []

    def draw(iteration=3, scale=1.0):
        calls.append((iteration, scale))
        fig, ax = matplotlib.pyplot.subplots(figsize=(2, 2))
        ax.plot([0, 1], [0, iteration * scale])
        ax.set_title(f"after iteration {iteration}")
        return fig
    return draw, calls


def test_interactive_figure_player_and_live_widget(monkeypatch, tmp_path):
    """The page's player holds one distinct frame per slider value, starts at the slider's value and
    labels each frame; the live widget redraws with the value a reader sets. Without the book's static
    folder (capslib outside its repository) every frame is inline."""
    import re

    import IPython.display

    from capslib.book import widgets

    monkeypatch.delenv("CAPSBOOK_FRAMES_DIR", raising=False)
    monkeypatch.setattr(widgets, "FRAMES_DIR", tmp_path / "no-book" / "frames")   # its parent does not exist
    shown, published = [], []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    monkeypatch.setattr(IPython.display, "publish_display_data", lambda data: published.append(data))
    draw, calls = _draw_calls()
    assert widgets.interactive_figure(draw, iteration=(1, 5, 1, 3), scale=(0.5, 1.5, 0.5, 1.0),
                                      names={"iteration": "routing iteration r", "scale": "vote scale α"}) is None
    live = widgets.last_live
    assert len(shown) == 1
    page = shown[0].data
    assert page.count("data:image/png;base64,") == 1 + 5  # the start frame's <img> and the 5 frames
    assert 'type="range"' in page and 'max="4"' in page and 'value="2"' in page
    assert [c for c in calls[:5]] == [(i, 1.0) for i in range(1, 6)]
    assert re.findall(r"routing iteration r = (\d)", page)[:1] == ["3"] and "routing iteration r = 5" in page
    # the reader's names, never draw's argument names
    assert "vote scale α = 1.0" in page and not re.search(r"(?<![\w ])(iteration|scale) =", page)
    assert live.children[0].description == "routing iteration r"
    assert len(published) == 1 and list(published[0]) == ["application/vnd.jupyter.widget-view+json"]
    # frames are retina PNGs shown at the figure's size in CSS pixels: half their pixel width
    first = base64.b64decode(re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1))
    pixels = widgets.png_size(first)[0]
    assert pixels > 100 and f'width="{round(pixels / 2)}"' in page
    # the smallest text of any frame, as the column shows it, travels with the player
    assert float(re.search(r'data-smallest-text-px="([\d.]+)"', page).group(1)) > 0
    # the image's text alternative: the control, its value and what the frame shows; one per frame for the script
    assert 'alt="routing iteration r (vote scale α = 1.0): routing iteration r = 3. After iteration 3."' in page
    assert '"alts": ["After iteration 1.", "After iteration 2.",' in page
    with pytest.raises(ValueError, match="one text alternative per frame"):
        widgets.player_html([first, first], ["a", "b"], 0, "t", alts=["only one"])
    slider = live.children[0]
    calls.clear()
    slider.value = 5
    assert calls and calls[-1] == (5, 1.0)
    live.children[1].value = 0.5
    assert calls[-1] == (5, 0.5)
    matplotlib.pyplot.close("all")


def test_player_frames_are_files_loaded_on_demand(monkeypatch, tmp_path):
    """In the book's repository the page carries the start frame only (inline); every frame is a file under
    the static folder, named by the frames' digest, listed in the player's data and written whole; a second
    player with the same frames reuses the folder."""
    import json
    import re

    import IPython.display

    from capslib.book import widgets

    static = tmp_path / "_static"
    static.mkdir()
    monkeypatch.delenv("CAPSBOOK_FRAMES_DIR", raising=False)
    monkeypatch.setattr(widgets, "FRAMES_DIR", static / "frames")
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    monkeypatch.setattr(IPython.display, "publish_display_data", lambda data: None)
    draw, _ = _draw_calls()
    for _ in range(2):
        widgets.interactive_figure(draw, iteration=(1, 4, 1, 2), names={"iteration": "routing iteration r"})
    page = shown[0].data
    assert page.count("data:image/png;base64,") == 1
    files = json.loads(re.search(r'<script type="application/json">(.*?)</script>', page).group(1))["files"]
    folders = list((static / "frames").iterdir())
    assert len(folders) == 1 and [f"frames/{folders[0].name}/{k}.png" for k in range(4)] == files
    pngs = [(static / f).read_bytes() for f in files]
    assert len(set(pngs)) == 4 and all(widgets.png_size(p)[0] > 100 for p in pngs)
    start = re.search(r'<img src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(start) == pngs[1]                    # the inline start frame is the file's frame
    assert widgets.frame_digest(pngs) == folders[0].name and not list(folders[0].glob(".*"))
    with pytest.raises(ValueError, match="one file per frame"):
        widgets.player_html(pngs, ["a", "b", "c", "d"], 0, "t", files=files[:2])
    # an execution whose outputs do not go back into the book writes its frames where $CAPSBOOK_FRAMES_DIR says
    monkeypatch.setenv("CAPSBOOK_FRAMES_DIR", str(tmp_path / "elsewhere" / "_static" / "frames"))
    assert widgets.write_frames(pngs) == files
    assert (tmp_path / "elsewhere" / "_static" / files[0]).read_bytes() == pngs[0]
    matplotlib.pyplot.close("all")


def test_png_size_reads_the_header_and_rejects_other_data():
    import io

    from capslib.book import widgets

    fig = matplotlib.pyplot.figure(figsize=(3, 2))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=50)
    matplotlib.pyplot.close(fig)
    assert widgets.png_size(buf.getvalue()) == (150, 100)
    with pytest.raises(ValueError, match="not a PNG"):
        widgets.png_size(b"GIF89a" + bytes(30))


def test_interactive_figure_rejects_a_knob_that_changes_nothing_and_bad_controls(monkeypatch):
    import IPython.display
    import pytest

    from capslib.book import widgets

    monkeypatch.setattr(IPython.display, "display", lambda obj: None)
    monkeypatch.setattr(IPython.display, "publish_display_data", lambda data: None)
    draw, _ = _draw_calls()
    it = {"iteration": "routing iteration"}
    with pytest.raises(AssertionError, match="does not change between values 0.5 and 1.0"):
        widgets.interactive_figure(lambda scale=1.0, iteration=0: draw(0, scale), scale=(0.5, 1.5, 0.5),
                                   names={"scale": "scale"})
    with pytest.raises(ValueError, match="frames must name one of the controls"):
        widgets.interactive_figure(draw, frames="nope", iteration=(1, 5, 1), names=it)
    with pytest.raises(ValueError, match="step > 0"):
        widgets.interactive_figure(draw, iteration=(1, 5, 0), names=it)
    with pytest.raises(ValueError, match="at most 60 frames"):
        widgets.interactive_figure(draw, iteration=(1, 100, 1), names=it)
    with pytest.raises(TypeError, match="must be a widget, a list of options"):
        widgets.interactive_figure(draw, iteration="three", names=it)
    with pytest.raises(ValueError, match=r"name every control for the reader.*unnamed: \['scale'\]"):
        widgets.interactive_figure(draw, iteration=(1, 5, 1), scale=(0.5, 1.5, 0.5), names=it)
    with pytest.raises(ValueError, match=r"names \['dim'\] are not controls"):
        widgets.interactive_figure(draw, iteration=(1, 5, 1), names={**it, "dim": "dimension"})
    matplotlib.pyplot.close("all")


def test_interactive_figure_dropdown_starts_at_its_value(monkeypatch):
    import IPython.display
    import pytest

    from capslib.book import widgets

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    monkeypatch.setattr(IPython.display, "publish_display_data", lambda data: None)
    draw, calls = _draw_calls()
    widgets.interactive_figure(draw, iteration=([2, 5, 11, 16], 11), names={"iteration": "iterations T"})
    assert widgets.last_live.children[0].value == 11 and calls[:4] == [(2, 1.0), (5, 1.0), (11, 1.0), (16, 1.0)]
    assert 'value="2"' in shown[0].data and "iterations T = 11</output>" in shown[0].data
    with pytest.raises(ValueError, match="start value 3 is not among the options"):
        widgets.interactive_figure(draw, iteration=([2, 5], 3), names={"iteration": "iterations T"})
    matplotlib.pyplot.close("all")


def test_multi_panel_figures_wrap_to_stay_legible_at_the_column_width():
    """Five iterations of couplings and three training curves: at most three (two) panels to a row,
    so that a figure saved at dpi 100 is at most ~900 px wide (the column is 688 px)."""
    import pytest

    fig = viz.coupling_heatmaps([torch.rand(12, 4) for _ in range(5)])
    assert fig.get_size_inches()[0] * 100 <= 900 and sum(ax.get_visible() for ax in fig.axes) == 5 + 1  # + colour bar
    fig = viz.history_plot({"a": {"loss": [1.0, 0.5], "train_acc": [0.5, 0.6], "val_acc": [0.4, 0.5]}},
                           keys=("loss", "train_acc", "val_acc"))
    assert fig.get_size_inches()[0] * 100 <= 900 and sum(ax.get_visible() for ax in fig.axes) == 3
    # the history's keys reach the reader in words, not as Python names
    assert [ax.get_ylabel() for ax in fig.axes if ax.get_visible()] == ["training loss", "training accuracy",
                                                                         "validation accuracy"]
    with pytest.raises(ValueError, match="per_row must be a positive integer"):
        viz.coupling_heatmaps([torch.rand(3, 2)], per_row=0)
    matplotlib.pyplot.close("all")


def test_text_on_page_scales_wide_figures_to_the_column_and_finds_the_smallest_text():
    """A figure as wide as the column shows an s-pt text s * 100 / 72 px high; one twice as wide is
    halved; hidden and empty texts do not count; a figure without text reports None."""
    import matplotlib.pyplot as plt

    width_in = viz.COLUMN_IN - 2 * viz.PAD_INCHES
    fig = plt.figure(figsize=(width_in, 2))
    fig.text(0.0, 0.5, "left edge", fontsize=12)
    fig.text(0.99, 0.5, "R", fontsize=9, ha="right")
    fig.text(0.5, 0.2, "hidden", fontsize=4).set_visible(False)
    fig.text(0.5, 0.8, "  ", fontsize=4)
    fig.patches.append(matplotlib.patches.Rectangle((0, 0), 1, 1, transform=fig.transFigure, fill=False))
    info = viz.text_on_page(fig)
    assert info["smallest_text"] == "R" and info["scale"] == pytest.approx(1.0, abs=0.01)
    assert info["smallest_px"] == pytest.approx(9 * 100 / 72, rel=0.01)
    fig.set_size_inches(2 * viz.COLUMN_IN - 2 * viz.PAD_INCHES, 2)
    wide = viz.text_on_page(fig)
    assert wide["scale"] == pytest.approx(0.5, rel=0.02) and wide["smallest_px"] == pytest.approx(6.25, rel=0.02)
    empty = plt.figure(figsize=(2, 2))
    empty.add_axes((0, 0, 1, 1)).axis("off")
    assert viz.text_on_page(empty)["smallest_px"] is None
    with pytest.raises(ValueError, match="dpi"):
        viz.text_on_page(empty, dpi=0)
    plt.close("all")


def test_inline_figures_carry_their_text_measurement():
    """In a kernel, capslib.book.setup() makes the PNG formatter put viz.text_on_page's numbers in the
    output's metadata (tests/test_outputs.py reads them from the committed notebooks)."""
    from IPython.core.formatters import PNGFormatter
    from matplotlib.figure import Figure

    from capslib.book import session

    fmt = PNGFormatter()
    fmt.for_type(Figure, lambda fig: (b"png", {"width": 10}))
    measuring = session._measuring(fmt.lookup_by_type(Figure))
    fig = Figure(figsize=(3, 2))
    fig.add_subplot().set_title("title", fontsize=9)
    data, meta = measuring(fig)
    assert data == b"png" and meta["width"] == 10
    assert meta["capsbook"]["smallest_text"] == "title" and meta["capsbook"]["smallest_px"] == pytest.approx(12.5)


def test_labels_read_as_words_and_unicode():
    assert viz.plain_text(r"length $\|\mathbf{v}_j\|$") == "length ‖v_j‖"
    assert viz.plain_text(r"$\hat{\mathbf u}_{j|i}$ against $\kappa_{\mathrm{final}}$") == "û_j|i against κ_final"
    assert viz.plain_text(r"$\frac{1}{J}$ and $\frac{a+b}{2}$") == "1/J and (a+b)/2"
    assert viz.plain_text(r"entropy $\mathbb H_j$ (bits), $\operatorname{softmax}(x)$") == "entropy ℍ_j (bits), softmax(x)"
    assert viz.plain_text("a price of \\$5, no maths") == "a price of $5, no maths"


def test_a_figures_text_alternative_says_what_its_panels_show():
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2)
    fig.suptitle("Toy routing")
    axes[0].set_title("lengths")
    axes[0].set_xlabel("parent $j$")
    axes[0].set_ylabel(r"$\|\mathbf v_j\|$")
    image = axes[1].imshow(np.eye(3))
    fig.colorbar(image, ax=axes[1], label="$c_{ij}$")
    assert viz.alt_text(fig) == "Toy routing. 2 panels: (1) lengths: ‖v_j‖ against parent j; (2) an image. Colour scale: c_ij."
    grid, cells = plt.subplots(2, 4)
    cells[0, 0].set_title("digit")
    for ax in cells.flat:
        ax.imshow(np.eye(2))
    assert viz.alt_text(grid) == "8 panels: (1) digit: an image; (2-8) images."
    rows_only, axes = plt.subplots(2, 3)                  # labels on the first column only: the rest are plots
    for k, ax in enumerate(axes.flat):
        ax.plot([0, 1])
    axes[0, 0].set_ylabel("row 1")
    axes[1, 0].set_ylabel(r"$\Vert V \Vert$")
    assert viz.alt_text(rows_only) == "6 panels: (1) row 1; (2-3) plots; (4) ‖ V ‖; (5-6) plots."
    many, rows = plt.subplots(1, 9)
    for k, ax in enumerate(rows):
        ax.set_title(f"class {k}")
    assert viz.alt_text(many, max_panels=3) == "9 panels: (1) class 0; (2) class 1; (3) class 2; and panels 4-9."
    diagram = plt.figure()
    ax = diagram.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    ax.text(0.1, 0.5, "votes $\\hat u$")
    ax.text(0.7, 0.5, "parent")
    assert viz.alt_text(diagram) == "A diagram labelled: votes û; parent."
    assert viz.alt_text(plt.figure()) == "A figure without titles or axis labels."
    plt.close("all")
