"""The student edition leaves out the book's code that answers an assignment (issue 35, item 5).

Several chapters write the graded thing from scratch (chapter 3's ``backward_from_scratch`` is
assignment a3's ``my_manual_gradients`` under another name). Each master in ``book/assignments/``
lists those functions in its ``NoDelegation`` configuration::

    plugins:
      - capslib.tools.grading.NoDelegation:
          guard: [...]
          book_answers:
            03_soft_routing_gradients: [backward_from_scratch]

``python -m capslib.tools.grading student-config`` collects the lists (:func:`book_answers`) into the
student edition's Sphinx configuration and adds this module as a Sphinx extension. While Sphinx reads
a chapter, :func:`strip_answers` replaces each listed function's definition in the cell that holds it
by a one-line comment naming the assignment; the rest of the cell (the checks against capslib) and
its outputs stay. The committed notebooks are never changed: only the text Sphinx parses for the
student edition. A listed function that no cell defines stops the build (a renamed function must
not leak silently). ``check-student`` then reads both HTML builds: every listed function's code
must be in the book and absent from the student edition (:func:`leaked_answers`).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Iterable

_PLUGIN = "capslib.tools.grading.NoDelegation"
CONFIG_KEY = "capsbook_book_answers"


def master_config(master: str | Path) -> dict:
    """The ``# ASSIGNMENT CONFIG`` of an otter master notebook, parsed."""
    import nbformat
    import yaml

    nb = nbformat.read(Path(master), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "raw" and cell.source.lstrip().startswith("# ASSIGNMENT CONFIG"):
            return yaml.safe_load(cell.source) or {}
    raise ValueError(f"{master}: no '# ASSIGNMENT CONFIG' raw cell (is it an otter master?)")


def book_answers(masters: Iterable[str | Path]) -> dict[str, dict[str, str]]:
    """Chapter (notebook stem) -> {function defined in that chapter: the assignment it answers}."""
    out: dict[str, dict[str, str]] = {}
    for master in map(Path, masters):
        cfg = master_config(master)
        plugins = [p[_PLUGIN] for p in cfg.get("plugins", []) if isinstance(p, dict) and _PLUGIN in p]
        answers = plugins[0].get("book_answers", {}) if plugins else {}
        if not isinstance(answers, dict) or not all(
                isinstance(fns, list) and all(isinstance(f, str) for f in fns) for fns in answers.values()):
            raise ValueError(f"{master.name}: book_answers must map a chapter to a list of function names; "
                             f"got {answers!r}")
        for chapter, fns in answers.items():
            for fn in fns:
                earlier = out.setdefault(str(chapter), {}).setdefault(fn, master.stem)
                if earlier != master.stem:
                    raise ValueError(f"{chapter}.{fn} is listed by two assignments: {earlier} and {master.stem}")
    return out


def _definitions(source: str) -> dict[str, tuple[int, int]]:
    """Top-level function/class name -> (first line with its decorators, last line), 1-based."""
    lines = [("" if l.lstrip().startswith(("%", "!")) else l) for l in source.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return {}
    return {s.name: (min([s.lineno] + [d.lineno for d in s.decorator_list]), s.end_lineno or s.lineno)
            for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def note(function: str, assignment: str) -> str:
    """The comment that stands in the student edition where ``function`` was defined."""
    return (f"# {function}: left out of the student edition; it answers assignment {assignment} "
            "(the instructor edition shows it)")


def strip_answers(source: str, answers: dict[str, str]) -> tuple[str, list[str]]:
    """``source`` with each top-level definition named in ``answers`` replaced by :func:`note`.

    Returns the new source and the names it removed (in source order).
    """
    spans = sorted((span, name) for name, span in _definitions(source).items() if name in answers)
    if not spans:
        return source, []
    lines = source.splitlines()
    out, at = [], 0
    for (first, last), name in spans:
        out.extend(lines[at:first - 1])
        out.append(note(name, answers[name]))
        at = last
    out.extend(lines[at:])
    return "\n".join(out) + ("\n" if source.endswith("\n") else ""), [name for _, name in spans]


def strip_notebook(text: str, answers: dict[str, str], where: str = "notebook") -> str:
    """A notebook's JSON text with :func:`strip_answers` applied to its code cells.

    Raises ValueError when a name in ``answers`` is not defined by exactly one code cell.
    """
    nb = json.loads(text)
    found: dict[str, int] = {}
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        new, removed = strip_answers(source, answers)
        for name in removed:
            found[name] = found.get(name, 0) + 1
        if removed:
            cell["source"] = new
    wrong = {n: found.get(n, 0) for n in answers if found.get(n, 0) != 1}
    if wrong:
        raise ValueError(f"{where}: each function listed in a master's book_answers must be defined by one "
                         f"code cell; cells defining them: {wrong}")
    return json.dumps(nb, indent=1, ensure_ascii=False)


def answer_sources(chapters: dict[str, Path], answers: dict[str, dict[str, str]]) -> dict[str, str]:
    """``chapter.function`` -> the function's source in the committed chapter ``chapters[chapter]``."""
    import nbformat

    out: dict[str, str] = {}
    for chapter, fns in answers.items():
        if chapter not in chapters:
            raise ValueError(f"book_answers names the chapter {chapter!r}, which is not among the sources")
        cells = [c.source for c in nbformat.read(chapters[chapter], as_version=4).cells if c.cell_type == "code"]
        for fn in fns:
            spans = [(src, _definitions(src)[fn]) for src in cells if fn in _definitions(src)]
            if len(spans) != 1:
                raise ValueError(f"{chapter}: {fn} must be defined by one code cell; found {len(spans)}")
            src, (first, last) = spans[0]
            out[f"{chapter}.{fn}"] = "\n".join(src.splitlines()[first - 1:last])
    return out


def leaked_answers(normal_text: str, student_text: str, sources: dict[str, str]) -> tuple[list[str], list[str]]:
    """(missing, leaked): the answers whose code is not in the book's text (the check would be vacuous)
    and those whose code is in the student edition's text. Texts as ``grading._words`` makes them."""
    from capslib.tools.grading import _words

    words = {k: _words(src) for k, src in sources.items()}
    missing = [k for k, w in words.items() if w not in normal_text]
    leaked = [k for k, w in words.items() if w in student_text]
    return missing, leaked


# ----------------------------------------------------------------------------- the Sphinx extension

def _strip_on_read(app, docname: str, content: list[str]) -> None:
    answers = app.config[CONFIG_KEY].get(Path(docname).name)
    if answers:
        content[0] = strip_notebook(content[0], answers, where=f"{docname}.ipynb")


def setup(app):
    """Sphinx extension of the student edition: see the module docstring."""
    app.add_config_value(CONFIG_KEY, {}, "env")
    app.connect("source-read", _strip_on_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
