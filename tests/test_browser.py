"""The published book in a browser: every page of ``_build/html`` at 1280 px and 400 px.

Run by ``make test-browser`` (which builds the HTML first with ``make build-strict`` and sets
``CAPSBOOK_BROWSER=1``); skipped elsewhere, so ``make test``'s unit step never starts a browser.
Playwright drives Debian's Chromium (``/usr/bin/chromium``, or ``CAPSBOOK_CHROMIUM``) with a fresh
profile; the book is served on loopback and every request that leaves loopback is refused (and
counted as a failure: the book must work offline). Screenshots of every page at both widths go to
``_build/screens/`` with ``report.txt``, the per-page findings.

A page fails on
- raw TeX: once MathJax has finished typesetting, a text node outside code, MathJax's output and
  scripts that still holds TeX (``$$``, ``\\frac``, ``\\begin{``, ``\\mathbb`` ... or an inline
  ``$...$`` with a backslash, ``_`` or ``^`` in it), or a MathJax error box (``mjx-merror``);
- a console error: an uncaught exception, a console message of type error (a missing file among
  them), or a request that leaves loopback;
- an interactive figure (``div.animation``: the frame player of matplotlib's ``to_jshtml`` or of
  ``capslib.book.widgets``: an ``<img>`` and an ``<input type=range>``) whose slider, moved to each
  position in turn, does not change the displayed image's ``src``, or whose frame there does not load (a
  player's frames other than its first are files under ``_static/frames/``, loaded on demand);
- a menu that does not open: at 400 px the chapter list is hidden until the primary-sidebar toggle
  is clicked, and must then be visible inside the viewport; at 1280 px it must be visible, and the
  toggle must hide it;
- an illegible image. An image wider than the column is scaled down by ``ratio = natural width /
  rendered width``. A figure saved at ``dpi`` draws a font of ``s`` pt ``s * dpi / 72`` pixels high,
  so on the page it is ``s * dpi / 72 / ratio`` CSS px high. The smallest font the book's figures
  use is ``FIGURE_FONT_PT`` = 8 pt (capslib.book.viz's panel titles; matplotlib's default text is 10 pt)
  and it must stay at least ``MIN_FONT_PX`` = 6 CSS px high (the reviewer's 4-5 px tick labels were
  unreadable), so the largest ratio allowed is ``8 * dpi / 72 / 6``: 1.85 for a PNG at dpi 100,
  3.7 for a retina PNG at dpi 200. The dpi is read from the PNG's pHYs chunk (matplotlib writes
  it); a PNG without one counts as dpi 100 (matplotlib's default), an SVG as 96 (CSS pixels, its
  sizes are in points). The rule is enforced at both widths (``LEGIBLE_AT``): at 400 px the page's
  script ``book/_static/capsbook.js`` shows a figure's phone drawing (capslib.book.reflow: its panels
  re-laid for a 350-px column) and keeps each output image at least 1/1.33 of its declared width, letting
  its output area scroll sideways below that; at 400 px no figure may be wider than its column. A
  chapter's figure (an output image with a declared width) is held to more: ``tests/test_outputs.py``
  measured its smallest text at 12 px or more at its width (or the 688-px column's), so shown
  ``rendered`` px wide it is ``12 * rendered / min(declared, 688)`` px high, which must be at least
  ``MIN_OUTPUT_TEXT_PX`` = 9 px at both widths;
- at 1280 px, an output column narrower than ``capslib.book.viz.COLUMN_PX`` (688 px): every figure's
  smallest text is measured for that column (``tests/test_outputs.py``, at least 9 pt there);
- what a reader sees cut: a page wider than the viewport (it scrolls sideways as a whole), a display
  equation wider than its column or running under its number, a table cell that ends in an ellipsis,
  pandas' "N rows x M columns" footer;
- plumbing in the running text (what a reader sees without opening a collapsed block; code cells'
  inputs are code and are left out): the word "asserted", a machine path or file name, a processor
  name or a count of processor types, a training-log line, a build command, a bare BibTeX key (a
  citation that did not resolve). The scoreboard (the book's provenance page) and, for file names and
  commands, the instructors' assignments page are exempt (:data:`PLUMBING_EXEMPT`).
"""
from __future__ import annotations

import base64
import functools
import http.server
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = Path(os.environ.get("CAPSBOOK_HTML", ROOT / "_build" / "html"))  # make test-browser: the strict build
SCREENS = ROOT / "_build" / "screens"
CHROMIUM = os.environ.get("CAPSBOOK_CHROMIUM", "/usr/bin/chromium")
WIDTHS = (1280, 400)
HEIGHT = 900
LEGIBLE_AT = WIDTHS
FIGURE_FONT_PT = 8.0
MIN_FONT_PX = 6.0
MIN_OUTPUT_TEXT_PX = 9.0      # a chapter's figure: its smallest text at least this high at either width
COLUMN_PX_OF_FIGURES = 688    # capslib.book.viz.COLUMN_PX (tested equal below)
DEFAULT_DPI = 100.0
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGE_TIMEOUT_MS = 30_000
MATHJAX_TIMEOUT_MS = 30_000

REQUESTED = os.environ.get("CAPSBOOK_BROWSER") == "1"


def _missing() -> str | None:
    """Why the browser test cannot run here (None: it can)."""
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (apt-get install -y chromium, or set CAPSBOOK_CHROMIUM)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the python package playwright is not installed (it is in requirements.lock)"
    if not (HTML / "book").is_dir():
        return f"no built book in {HTML} (make build-strict)"
    return None


# -- pure helpers (tested below without a browser) ------------------------------------------------

def png_dpi(data: bytes) -> float | None:
    """Horizontal resolution of a PNG from its pHYs chunk (pixels per metre -> dpi), None if absent."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("png_dpi: data is not a PNG (bad signature)")
    i = 8
    while i + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[i:i + 8])
        if kind == b"pHYs":
            x, _y, unit = struct.unpack(">IIB", data[i + 8:i + 17])
            return x * 0.0254 if unit == 1 else None
        if kind in (b"IDAT", b"IEND"):
            return None
        i += 12 + length
    return None


def max_scale(dpi: float) -> float:
    """The largest natural/rendered width ratio at which a FIGURE_FONT_PT font stays MIN_FONT_PX high."""
    if not dpi > 0:
        raise ValueError(f"max_scale: dpi must be positive, got {dpi!r}")
    return FIGURE_FONT_PT * dpi / 72.0 / MIN_FONT_PX


RAW_TEX = re.compile(
    r"\$\$|\\(?:[dt]?frac|begin\{|end\{|math(?:bb|bf|rm|cal|sf|it)\b|operatorname|boldsymbol|sum_|prod_|"
    r"left[(\[|.]|right[)\]|.]|sqrt|hat\{|tilde\{|bar\{|vec\{|partial|nabla|cdot|cdots|ldots|times|"
    r"alpha|beta|gamma|delta|lambda|sigma|theta|epsilon|varepsilon|mu\b|pi\b|log\b|exp\b|top\b|"
    r"leq?\b|geq?\b|neq\b|approx|in\b|ell\b|odot|otimes|sim\b|propto|infty|R\b)"
    r"|(?:^|[^\\$\w])\$[^$\s][^$]{0,120}?[\\_^][^$]{0,120}?\$")


def raw_tex(text: str) -> str | None:
    """The first TeX-looking stretch of ``text`` (with some context), None if there is none."""
    m = RAW_TEX.search(text)
    if not m:
        return None
    return text[max(0, m.start() - 30):m.end() + 30].replace("\n", " ")


PLUMBING = [
    ("the word 'asserted'", re.compile(r"\basserted\b", re.I)),
    ("a machine path or file name", re.compile(
        r"(?<![\w/.])/(?:work|home|tmp|usr|root|mnt|opt|var)/[\w./-]+"
        r"|\b[\w-]+(?:/[\w.-]+)*\.(?:py|ya?ml|json|pt|ipynb|csv|log|gz|npz)\b")),
    ("a processor name", re.compile(r"\b(?:AMD EPYC|EPYC|Xeon|Intel\(R\)|AVX2|AVX-?512|Ryzen|Neoverse|Graviton)\b")),
    ("a training-log line", re.compile(r"\bepoch\s+\d+\s*/\s*\d+(?:\s*:|\b[^\n]{0,80}?\b(?:loss|acc(?:uracy)?)\b)", re.I)),
    ("pandas' table footer", re.compile(r"\b\d+ rows \u00d7 \d+ columns\b")),
    ("a build command", re.compile(r"\bmake (?:spread|test|units|unit|book|reproduce|publish|bench|smoke|notebooks|"
                                   r"paper-scale|assignments|book-student|test-browser|bundle|data|gpu-data)\b")),
    ("a count of processor types", re.compile(r"\bprocessor types?\b", re.I)),
]
# pages whose subject is the machinery: the scoreboard (the book's provenance page) may say anything of
# it; the assignments page is the instructors' how-to, whose commands and file names are its content
PLUMBING_EXEMPT = {"book/scoreboard.html": {what for what, _ in PLUMBING},
                   "book/assignments.html": {"a machine path or file name", "a build command"}}


def bibtex_keys() -> frozenset[str]:
    """The citation keys of references.bib (read as the sourced paper table reads them): one in the
    running text is a citation that did not resolve."""
    from capslib.book import paper

    return frozenset(paper._bib_keys())


def plumbing(text: str, keys: frozenset[str] = frozenset(), exempt: set[str] = frozenset()) -> list[str]:
    """What of :data:`PLUMBING` (and bare citation ``keys``) the running ``text`` holds, with context;
    the rules named in ``exempt`` are not applied."""
    found = []
    for what, rx in PLUMBING:
        if what in exempt:
            continue
        for m in rx.finditer(text):
            ctx = text[max(0, m.start() - 40):m.end() + 40].replace("\n", " ")
            found.append(f"{what}: ...{ctx}...")
    for key in sorted(keys):
        m = re.search(rf"(?<![\w-]){re.escape(key)}(?![\w-])", text)
        if m:
            found.append(f"a bare BibTeX key: ...{text[max(0, m.start() - 40):m.end() + 40]}...")
    return found


def cut_cells(cells: list[str]) -> list[str]:
    """The table cells among ``cells`` (their text) that end in an ellipsis: cut, not whole."""
    return [c for c in cells if c.rstrip().endswith(("\u2026", "..."))]


def test_helpers_without_a_browser():
    import io

    shown = [{"src": "http://x/_images/" + "a" * 64 + ".png", "section": "s", "alt": "../_images/" + "a" * 64 + ".png"},
             {"src": "data:image/png;base64,xx", "section": "s", "alt": " "},
             {"src": "http://x/_images/b.png", "section": "s", "alt": "Toy routing. 2 panels: (1) lengths"}]
    assert [p.split(":")[1].strip()[:6] for p in _without_text_alternative(shown)] == ["aaaaaa", "inline"]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    for dpi in (72, 100, 200):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        assert abs(png_dpi(buf.getvalue()) - dpi) < 0.01
    plt.close(fig)
    with pytest.raises(ValueError, match="not a PNG"):
        png_dpi(b"GIF89a")
    assert max_scale(200) == pytest.approx(2 * max_scale(100))
    assert 1.8 < max_scale(100) < 1.9
    with pytest.raises(ValueError, match="dpi must be positive"):
        max_scale(0)
    # a chapter's figure: 12 px text where it is drawn at its width (or the column's), in proportion below it; the
    # phone's script keeps it at least 1 / 1.33 of its declared width, which keeps that text 9 px high
    from capslib.book import viz
    assert COLUMN_PX_OF_FIGURES == viz.COLUMN_PX
    assert output_text_px(500, 500) == viz.MIN_TEXT_PX and output_text_px(1000, 688) == viz.MIN_TEXT_PX
    assert output_text_px(600, 300) == pytest.approx(viz.MIN_TEXT_PX / 2)
    shrink = float(re.search(r"MAX_SHRINK = ([\d.]+)", (ROOT / "book" / "_static" / "capsbook.js").read_text()).group(1))
    assert output_text_px(688, 688 / shrink) >= MIN_OUTPUT_TEXT_PX
    with pytest.raises(ValueError, match="widths must be positive"):
        output_text_px(0, 10)
    assert raw_tex(r"the norm \frac{a}{b} of") and raw_tex("so $$x$$") and raw_tex(r"where $x_i$ is")
    assert raw_tex(r"\begin{aligned} a") and raw_tex(r"in \mathbb{R}^n")
    assert raw_tex("costs $5 and $6 today") is None and raw_tex("plain prose, no math") is None
    keys = frozenset({"sabour2017dynamic"})
    for bad in ("the claim is asserted below", "written to book/results/ci/02.json", "see /tmp/x/y",
                "starting from 06_rem_start_s0.pt", "on an AMD EPYC with AVX2 kernels",
                "epoch 3/10  loss 0.214  val_acc 0.91", "[5 rows \u00d7 3 columns]", "as in sabour2017dynamic shows",
                "(5 seeds, 3 processor types; make spread)", "seed 0, CD-1 epoch 1/3: reconstruction error 0.08"):
        assert plumbing(bad, keys), bad
    assert plumbing("see book/x.yml; make spread", exempt={"a machine path or file name", "a build command"}) == []
    for fine in ("Sabour et al. (2017) route by agreement", "the margin loss of Eq. (2.4), 0.9 and 0.1",
                 "after epoch 3 of 10 the loss falls", "a 3.5 % error", "the 16-D pose; p/q = 0.5"):
        assert plumbing(fine, keys) == [], (fine, plumbing(fine, keys))
    assert "sabour2017dynamic" in bibtex_keys()
    assert cut_cells(["1,112,208 para\u2026", "0.25", "sees ...", "ok"]) == ["1,112,208 para\u2026", "sees ..."]


# -- the browser -------------------------------------------------------------------------------

def pages() -> list[str]:
    """Every HTML page of the built book, relative to _build/html (the root's redirect left out)."""
    skip = {"_static", "_sources", "_images"}
    out = []
    for p in sorted(HTML.rglob("*.html")):
        rel = p.relative_to(HTML)
        if rel.parts[0] in skip or rel.as_posix() == "index.html":
            continue
        out.append(rel.as_posix())
    return out


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    missing = _missing()
    if missing:  # asked for (make test-browser) but impossible: a failure, never a silent skip
        pytest.fail(f"browser test requested but {missing}")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(HTML)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser_context():
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="capsbook-chromium-")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": WIDTHS[0], "height": HEIGHT}, service_workers="block")
        try:
            yield ctx
        finally:
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)


WAIT_MATHJAX = """async (limit) => {
  if (!document.querySelector('script[src*="mathjax"]')) return 'no MathJax on this page';
  const t0 = performance.now();
  const sleep = (ms) => new Promise(r => setTimeout(r, ms));
  while (!(window.MathJax && window.MathJax.startup && window.MathJax.startup.promise)) {
    if (performance.now() - t0 > limit) return 'MathJax never started';
    await sleep(50);
  }
  const done = await Promise.race([window.MathJax.startup.promise.then(() => 'ok'),
                                   sleep(limit).then(() => 'MathJax did not finish typesetting')]);
  return done;
}"""

TEXT_NODES = """() => {
  const root = document.querySelector('main') || document.body;
  const skip = 'script,style,pre,code,textarea,mjx-container,mjx-assistive-mml,.highlight,.MathJax';
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const out = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const el = n.parentElement;
    if (!el || el.closest(skip)) continue;
    const t = n.textContent;
    if (t.includes('\\\\') || t.includes('$')) out.push(t);
  }
  const errors = Array.from(document.querySelectorAll('mjx-merror')).map(
    e => e.getAttribute('data-mjx-error') || e.textContent);
  return {texts: out, errors: errors};
}"""

IMAGES = """() => {
  const heads = Array.from(document.querySelectorAll('main h1, main h2, main h3'));
  return Array.from((document.querySelector('main') || document.body).querySelectorAll('img')).map(img => {
    const r = img.getBoundingClientRect();
    const before = heads.filter(h => h.compareDocumentPosition(img) & Node.DOCUMENT_POSITION_FOLLOWING);
    const section = before.length ? before[before.length - 1].textContent.replace(/[#\\s]+$/, '').trim() : '';
    const box = img.closest('div.cell_output, div.output');
    const cs = box ? getComputedStyle(box) : null;
    const column = box ? box.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight) : 0;
    // the width its output declares: a width attribute (players, phone drawings) or myst-nb's inline style
    const declared = parseFloat(img.getAttribute('width')) || parseFloat(img.style.width) || 0;
    return {src: img.currentSrc || img.src, natural: img.naturalWidth, rendered: r.width, column: column,
            declared: box ? declared : 0,
            complete: img.complete, animation: !!img.closest('div.animation'), section: section.slice(0, 60),
            alt: img.getAttribute('alt') || ''};
  });
}"""

MOVE_SLIDERS = """async () => {
  // each slider moved to every position: the image must change, and the frame it shows must load (a player's
  // frames other than the first are files loaded on demand)
  const loaded = (img) => new Promise(done => {
    if (img.complete) { done(); return; }
    const t = setTimeout(done, 5000);
    img.addEventListener('load', () => { clearTimeout(t); done(); }, {once: true});
    img.addEventListener('error', () => { clearTimeout(t); done(); }, {once: true});
  });
  const out = [];
  const players = Array.from(document.querySelectorAll('div.animation'));
  for (let k = 0; k < players.length; k++) {
    const div = players[k];
    const img = div.querySelector('img');
    const slider = div.querySelector('input[type=range]');
    if (!img || !slider) { out.push({k: k, problem: 'no <img> or no range slider in div.animation'}); continue; }
    const lo = parseInt(slider.min || '0', 10), hi = parseInt(slider.max || '0', 10);
    const label = (div.querySelector('label') || div).textContent.trim().slice(0, 60);
    if (!(hi > lo)) { out.push({k: k, label: label, problem: `slider has one position (min ${lo}, max ${hi})`}); continue; }
    const start = slider.value;
    const seen = [img.src];
    const stuck = [], broken = [];
    for (let v = lo; v <= hi; v++) {
      if (String(v) === String(slider.value)) continue;
      const before = img.src;
      slider.value = String(v);
      slider.dispatchEvent(new Event('input', {bubbles: true}));
      slider.dispatchEvent(new Event('change', {bubbles: true}));
      if (img.src === before) stuck.push(v);
      await loaded(img);
      if (!img.naturalWidth) broken.push(v);
      seen.push(img.src);
    }
    slider.value = start;
    slider.dispatchEvent(new Event('input', {bubbles: true}));
    await loaded(img);
    out.push({k: k, label: label, positions: hi - lo + 1, distinct: new Set(seen).size, stuck: stuck, broken: broken});
  }
  return out;
}"""

READING = """() => {
  // what a reader sees without opening anything: not inside a closed <details> (a collapsed cell; its
  // summary line is seen), rendered, not hidden
  const shown = (el) => {
    const closed = el.closest('details:not([open])');
    if (closed && !el.closest('summary')) return false;
    if (el.checkVisibility && !el.checkVisibility({contentVisibilityAuto: true, visibilityProperty: true})) return false;
    return el.getClientRects().length > 0;
  };
  const root = document.querySelector('main') || document.body;
  const skip = 'script,style,mjx-container,mjx-assistive-mml,.MathJax,div.cell_input,.headerlink';
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const parts = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const el = n.parentElement;
    if (!el || el.closest(skip) || !n.textContent.trim()) continue;
    if (!shown(el)) continue;
    parts.push(n.textContent);
  }
  const cells = Array.from(root.querySelectorAll('td, th')).filter(shown)
    .map(c => c.textContent.trim());
  const equations = [];
  root.querySelectorAll('div.math').forEach(d => {
    if (!shown(d)) return;
    const m = d.querySelector('mjx-container mjx-math');
    if (!m) return;
    const box = d.getBoundingClientRect(), r = m.getBoundingClientRect();
    const no = d.querySelector('.eqno');
    const n = no && no.getClientRects().length ? no.getBoundingClientRect() : null;
    const under = !!(n && n.width && r.top < n.bottom && r.bottom > n.top && r.right > n.left + 1);
    const cut = r.right > box.right + 1 || r.left < box.left - 1;
    if (cut || under) equations.push({label: no ? no.textContent.trim() : d.textContent.trim().slice(0, 40),
                                      width: Math.round(r.width), column: Math.round(box.width), under: under});
  });
  // a player's caption, slider and value must stay inside the player (on a phone they stack)
  const controls = [];
  root.querySelectorAll('div.animation').forEach((div, k) => {
    const box = div.getBoundingClientRect();
    div.querySelectorAll('label, input, output').forEach(el => {
      const r = el.getBoundingClientRect();
      const wide = Math.max(r.right, r.left + el.scrollWidth);
      if (r.width && (wide > box.right + 1 || r.left < box.left - 1))
        controls.push({k: k, what: el.tagName.toLowerCase(), right: Math.round(wide), edge: Math.round(box.right)});
    });
  });
  // a table of five or more columns reads as cards on a phone (capsbook.js): its header row is not shown there
  const squeezed = Array.from(root.querySelectorAll('table')).filter(shown).filter(t => {
    const head = t.tHead && t.tHead.rows.length ? t.tHead.rows[t.tHead.rows.length - 1] : null;
    const columns = head ? Array.from(head.cells).reduce((n, c) => n + (c.colSpan || 1), 0) : 0;
    return columns >= 5 && getComputedStyle(t.tHead).display !== 'none';
  }).map(t => (t.tHead.textContent || '').trim().replace(/\\s+/g, ' ').slice(0, 60));
  // a word of a table cell that the browser broke across two lines (a column squeezed below its longest word);
  // hyphens, dashes and slashes are places where a line may end, so the pieces between them count as words
  const broken = [];
  root.querySelectorAll('th, td').forEach(c => {
    if (!shown(c)) return;
    const tw = document.createTreeWalker(c, NodeFilter.SHOW_TEXT);
    for (let n = tw.nextNode(); n; n = tw.nextNode()) {
      if (n.parentElement && n.parentElement.closest(skip)) continue;
      const re = /[^\\s\\-\\u2010-\\u2015\\/]{2,}/g;
      for (let m = re.exec(n.textContent); m; m = re.exec(n.textContent)) {
        const r = document.createRange();
        r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
        const tops = new Set(Array.from(r.getClientRects()).filter(b => b.width > 0).map(b => Math.round(b.top)));
        if (tops.size > 1) broken.push(m[0]);
      }
    }
  });
  return {text: parts.join(' '), cells: cells, equations: equations, controls: controls, squeezed: squeezed,
          broken: broken, page: document.documentElement.scrollWidth, viewport: window.innerWidth};
}"""

NAV_LINKS = """(w) => Array.from(document.querySelectorAll('.bd-sidebar-primary nav a, dialog nav a')).filter(a => {
  const r = a.getBoundingClientRect(); const s = getComputedStyle(a);
  return r.width > 0 && r.height > 0 && r.right > 0 && r.left < w && s.visibility !== 'hidden';
}).length"""


def _image_bytes(src: str, base: str) -> bytes | None:
    if src.startswith("data:"):
        header, _, payload = src.partition(",")
        return base64.b64decode(payload) if header.endswith(";base64") else payload.encode()
    if src.startswith(base):
        path = HTML / urllib.parse.unquote(urllib.parse.urlparse(src).path).lstrip("/")
        return path.read_bytes() if path.is_file() else None
    return None


def test_a_figure_wider_than_a_phones_column_fails():
    shown = [{"src": "http://x/_images/" + "a" * 64 + ".png", "declared": 715, "column": 350, "rendered": 540,
              "section": "s"},
             {"src": "http://x/_static/frames/0123456789abcdef/narrow.png", "declared": 336, "column": 350,
              "rendered": 336, "section": "s"},
             {"src": "http://x/_images/" + "b" * 64 + ".png", "declared": 0, "column": 350, "rendered": 900,
              "section": "s"}]                                # not an output figure: the legibility rule's
    (problem,) = _wider_than_column(shown)
    assert "540 px in a 350 px column" in problem


def output_text_px(declared: float, rendered: float) -> float:
    """The smallest text of a chapter's figure as drawn, in CSS px: tests/test_outputs.py holds every figure's
    smallest text to at least ``viz.MIN_TEXT_PX`` when the figure is shown at its declared width, or scaled down to
    the ``viz.COLUMN_PX`` column if it is wider; shown ``rendered`` px wide, it shrinks in proportion."""
    from capslib.book import viz

    if not declared > 0 or not rendered > 0:
        raise ValueError(f"output_text_px: widths must be positive, got {declared!r} and {rendered!r}")
    return viz.MIN_TEXT_PX * rendered / min(declared, viz.COLUMN_PX)


def _legibility(images: list[dict], base: str, page: str) -> list[tuple[str, str, float, float]]:
    """(page, image, ratio, allowed) for each image scaled below its legible size: a chapter's figure (an output
    image with a declared width) whose smallest text falls below ``MIN_OUTPUT_TEXT_PX``; any other image by the
    font-size rule of the module's docstring."""
    bad = []
    for im in images:
        if im.get("declared") and im["rendered"]:
            text = output_text_px(im["declared"], im["rendered"])
            if text < MIN_OUTPUT_TEXT_PX - 0.05:
                name = "frame player image" if im["src"].startswith("data:") else im["src"].rsplit("/", 1)[-1]
                # reported as a ratio against the largest that keeps the text legible
                ratio = min(im["declared"], COLUMN_PX_OF_FIGURES) / im["rendered"]
                bad.append((page, f"{name} (section {im['section']!r}; smallest text {text:.1f} px)", ratio,
                            ratio * text / MIN_OUTPUT_TEXT_PX))
            continue
        if not im["rendered"] or not im["natural"] or im["natural"] <= im["rendered"] + 0.5:
            continue
        data = _image_bytes(im["src"], base)
        if data is None:
            dpi = DEFAULT_DPI
        elif data[:8] == b"\x89PNG\r\n\x1a\n":
            dpi = png_dpi(data) or DEFAULT_DPI
        elif b"<svg" in data[:2000]:
            dpi = 96.0
        else:
            dpi = DEFAULT_DPI
        ratio = im["natural"] / im["rendered"]
        allowed = max_scale(dpi)
        if ratio > allowed:
            name = "frame player image" if im["src"].startswith("data:") else im["src"].rsplit("/", 1)[-1]
            name = f"{name} (section {im['section']!r})"
            bad.append((page, name, ratio, allowed))
    return bad


def _wider_than_column(images: list[dict]) -> list[str]:
    """On a phone every output figure fits its column whole: a figure with a phone drawing shows that drawing
    (capslib.book.reflow, swapped in by capsbook.js), a diagram is drawn narrow enough to scale into the column
    (tests/test_outputs.py), and no figure is cut or left to scroll sideways."""
    def name(src: str) -> str:
        return "inline image" if src.startswith("data:") else src.rsplit("/", 1)[-1]

    return [f"figure wider than its column: {name(im['src'])[:40]} (section {im['section']!r}) "
            f"{im['rendered']:.0f} px in a {im['column']:.0f} px column"
            for im in images if im.get("declared") and im["column"] and im["rendered"] > im["column"] + 1]


def _without_text_alternative(images: list[dict]) -> list[str]:
    """Every image on a page has a text alternative a screen reader can read: not empty, not a file's name
    (myst-nb's default for an output image; capslib.tools.sphinx_figures replaces it with the figure's own)."""
    def name(src: str) -> str:
        return "inline image" if src.startswith("data:") else src.rsplit("/", 1)[-1][:40]

    return [f"image without a text alternative: {name(im['src'])} (section {im['section']!r}), alt {im['alt'][:60]!r}"
            for im in images if not im.get("alt", "").strip() or re.search(r"[.](png|jpe?g|svg|gif)$", im["alt"].strip())]


def _column_problems(images: list[dict]) -> list[str]:
    """At 1280 px every output image sits in a column of capslib.book.viz.COLUMN_PX CSS px: the width
    each figure's text was measured for (tests/test_outputs.py). A narrower column would shrink
    every figure below the size that test checks."""
    from capslib.book import viz

    narrow = sorted({round(im["column"]) for im in images if im["column"] and im["column"] < viz.COLUMN_PX - 1})
    return [f"output column {w} px wide; figures are drawn for {viz.COLUMN_PX} px (capslib.book.viz.COLUMN_PX)"
            for w in narrow]


def _menu(pg, width: int) -> str | None:
    visible_before = pg.evaluate(NAV_LINKS, width)
    toggles = [t for t in pg.query_selector_all(".primary-toggle") if t.is_visible()]
    if width >= 992:
        if not visible_before:
            return "the chapter list is not visible at full width"
        if not toggles:
            return "no visible primary-sidebar toggle"
        toggles[0].click()
        pg.wait_for_timeout(400)
        hidden = pg.evaluate(NAV_LINKS, width) == 0
        toggles[0].click()
        pg.wait_for_timeout(400)
        return None if hidden else "the primary-sidebar toggle does not hide the chapter list"
    if visible_before:
        return None  # nothing to open: the list is already on screen
    if not toggles:
        return "no visible primary-sidebar toggle"
    toggles[0].click()
    pg.wait_for_timeout(600)
    if pg.evaluate(NAV_LINKS, width) == 0:
        return "clicking the primary-sidebar toggle does not show the chapter list"
    pg.keyboard.press("Escape")
    return None


def _check_page(ctx, base: str, page: str, width: int) -> tuple[list[str], dict]:
    problems: list[str] = []
    info = {"figures": 0, "illegible": [], "shot": None}
    pg = ctx.new_page()
    pg.set_viewport_size({"width": width, "height": HEIGHT})
    pg.set_default_timeout(PAGE_TIMEOUT_MS)

    def route(r):
        if r.request.url.startswith(base) or r.request.url.startswith("data:"):
            r.continue_()
        else:
            problems.append(f"request leaves loopback: {r.request.url[:120]}")
            r.abort()

    pg.route("**/*", route)
    pg.on("pageerror", lambda e: problems.append(f"page error: {str(e)[:200]}"))
    pg.on("console", lambda m: m.type == "error" and problems.append(
        f"console error: {m.text[:200]} ({(m.location or {}).get('url', '')[-80:]})"))
    try:
        pg.goto(f"{base}/{page}", wait_until="load")
        state = pg.evaluate(WAIT_MATHJAX, MATHJAX_TIMEOUT_MS)
        if state not in ("ok", "no MathJax on this page"):
            problems.append(state)
        pg.wait_for_function("Array.from(document.images).every(i => i.complete)", timeout=PAGE_TIMEOUT_MS)
        found = pg.evaluate(TEXT_NODES)
        for text in found["texts"]:
            snippet = raw_tex(text)
            if snippet:
                problems.append(f"raw TeX: ...{snippet}...")
        for err in found["errors"]:
            problems.append(f"MathJax error: {err[:160]}")
        if state == "ok":  # capsbook.js fits display equations to their column once MathJax has typeset
            try:
                pg.wait_for_function("document.documentElement.dataset.capsbookMath === 'fitted'", timeout=10_000)
            except Exception:
                problems.append("capsbook.js did not fit the display equations (no data-capsbook-math)")
        seen = pg.evaluate(READING)
        if seen["page"] > seen["viewport"] + 1:
            problems.append(f"page {seen['page']} px wide in a {seen['viewport']} px viewport (scrolls sideways)")
        for eq in seen["equations"]:
            problems.append(f"equation {eq['label']!r} " + ("runs under its number" if eq["under"] else
                            f"{eq['width']} px wide in a {eq['column']} px column"))
        if width != WIDTHS[0]:
            for head in seen["squeezed"]:
                problems.append(f"a table of five or more columns is squeezed, not read as cards: {head!r}")
        for c in seen["controls"]:
            problems.append(f"interactive figure {c['k'] + 1}: its {c['what']} runs to {c['right']} px, past the "
                            f"player's edge at {c['edge']} px")
        if width == WIDTHS[0]:  # a phone may break a long word (cells use overflow-wrap: anywhere there)
            for word in seen["broken"]:
                problems.append(f"a table cell's word broken across two lines at {width} px: {word[:40]!r}")
        for cell in cut_cells(seen["cells"]):
            problems.append(f"table cell cut: {cell[-60:]!r}")
        problems += [f"in the running text, {p}" for p in
                     plumbing(seen["text"], bibtex_keys(), PLUMBING_EXEMPT.get(page, set()))]
        for fig in pg.evaluate(MOVE_SLIDERS):
            info["figures"] += 1
            if "problem" in fig:
                problems.append(f"interactive figure {fig['k'] + 1} {fig.get('label', '')!r}: {fig['problem']}")
            elif fig["stuck"]:
                problems.append(f"interactive figure {fig['k'] + 1} {fig['label']!r}: the image does not change "
                                f"at slider positions {fig['stuck']} of {fig['positions']}")
            if fig.get("broken"):
                problems.append(f"interactive figure {fig['k'] + 1} {fig['label']!r}: no frame loads at slider "
                                f"positions {fig['broken']} of {fig['positions']}")
        images = pg.evaluate(IMAGES)
        problems += _without_text_alternative(images)
        bad = _legibility(images, base, page)
        if width == WIDTHS[0]:
            problems += _column_problems(images)
        else:
            problems += _wider_than_column(images)
        info["illegible"] = bad
        if width in LEGIBLE_AT:
            for _, name, ratio, allowed in bad:
                problems.append(f"illegible image {name}: scaled by 1/{ratio:.2f}, at most 1/{allowed:.2f} keeps "
                                + (f"its text {MIN_OUTPUT_TEXT_PX:g} px high" if "smallest text" in name else
                                   f"{FIGURE_FONT_PT:g} pt text {MIN_FONT_PX:g} px high"))
        shot = SCREENS / f"{page.replace('/', '__').removesuffix('.html')}-{width}.jpg"
        pg.screenshot(path=str(shot), full_page=True, type="jpeg", quality=70)
        info["shot"] = shot
        menu = _menu(pg, width)
        if menu:
            problems.append(f"menu: {menu}")
    except Exception as e:  # a timeout or a crashed page is a finding about this page, not the run
        problems.append(f"could not check the page: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    finally:
        pg.close()
    return problems, info


# Page weight budgets. The built site, 2026-11-26: 70 MB in all, of which MathJax 24 MB and the notebooks'
# sources 22 MB; the heaviest page chapter 3 at 2.9 MB, 2.4 MB of it the frames of its slider, inlined.
# 2026-11-27, the players' frames as files loaded on demand (4.5 MB under _static/frames): 65 MB in all, the
# heaviest page chapter 4 at 0.96 MB. Ceilings a little above today's, so that a page or the site cannot grow
# unnoticed. 2026-11-27 evening, with the phone drawings (capslib.book.reflow, 4.7 MB): 68.9 MB. 2026-11-28,
# without the MathJax entry points no page loads (capslib.tools.sphinx_mathjax_trim, 14 MB): 56.0 MB.
PAGE_BUDGET_MB = 1.25
SITE_BUDGET_MB = 60.0


def site_weight(html: Path) -> tuple[float, list[tuple[str, float]]]:
    """The site's size in MB and its HTML pages with their sizes in MB, heaviest first."""
    files = [p for p in html.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files) / 1e6
    pages_mb = sorted(((p.relative_to(html).as_posix(), p.stat().st_size / 1e6) for p in files
                       if p.suffix == ".html"), key=lambda t: -t[1])
    return total, pages_mb


@pytest.mark.skipif(not REQUESTED, reason="run by make test-browser on the strict build")
def test_the_reading_check_finds_a_word_broken_in_a_table_cell(browser_context):
    """READING reports a word that a squeezed column breaks across lines, and not one broken at a hyphen."""
    page = browser_context.new_page()
    try:
        cell = "<td style='width:3em;max-width:3em;overflow-wrap:{wrap}'>{text}</td>"
        html = ("<main><table style='table-layout:fixed;width:6em'><tr>" + cell.format(wrap="anywhere", text="parameters")
                + cell.format(wrap="normal", text="one-two-three") + "</tr></table></main>")
        page.set_content(html)
        assert page.evaluate(READING)["broken"] == ["parameters"]
    finally:
        page.close()


@pytest.mark.skipif(not REQUESTED, reason="run by make test-browser on the strict build")
def test_a_window_narrowed_to_a_phone_breaks_table_code_between_words(server, browser_context):
    """A page opened at a desktop width keeps its tables' code names whole (no <wbr>); narrowed to a phone's width,
    it gets the same <wbr> after underscores and dots as the page opened there (capsbook.js)."""
    wbr = "document.querySelectorAll('article table code wbr').length"
    counts = []
    for widths in ((WIDTHS[0], WIDTHS[1]), (WIDTHS[1],)):
        page = browser_context.new_page()
        try:
            page.set_viewport_size({"width": widths[0], "height": HEIGHT})
            page.goto(f"{server}/book/assignments.html", wait_until="load")
            if len(widths) == 2:
                assert page.evaluate(wbr) == 0, "a page opened at a desktop width has <wbr> in its tables' code"
                page.set_viewport_size({"width": widths[1], "height": HEIGHT})
                page.wait_for_function(f"{wbr} > 0", timeout=5000)
                page.wait_for_timeout(400)                   # a second width change must not add more
                page.set_viewport_size({"width": widths[1] - 20, "height": HEIGHT})
                page.wait_for_timeout(400)
            counts.append(page.evaluate(wbr))
        finally:
            page.close()
    assert counts[0] == counts[1] > 0, f"<wbr> narrowed {counts[0]}, opened narrow {counts[1]}"


@pytest.mark.skipif(not REQUESTED, reason="run by make test-browser on the strict build")
def test_page_weights_within_budget():
    assert (HTML / "book").is_dir(), f"no built book in {HTML} (make build-strict)"
    total, pages_mb = site_weight(HTML)
    heavy = [(p, mb) for p, mb in pages_mb if mb > PAGE_BUDGET_MB]
    print(f"site {total:.1f} MB; heaviest pages: " + ", ".join(f"{p} {mb:.2f} MB" for p, mb in pages_mb[:3]))
    assert not heavy, f"pages over the {PAGE_BUDGET_MB} MB budget: {heavy}"
    assert total <= SITE_BUDGET_MB, f"the site is {total:.1f} MB, over its {SITE_BUDGET_MB} MB budget"


@pytest.mark.skipif(not REQUESTED, reason="run by make test-browser (CAPSBOOK_BROWSER=1): it needs Chromium "
                    "and the built HTML, and takes minutes")
def test_every_page_in_chromium(server, browser_context):
    if SCREENS.exists():
        shutil.rmtree(SCREENS)
    SCREENS.mkdir(parents=True)
    listed = pages()
    assert listed, f"no HTML pages under {HTML}"
    t0 = time.monotonic()
    lines, failing, figures, illegible = [], 0, 0, []
    for page in listed:
        for width in WIDTHS:
            t = time.monotonic()
            problems, info = _check_page(browser_context, server, page, width)
            figures += info["figures"] if width == WIDTHS[0] else 0
            illegible += [(width, *b) for b in info["illegible"]]
            status = "ok" if not problems else f"{len(problems)} problem(s)"
            lines.append(f"{page} @ {width}px: {status}; {info['figures']} interactive figure(s) "
                         f"({time.monotonic() - t:.1f} s)")
            lines += [f"    {p}" for p in problems]
            failing += bool(problems)
    lines.append(f"{len(listed)} pages x {len(WIDTHS)} widths, {failing} failing; {figures} interactive figures; "
                 f"{time.monotonic() - t0:.0f} s; screenshots in {SCREENS}")
    lines.append(f"images scaled below legibility (a chapter's figure: its smallest text under {MIN_OUTPUT_TEXT_PX:g} px; "
                 f"another image: {FIGURE_FONT_PT:g} pt text under {MIN_FONT_PX:g} px; enforced at "
                 f"{', '.join(f'{w} px' for w in LEGIBLE_AT)}; page, file, ratio, allowed):")
    lines += [f"    {w} px  {p}  {n}  {r:.2f} > {a:.2f}" for w, p, n, r, a in illegible]
    report = "\n".join(lines) + "\n"
    (SCREENS / "report.txt").write_text(report)
    print(report)
    assert failing == 0, f"{failing} page views fail in the browser (report: {SCREENS / 'report.txt'}):\n{report}"
