"""A Sphinx extension that pairs each notebook figure with its phone drawing and its text alternative.

myst-nb writes a figure output as an image named by the SHA-256 of its PNG. When the chapter was
executed, :mod:`capslib.book.reflow` drew the figure a second time for a phone's column and wrote it as
``_static/frames/<h>/narrow.png``, ``h`` the first 16 hex digits of the same digest. This marks every
image that has such a drawing with the class ``capsbook-narrow-<h>``; ``book/_static/capsbook.js`` swaps
it in where the page's column is narrow. ``_config.yml`` names the extension.

myst-nb gives every output image its file's path as ``alt``, which a screen reader reads out as a hash.
The kernel that drew the figure put a text alternative in the output's metadata
(``capsbook.alt``, from :func:`capslib.book.viz.alt_text`); this extension reads it from the notebook and gives
it to the image with the same digest.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

OUTPUT_IMAGE = re.compile(r"(?:^|/)([0-9a-f]{64})[.]png$")
CLASS_PREFIX = "capsbook-narrow-"


def static_dirs(app) -> list[Path]:
    base = Path(app.confdir)
    return [base / p for p in (app.config.html_static_path or [])]


def phone_drawing(uri: str, dirs: list[Path]) -> str | None:
    """The 16-digit name of the phone drawing of the output image at ``uri``, where one exists in ``dirs``."""
    m = OUTPUT_IMAGE.search(uri)
    if not m:
        return None
    h = m.group(1)[:16]
    return h if any((d / "frames" / h / "narrow.png").is_file() for d in dirs) else None


def text_alternatives(notebook: dict) -> dict[str, str]:
    """SHA-256 of each PNG output of ``notebook`` (its JSON, parsed) -> the text alternative its metadata holds."""
    out = {}
    for cell in notebook.get("cells", []):
        for output in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            png = output.get("data", {}).get("image/png")
            alt = output.get("metadata", {}).get("image/png", {}).get("capsbook", {}).get("alt")
            if png and isinstance(alt, str) and alt.strip():
                data = base64.b64decode("".join(png) if isinstance(png, list) else png)
                out[hashlib.sha256(data).hexdigest()] = alt.strip()
    return out


def _alternatives(app, docname: str) -> dict[str, str]:
    path = Path(app.env.doc2path(docname))
    if path.suffix != ".ipynb" or not path.is_file():
        return {}
    return text_alternatives(json.loads(path.read_text(encoding="utf-8")))


def mark(app, doctree) -> None:
    from docutils import nodes

    dirs = static_dirs(app)
    alternatives = None
    for node in doctree.findall(nodes.image):
        uri = str(node.get("uri", ""))
        h = phone_drawing(uri, dirs)
        if h and CLASS_PREFIX + h not in node["classes"]:
            node["classes"].append(CLASS_PREFIX + h)
        m = OUTPUT_IMAGE.search(uri)
        if m:
            if alternatives is None:
                alternatives = _alternatives(app, app.env.docname)
            if m.group(1) in alternatives:
                node["alt"] = alternatives[m.group(1)]


def setup(app):
    app.connect("doctree-read", mark)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
