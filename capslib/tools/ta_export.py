"""The hand-graded parts of submitted assignments as HTML pages, for teaching assistants.

Each assignment has questions graded by hand: in the student notebook (``make assignments``) each sits
between the Markdown markers ``<!-- BEGIN QUESTION -->`` and ``<!-- END QUESTION -->``, the prompt
first, then the student's answer cells (text, code and the outputs the student ran). This command
reads a set of submissions and writes

- ``index.html``: every submission and every hand-graded question, linked;
- ``<submission>.html``: one submission's hand-graded questions, in order;
- ``question-<k>.html``: question ``k`` of every submission, one after the other (grading one
  question across the class keeps a TA's marks consistent).

Only those parts are exported: the autograded questions, the setup cells and the ``grader.check``
cells are left out. Nothing a submission holds can run in the TA's browser: raw HTML in its text is
shown as text, and of its outputs only text and bitmap images are kept (embedded, so each page is one
file that opens from disk). The maths is typeset by MathJax where the browser can load it and stays
readable TeX where not.

    python -m capslib.tools.ta_export SUBMISSION... --out DIR [--anonymous]

A ``SUBMISSION`` is a notebook, a folder (searched for notebooks) or an otter submission zip (its
notebooks are read without unpacking). ``--anonymous`` names the submissions "submission 1", ... in the
pages and writes the key to ``DIR/key.txt`` for whoever enters the marks.
"""
from __future__ import annotations

import argparse
import html
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

BEGIN = "<!-- BEGIN QUESTION -->"
END = "<!-- END QUESTION -->"


@dataclass
class Question:
    title: str
    cells: list = field(default_factory=list)


def manual_questions(nb) -> list[Question]:
    """The hand-graded questions of a student notebook, each with its prompt and answer cells (copies,
    outputs kept). Markers may share a cell (``END`` of one question, then ``BEGIN`` of the next); text
    outside the markers is dropped. An unclosed question ends with the notebook."""
    out: list[Question] = []
    current: Question | None = None
    for cell in nb.cells:
        if cell.cell_type != "markdown" or (BEGIN not in cell.source and END not in cell.source):
            if current is not None:
                current.cells.append(nbformat.from_dict(dict(cell)))
            continue
        for piece in re.split(f"({re.escape(BEGIN)}|{re.escape(END)})", cell.source):
            if piece == BEGIN:
                current = Question(title="")
                out.append(current)
            elif piece == END:
                current = None
            elif current is not None and piece.strip():
                lines = piece.strip().splitlines()
                if not current.title and lines[0].startswith("#"):   # the heading becomes the section's title
                    current.title = lines.pop(0).lstrip("#").strip()
                if "\n".join(lines).strip():
                    current.cells.append(nbformat.v4.new_markdown_cell("\n".join(lines).strip()))
    for k, q in enumerate(out, start=1):
        q.title = q.title or f"Question {k}"
    return out


def read_submissions(paths: list[Path]) -> dict[str, object]:
    """``{name: notebook}`` for every notebook in ``paths`` (notebooks, folders, otter zips)."""
    found: dict[str, object] = {}

    def add(name: str, text: str) -> None:
        key, n = name, 2
        while key in found:                 # two submissions with the same file name
            key, n = f"{name} ({n})", n + 1
        found[key] = nbformat.reads(text, as_version=4)

    for p in paths:
        if p.is_dir():
            for nb_path in sorted(p.rglob("*.ipynb")):
                if ".ipynb_checkpoints" not in nb_path.parts:
                    add(str(nb_path.relative_to(p).with_suffix("")), nb_path.read_text())
        elif p.suffix == ".zip":
            with zipfile.ZipFile(p) as z:
                members = [m for m in z.namelist() if m.endswith(".ipynb") and ".ipynb_checkpoints" not in m]
                if not members:
                    raise ValueError(f"{p}: the zip holds no notebook")
                for m in members:
                    add(p.stem if len(members) == 1 else f"{p.stem}/{Path(m).stem}", z.read(m).decode())
        elif p.suffix == ".ipynb":
            add(p.stem, p.read_text())
        else:
            raise ValueError(f"{p}: not a notebook, a folder or a zip")
    if not found:
        raise ValueError("no notebook found in " + ", ".join(map(str, paths)))
    return found


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "submission"


SAFE_OUTPUTS = ("text/plain", "image/png", "image/jpeg")   # no HTML, SVG or script a submission could carry


def _safe(cell):
    """A copy of ``cell`` that cannot run anything in a browser: Markdown with its raw HTML shown as text
    (``<`` and ``>`` escaped; Markdown formatting and $maths$ still render), outputs reduced to text and
    bitmap images (HTML, SVG and JavaScript outputs dropped), attachments dropped."""
    cell = nbformat.from_dict(dict(cell))
    cell.pop("attachments", None)
    if cell.cell_type == "markdown":
        cell.source = cell.source.replace("<", "&lt;").replace(">", "&gt;")
    elif cell.cell_type == "code":
        kept = []
        for o in cell.get("outputs", []):
            if o.get("output_type") in ("display_data", "execute_result"):
                data = {k: v for k, v in o.get("data", {}).items() if k in SAFE_OUTPUTS}
                if not data:
                    continue
                o = nbformat.from_dict({**o, "data": data, "metadata": {}})
            kept.append(o)
        cell.outputs = kept
    else:
        cell = nbformat.v4.new_markdown_cell(cell.source.replace("<", "&lt;").replace(">", "&gt;"))
    return cell


def _body(cells: list) -> str:
    """The cells as HTML (nbconvert's basic template, images embedded) after :func:`_safe`: the page's
    body. nbconvert's own ``sanitize_html`` is not used: in nbconvert 7.17 it escapes ``<p>`` and headings."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="basic", embed_images=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(nbformat.v4.new_notebook(cells=[_safe(c) for c in cells]))
    return body


def _page(title: str, body: str) -> str:
    return ("<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif;max-width:60rem;margin:auto;padding:1rem;line-height:1.45}"
            "pre{white-space:pre-wrap;background:#f6f6f6;padding:.5rem}img{max-width:100%}"
            "section{border-top:2px solid #888;margin-top:2rem}</style>"
            "<script>window.MathJax={tex:{inlineMath:[['$','$']]}};</script>"
            "<script async src='https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js'></script></head>"
            f"<body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")


def export(paths: list[Path], out: Path, anonymous: bool = False) -> dict:
    """Write the pages (see the module's docstring) and return ``{"submissions": n, "questions": k,
    "files": [...]}``. Submissions whose hand-graded questions differ in number from the most common
    count still get their page; the per-question pages show what each has under that number."""
    subs = read_submissions(paths)
    names = {name: (f"submission {i}" if anonymous else name) for i, name in enumerate(subs, start=1)}
    qs = {name: manual_questions(nb) for name, nb in subs.items()}
    k = max((len(v) for v in qs.values()), default=0)
    if k == 0:
        raise ValueError("no hand-graded question (<!-- BEGIN QUESTION --> ... <!-- END QUESTION -->) in the submissions")
    out.mkdir(parents=True, exist_ok=True)
    files = []
    titles = [next((v[i].title for v in qs.values() if len(v) > i), f"Question {i + 1}") for i in range(k)]
    for name, questions in qs.items():
        sections = "".join(f"<section><h2>{html.escape(q.title)}</h2>{_body(q.cells)}</section>" for q in questions)
        path = out / f"{_slug(names[name])}.html"
        path.write_text(_page(names[name], sections or "<p>No hand-graded answer found.</p>"))
        files.append(path)
    for i, title in enumerate(titles):
        parts = []
        for name, questions in qs.items():
            body = _body(questions[i].cells) if len(questions) > i else "<p>No answer found.</p>"
            parts.append(f"<section><h2>{html.escape(names[name])}</h2>{body}</section>")
        path = out / f"question-{i + 1}.html"
        path.write_text(_page(title, "".join(parts)))
        files.append(path)
    links = "".join(f"<li><a href='{_slug(names[n])}.html'>{html.escape(names[n])}</a></li>" for n in subs)
    qlinks = "".join(f"<li><a href='question-{i + 1}.html'>{html.escape(t)}</a></li>" for i, t in enumerate(titles))
    index = out / "index.html"
    index.write_text(_page("Hand-graded answers", f"<h2>By question</h2><ul>{qlinks}</ul>"
                                                   f"<h2>By submission</h2><ul>{links}</ul>"))
    files.append(index)
    if anonymous:
        key = out / "key.txt"
        key.write_text("".join(f"{names[n]}\t{n}\n" for n in subs))
        files.append(key)
    return {"submissions": len(subs), "questions": k, "files": files}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("submissions", nargs="+", type=Path, help="notebooks, folders of notebooks or otter zips")
    ap.add_argument("--out", type=Path, required=True, help="folder for the HTML pages")
    ap.add_argument("--anonymous", action="store_true", help="number the submissions; the key goes to key.txt")
    args = ap.parse_args(argv)
    try:
        r = export(args.submissions, args.out, args.anonymous)
    except ValueError as e:
        print(f"ta_export: {e}", file=sys.stderr)
        return 2
    print(f"{r['submissions']} submissions, {r['questions']} hand-graded questions: {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
