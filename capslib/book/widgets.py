"""Interactive figures that work in a live notebook and in the HTML book alike.

``interactive_figure(draw, **controls)`` shows two things:

* **in the page**, a frame player: ``draw`` is called once for every value of one control (the
  first, or the one named by ``frames=``), each figure is saved as a PNG, and a small HTML player
  (an ``<img>``, a range slider and the value shown beside it) steps through them with a few lines
  of JavaScript and no kernel. Every frame is a full redraw, so its titles and labels are those of
  its own value. The start frame travels inline in the page (so the page shows it without JavaScript
  and without a second request); the others are files under ``book/_static/frames/<digest>/``, which
  the book publishes beside its pages and the player loads only when the slider reaches them (a page
  does not carry every frame of its sliders). Where capslib runs outside the book's repository (no
  ``book/_static``), every frame is inlined instead;
* **in a running notebook**, the live ipywidgets controls (all of them), which call ``draw``
  again on every change. They are published as a widget view alone, with no plain-text
  fallback, and the book's configuration does not render widget views
  (``nb_mime_priority_overrides`` in ``_config.yml``), so the HTML shows the player only, not a
  dead copy of the widget.

The player checks itself when it is made: the frames must differ from one another (a control that
does not change the drawing raises), so executing a chapter under nbval tests every widget's knob.
"""
from __future__ import annotations

import base64
import hashlib
import html
import io
import itertools
import os
from pathlib import Path
from typing import Callable

import matplotlib.pyplot as plt

from . import viz
from .viz import FIGURE_DPI  # CSS pixels per inch of a figure on the page (matplotlib's figure.dpi)

# where the frames of the book's players are written: the book's static folder, published with the pages;
# $CAPSBOOK_FRAMES_DIR elsewhere (the executions whose outputs do not go back into the book: make test's nbval
# runs, make spread, make book's staged copy)
FRAMES_DIR = Path(__file__).resolve().parents[2] / "book" / "_static" / "frames"
last_live = None         # the live controls of the latest interactive figure (for tests and scripts)
FRAME_DPI = 200          # frames are retina PNGs, like the book's inline figures (capslib.setup)
MAX_FRAMES = 60
_ids = itertools.count()


def _controls(controls: dict) -> dict:
    import ipywidgets as w

    made = {}
    for name, spec in controls.items():
        if isinstance(spec, w.Widget):
            made[name] = spec
        elif isinstance(spec, list):
            if not spec:
                raise ValueError(f"control {name!r}: the list of options is empty")
            made[name] = w.Dropdown(options=spec, description=name)
        elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], list):
            if spec[1] not in spec[0]:
                raise ValueError(f"control {name!r}: the start value {spec[1]!r} is not among the options {spec[0]}")
            made[name] = w.Dropdown(options=spec[0], value=spec[1], description=name)
        elif isinstance(spec, tuple) and len(spec) in (3, 4):
            lo, hi, step = spec[:3]
            if not step > 0 or hi < lo:
                raise ValueError(f"control {name!r}: expected (min, max, step[, value]) with step > 0 and "
                                 f"max >= min; got {spec!r}")
            value = spec[3] if len(spec) == 4 else lo
            cls = w.IntSlider if all(isinstance(v, int) for v in spec) else w.FloatSlider
            made[name] = cls(min=lo, max=hi, step=step, value=value, description=name, continuous_update=False)
        else:
            raise TypeError(f"control {name!r} must be a widget, a list of options, (options, value) or a "
                            f"(min, max, step[, value]) tuple; got {spec!r}")
    return made


def control_values(widget) -> list:
    """Every value a slider or dropdown can take, in order."""
    import ipywidgets as w

    if isinstance(widget, w.Dropdown):
        return [o[1] if isinstance(o, tuple) else o for o in widget.options]
    if isinstance(widget, (w.IntSlider, w.FloatSlider)):
        count = int(round((widget.max - widget.min) / widget.step)) + 1
        values = [widget.min + k * widget.step for k in range(count)]
        if isinstance(widget, w.IntSlider):
            return [int(v) for v in values]
        return [round(v, 10) for v in values]
    raise TypeError(f"cannot list the values of a {type(widget).__name__}; use a slider or a dropdown")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=FRAME_DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def render_frames(draw: Callable, knob: str, values: list, fixed: dict, texts: list | None = None,
                  narrow: list | None = None) -> list[bytes]:
    """PNG bytes of ``draw(**fixed, knob=value)`` for each value; raises if two frames are equal
    (the knob would not change what the reader sees). ``texts``, if given, receives each frame's
    :func:`capslib.book.viz.text_on_page` (how large its smallest text appears in the book's column) with its
    text alternative (``alt``: :func:`capslib.book.viz.alt_text`);
    ``narrow``, if given, each frame's phone drawing from :func:`capslib.book.reflow.narrow_png`
    (``(png, text)``, or None for a frame that needs none)."""
    from . import reflow

    if not values:
        raise ValueError(f"no values for the control {knob!r}")
    if len(values) > MAX_FRAMES:
        raise ValueError(f"control {knob!r} has {len(values)} values; a player holds at most {MAX_FRAMES} "
                         f"frames: give it a coarser step or animate another control (frames=...)")
    pngs = []
    for value in values:
        fig = draw(**{**fixed, knob: value})
        if fig is None:
            fig = plt.gcf()
        if texts is not None:
            texts.append({**viz.text_on_page(fig, dpi=FIGURE_DPI), "alt": viz.alt_text(fig)})
        if narrow is not None:
            narrow.append(reflow.narrow_png(fig))
        pngs.append(_png(fig))
    digests = [hashlib.sha256(p).hexdigest() for p in pngs]
    same = [(values[i], values[j]) for i in range(len(values)) for j in range(i + 1, len(values))
            if digests[i] == digests[j]]
    if same:
        raise AssertionError(f"control {knob!r}: the figure does not change between values {same[0][0]!r} and "
                             f"{same[0][1]!r}")
    return pngs


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's header."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("png_size: data is not a PNG (bad signature or no IHDR chunk first)")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def frame_digest(pngs: list[bytes]) -> str:
    """The name of a player's frame folder: a digest of its frames, in order."""
    return hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pngs)).hexdigest()[:16]


def _frames_root(root: Path | None) -> Path:
    if root is None and os.environ.get("CAPSBOOK_FRAMES_DIR"):
        root = Path(os.environ["CAPSBOOK_FRAMES_DIR"])
        root.mkdir(parents=True, exist_ok=True)
    return FRAMES_DIR if root is None else Path(root)


def _write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole (a temporary name, then renamed), unless the same bytes are there."""
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def write_frames(pngs: list[bytes], root: Path | None = None, narrow: list[bytes] | None = None) -> list[str] | None:
    """Write a player's frames as ``<root>/<digest>/<k>.png`` (``root`` default ``$CAPSBOOK_FRAMES_DIR``, else
    :data:`FRAMES_DIR`) and return their paths relative to the book's static folder (``frames/<digest>/<k>.png``);
    ``None`` when the folder above ``root`` does not exist (capslib used outside the book's repository: the player
    inlines its frames). ``narrow``, the same frames drawn for a phone (:mod:`capslib.book.reflow`), go beside them
    as ``n<k>.png``. Files already there with the same bytes are kept; each file is written whole, so a reader of
    the folder never sees half a frame."""
    root = _frames_root(root)
    if not root.parent.is_dir():
        return None
    if narrow is not None and len(narrow) != len(pngs):
        raise ValueError(f"expected one narrow frame per frame; got {len(narrow)} for {len(pngs)}")
    digest = frame_digest(pngs)
    folder = root / digest
    folder.mkdir(parents=True, exist_ok=True)
    for k, data in enumerate(pngs):
        _write_whole(folder / f"{k}.png", data)
        if narrow is not None:
            _write_whole(folder / f"n{k}.png", narrow[k])
    return [f"frames/{digest}/{k}.png" for k in range(len(pngs))]


def write_narrow(wide: bytes, narrow: bytes, root: Path | None = None) -> str | None:
    """Write the phone drawing of a figure whose PNG is ``wide`` as ``<root>/<h>/narrow.png``, ``h`` the first 16
    hex digits of the wide PNG's SHA-256 (the name myst-nb gives the wide image, so the book finds the pair), and
    return its path under the book's static folder; None outside the book's repository."""
    root = _frames_root(root)
    if not root.parent.is_dir():
        return None
    folder = root / hashlib.sha256(wide).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    _write_whole(folder / "narrow.png", narrow)
    return f"frames/{folder.name}/narrow.png"


def phone_figures() -> bool:
    """Whether figures get their phone drawings (:mod:`capslib.book.reflow`): only in executions whose outputs go
    into the book (``reproduce``, ``make book``: :func:`capslib.tools.execute.environment` sets
    ``$CAPSBOOK_PHONE_FIGURES=1``). A reader's own run, ``make test``'s nbval runs and ``make spread`` skip them: a
    running notebook never shows them, and they cost a chapter up to a sixth of its time (chapter 2: 15 s of 91 s,
    2026-11-29). A committed figure that needs one and lacks it fails ``tests/test_outputs.py``."""
    return os.environ.get("CAPSBOOK_PHONE_FIGURES", "0") not in ("", "0")


# The player's script: the start frame is the <img>'s inline source; any other frame is ``frames.src[k]``
# (inline) or the file ``frames.files[k]`` under the book's static folder, found beside the page's capsbook.js
# (the published book) or, in a notebook served by Jupyter, through its /files/ route. Where the player is
# narrower than NARROW_BELOW of its frames' width (a phone) and the frames have phone drawings
# (``frames.narrow``), it shows those instead, at their own width. A frame that cannot be loaded says so beside
# the slider.
NARROW_BELOW = 0.8
_SCRIPT = (
    "(function(){var root=document.getElementById('%s');"
    "var frames=JSON.parse(root.querySelector('script[type=\"application/json\"]').textContent);"
    "var img=root.querySelector('img'),slider=root.querySelector('input'),out=root.querySelector('output');"
    "var first=img.getAttribute('src'),start=parseInt(slider.value,10),wide=img.getAttribute('width');"
    "function base(){var s=document.querySelector('script[src*=\"capsbook.js\"]');"
    "if(s){return s.src.replace(/capsbook[.]js[^/]*$/,'');}"
    "var m=location.pathname.match(/^(.*?)[/](?:lab[/]tree|doc[/]tree|notebooks|tree)[/](.*[/])?[^/]*$/);"
    "return m?m[1]+'/files/'+(m[2]||'')+'_static/':'_static/';}"
    "function phone(){return !!frames.narrow&&root.clientWidth>0&&"
    "root.clientWidth<" + str(NARROW_BELOW) + "*frames.width;}"
    "function src(k){if(phone()){return base()+frames.narrow[k];}"
    "if(k===start){return first;}return frames.files?base()+frames.files[k]:frames.src[k];}"
    "function show(){var k=parseInt(slider.value,10),s=src(k);"
    "img.setAttribute('width',phone()?frames.narrowWidth:wide);"
    "if(img.getAttribute('src')!==s){img.src=s;}out.textContent=frames.labels[k];"
    "img.alt=frames.title+': '+frames.labels[k]+(frames.alts?'. '+frames.alts[k]:'');}"
    "img.addEventListener('error',function(){out.textContent=frames.labels[parseInt(slider.value,10)]+"
    "' (this frame could not be loaded here; the book\\'s page or the live controls show it)';});"
    "slider.addEventListener('input',show);if(frames.narrow){show();"
    "window.addEventListener('resize',show);}})();")


def player_html(pngs: list[bytes], labels: list[str], start: int, title: str,
                smallest_text_px: float | None = None, files: list[str] | None = None,
                narrow: list[bytes] | None = None, narrow_smallest_text_px: float | None = None,
                alts: list[str] | None = None) -> str:
    """An HTML player: the frame at ``start`` shown (inline), a range slider to move. The other frames are
    ``files`` (paths under the book's static folder, from :func:`write_frames`) loaded when the slider reaches
    them, or, without ``files``, inlined too. ``smallest_text_px`` (the smallest text of any frame as it appears
    in the book's column) is kept in the player's ``data-smallest-text-px`` for ``tests/test_outputs.py``.
    ``narrow`` (the frames' phone drawings, written by :func:`write_frames` as ``n<k>.png`` beside ``files``)
    are what a player narrower than :data:`NARROW_BELOW` of its frames shows, their smallest text
    ``narrow_smallest_text_px`` in a phone's column (``data-narrow-smallest-text-px``). ``alts``, one per frame
    (:func:`capslib.book.viz.alt_text`), follow the control's value in the image's text alternative."""
    if len(pngs) != len(labels) or not 0 <= start < len(pngs):
        raise ValueError("expected one label per frame and a start index among them")
    if alts is not None and len(alts) != len(pngs):
        raise ValueError(f"expected one text alternative per frame; got {len(alts)} for {len(pngs)} frames")
    if files is not None and len(files) != len(pngs):
        raise ValueError(f"expected one file per frame; got {len(files)} files for {len(pngs)} frames")
    if narrow is not None and (files is None or len(narrow) != len(pngs)):
        raise ValueError("narrow frames go with frame files, one per frame")
    # shown at the figure's size in CSS pixels (the frames are drawn at FRAME_DPI / FIGURE_DPI times it)
    css_width = round(png_size(pngs[start])[0] * FIGURE_DPI / FRAME_DPI)
    uid = f"capsbook-player-{next(_ids)}-{hashlib.sha256(b''.join(pngs[:1])).hexdigest()[:8]}"
    inline = lambda p: f"data:image/png;base64,{base64.b64encode(p).decode()}"   # noqa: E731
    frames = {"files": files} if files is not None else {"src": [inline(p) for p in pngs]}
    if narrow is not None:
        frames.update(narrow=[f.rsplit("/", 1)[0] + f"/n{k}.png" for k, f in enumerate(files)], width=css_width,
                      narrowWidth=max(round(png_size(p)[0] * FIGURE_DPI / FRAME_DPI) for p in narrow))
    import json

    data = json.dumps({**frames, "labels": labels, "title": title, **({"alts": alts} if alts else {})})
    data = data.replace("</", "<\\/")
    alt = f"{title}: {labels[start]}" + (f". {alts[start]}" if alts else "")
    return (
        f'<div class="animation capsbook-player" id="{uid}"'
        + (f' data-smallest-text-px="{smallest_text_px:.2f}"' if smallest_text_px is not None else "")
        + (f' data-narrow-smallest-text-px="{narrow_smallest_text_px:.2f}"' if narrow_smallest_text_px is not None
           else "") + ">"
        f'<img src="{inline(pngs[start])}" alt="{html.escape(alt)}" '
        f'width="{css_width}" style="max-width:100%;height:auto">'
        f'<div class="anim-controls"><label>{html.escape(title)} '
        f'<input type="range" class="anim-slider" min="0" max="{len(pngs) - 1}" step="1" value="{start}"></label> '
        f'<output>{html.escape(labels[start])}</output></div>'
        f'<script type="application/json">{data}</script>'
        f"<script>{_SCRIPT % uid}</script></div>")


def _publish_live(widget) -> None:
    """Show the live widget through its widget view alone: no plain-text fallback, so that the HTML
    book (which does not draw widget views, see ``_config.yml``) shows nothing for it."""
    from IPython.display import publish_display_data

    bundle = widget._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    publish_display_data({k: v for k, v in (data or {}).items() if k != "text/plain"})


def interactive_figure(draw: Callable, frames: str | None = None, names: dict[str, str] | None = None,
                       **controls):
    """``draw(**values) -> Figure`` driven by controls: a frame player for the page (over the control
    ``frames``, default the first) and live ipywidgets for a running notebook (see the module).

    ``names`` gives every control the name a reader sees beside its slider, in words or in the
    chapter's notation (``{"m_pos": "margin m⁺"}``): the keyword is ``draw``'s argument, a Python
    name, and is never shown. A control without a name raises.

    Each control is an ipywidgets widget, or a ``(min, max, step[, value])`` tuple
    (int slider if all ints, float slider otherwise), or a list of options (a dropdown starting at
    the first), or ``(options, value)`` (a dropdown starting at ``value``).
    Returns None (the cell shows both; :data:`last_live` keeps the live ``ipywidgets.interactive``).
    """
    global last_live
    import ipywidgets as w
    from IPython.display import HTML, display

    if not controls:
        raise ValueError("interactive_figure needs at least one control")
    names = dict(names or {})
    unnamed = [k for k in controls if not str(names.get(k, "")).strip()]
    if unnamed:
        raise ValueError(f"interactive_figure: name every control for the reader, e.g. names={{{unnamed[0]!r}: "
                         f"'routing iteration'}}; unnamed: {unnamed}")
    if set(names) - set(controls):
        raise ValueError(f"interactive_figure: names {sorted(set(names) - set(controls))} are not controls")
    made = _controls(controls)
    for name, widget in made.items():
        widget.description = names[name]
        widget.style = {"description_width": "initial"}
    knob = frames or next(iter(made))
    if knob not in made:
        raise ValueError(f"frames must name one of the controls {sorted(made)}; got {knob!r}")
    fixed = {name: c.value for name, c in made.items() if name != knob}
    values = control_values(made[knob])
    start = values.index(made[knob].value) if made[knob].value in values else 0
    texts: list = []
    phone: list | None = [] if phone_figures() else None
    pngs = render_frames(draw, knob, values, fixed, texts, phone)
    labelled = [label for t in texts for label in t.get("internal_labels", [])]
    if labelled:
        raise ValueError(f"the figure names equations by internal labels {labelled[:3]}: readers see equation "
                         f"numbers, so say it in words")
    sizes = [t["smallest_px"] for t in texts if t["smallest_px"] is not None]
    title = names[knob] + (" (" + ", ".join(f"{names[k]} = {v}" for k, v in fixed.items()) + ")" if fixed else "")
    narrow = [p[0] for p in phone] if phone and all(p is not None for p in phone) else None
    narrow_sizes = [p[1]["smallest_px"] for p in phone if p[1]["smallest_px"] is not None] if narrow else []
    files = write_frames(pngs, narrow=narrow)
    if files is None:                 # frames inlined (outside the book's repository): no phone drawings
        narrow, narrow_sizes = None, []
    display(HTML(player_html(pngs, [f"{names[knob]} = {v}" for v in values], start, title,
                             smallest_text_px=min(sizes) if sizes else None, files=files, narrow=narrow,
                             narrow_smallest_text_px=min(narrow_sizes) if narrow_sizes else None,
                             alts=[t["alt"] for t in texts])))

    def show(**values):
        draw(**values)
        plt.show()

    last_live = w.interactive(show, **made)
    _publish_live(last_live)
    return None

