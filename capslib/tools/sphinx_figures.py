"""A Sphinx extension that pairs each notebook figure with its phone drawing.

myst-nb writes a figure output as an image named by the SHA-256 of its PNG. When the chapter was
executed, :mod:`capslib.book.reflow` drew the figure a second time for a phone's column and wrote it as
``_static/frames/<h>/narrow.png``, ``h`` the first 16 hex digits of the same digest. This marks every
image that has such a drawing with the class ``capsbook-narrow-<h>``; ``book/_static/capsbook.js`` swaps
it in where the page's column is narrow. ``_config.yml`` names the extension.
"""
from __future__ import annotations

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


def mark(app, doctree) -> None:
    from docutils import nodes

    dirs = static_dirs(app)
    for node in doctree.findall(nodes.image):
        h = phone_drawing(str(node.get("uri", "")), dirs)
        if h and CLASS_PREFIX + h not in node["classes"]:
            node["classes"].append(CLASS_PREFIX + h)


def setup(app):
    app.connect("doctree-read", mark)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
