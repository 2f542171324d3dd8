"""A Sphinx extension that leaves out of the built site the MathJax bundles no page loads.

``sphinx-mathjax-offline`` copies MathJax's whole distribution into ``_static/mathjax`` when a build
finishes (24 MB, a third of the site), and points every page at one entry point, ``tex-chtml.js``. The
other combined entry points (TeX or MathML input with SVG or CommonHTML output, with or without the speech
engine) are never loaded: an entry point is named by the page, and MathJax's loader fetches only
components (``input/``, ``output/``, ``a11y/``, ``ui/``, ``sre/``), which all stay, so the maths menu's
renderer and accessibility choices keep working. This runs after that copy and deletes :data:`UNUSED`
(14 MB); ``_config.yml`` names it after ``sphinx-mathjax-offline``.
"""
from __future__ import annotations

from pathlib import Path

ENTRY = "tex-chtml.js"
UNUSED = ("tex-chtml-full.js", "tex-chtml-full-speech.js", "tex-mml-chtml.js", "tex-mml-svg.js", "tex-svg.js",
          "tex-svg-full.js", "mml-chtml.js", "mml-svg.js", "node-main.js")


def trim(mathjax_dir: Path, entry: str = ENTRY) -> list[str]:
    """Delete the :data:`UNUSED` entry points from ``mathjax_dir``; return the names deleted. Refuses when the
    pages' entry point is itself among them or is missing (a MathJax that is laid out otherwise is left whole)."""
    mathjax_dir = Path(mathjax_dir)
    if entry in UNUSED:
        raise ValueError(f"the pages load {entry}: it cannot be trimmed")
    if not (mathjax_dir / entry).is_file():
        return []
    gone = []
    for name in UNUSED:
        path = mathjax_dir / name
        if path.is_file():
            path.unlink()
            gone.append(name)
    return gone


def _build_finished(app, exc) -> None:
    if exc is not None or app.builder.format != "html":
        return
    entry = Path(str(app.config.mathjax_path)).name
    trim(Path(app.outdir) / "_static" / "mathjax", entry)


def setup(app):
    app.connect("build-finished", _build_finished, priority=900)   # after sphinx-mathjax-offline's copy (500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
