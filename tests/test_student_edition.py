"""The student edition leaves out the chapters' functions that answer an assignment (issue 35, item 5).

Fast: no HTML build here (``make book-student compare-student``, part of ``make test``, builds it and
runs the same check on the real pages)."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
import yaml

import capslib.tools.grading as grading
from capslib.tools import student_edition as se

ROOT = Path(__file__).resolve().parents[1]
MASTERS = sorted((ROOT / "book" / "assignments").glob("*.ipynb"))
CHAPTERS = {p.stem: p for p in sorted((ROOT / "book").glob("*.ipynb"))}


def test_every_master_names_the_chapter_code_that_answers_it():
    answers = se.book_answers(MASTERS)
    assert {a for fns in answers.values() for a in fns.values()} == {m.stem for m in MASTERS}
    # the four the audit of issue 35 graded at full marks, and the others found by reading the chapters
    for chapter, fn in [("03_soft_routing_gradients", "backward_from_scratch"), ("05_em_routing", "em_scratch"),
                        ("07_products_of_expert_capsules", "data_term_scratch"),
                        ("07_products_of_expert_capsules", "cd1_scratch"), ("02_dynamic_routing", "routing_scratch"),
                        ("06_rem", "entropy_scratch"), ("01_capsules_as_vectors", "squash_jacobian")]:
        assert fn in answers[chapter], (chapter, fn)
    code = se.answer_sources(CHAPTERS, answers)   # each is defined by exactly one code cell
    assert len(code) == sum(len(f) for f in answers.values())
    assert all(src.startswith(f"def {key.split('.')[1]}(") for key, src in code.items()), code


def test_stripping_a_chapter_removes_only_the_answers_and_keeps_the_outputs():
    answers = se.book_answers(MASTERS)
    chapter = "07_products_of_expert_capsules"
    path = CHAPTERS[chapter]
    before = nbformat.read(path, as_version=4)
    after = nbformat.reads(se.strip_notebook(path.read_text(), answers[chapter], where=path.name), as_version=4)
    assert len(after.cells) == len(before.cells)
    sources = se.answer_sources(CHAPTERS, {chapter: answers[chapter]})
    text = "\n".join(c.source for c in after.cells)
    for key, src in sources.items():
        fn = key.split(".")[1]
        assert src not in text and f"def {fn}(" not in text
        assert se.note(fn, "a7_products_of_expert_capsules") in text
    changed = [i for i, (a, b) in enumerate(zip(before.cells, after.cells)) if a.source != b.source]
    assert len(changed) == 3, changed          # free energy, data term, CD-1: one cell each
    for i in changed:
        assert after.cells[i].outputs == before.cells[i].outputs   # glued values and printed checks stay
        # the checks after the definition stay: every line that is not part of a removed function
        assert "torch.testing.assert_close" in after.cells[i].source
    assert all(a == b for i, (a, b) in enumerate(zip(before.cells, after.cells)) if i not in changed)


def test_strip_answers_handles_decorators_and_several_definitions():
    src = ("import torch\n\n@torch.no_grad()\ndef mine(x):\n    return x + 1\n\n\ndef helper(x):\n"
           "    return x\n\n\ndef keep(x):\n    return 2 * x\n\nprint(keep(mine(1)))\n")
    out, removed = se.strip_answers(src, {"mine": "a9", "helper": "a9"})
    assert removed == ["mine", "helper"]
    assert "@torch.no_grad" not in out and "return x + 1" not in out and "return x\n" not in out
    assert "def keep(x):\n    return 2 * x" in out and out.endswith("print(keep(mine(1)))\n")
    assert out.count("left out of the student edition") == 2
    assert se.strip_answers(src, {"absent": "a9"}) == (src, [])


def test_a_listed_function_that_no_cell_defines_stops_the_build():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("def other():\n    pass\n")])
    with pytest.raises(ValueError, match="renamed_scratch"):
        se.strip_notebook(nbformat.writes(nb), {"renamed_scratch": "a3"}, where="ch.ipynb")
    twice = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("def f():\n    pass\n") for _ in range(2)])
    with pytest.raises(ValueError, match="'f': 2"):
        se.strip_notebook(nbformat.writes(twice), {"f": "a3"})


def test_book_answers_rejects_a_malformed_list(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_raw_cell(
        "# ASSIGNMENT CONFIG\nplugins:\n  - capslib.tools.grading.NoDelegation:\n      guard: [capslib.squash]\n"
        "      book_answers:\n        01_capsules_as_vectors: squash_scratch\n")])
    nbformat.write(nb, tmp_path / "a0.ipynb")
    with pytest.raises(ValueError, match="book_answers must map a chapter to a list"):
        se.book_answers([tmp_path / "a0.ipynb"])


def test_student_config_switches_the_extension_on(tmp_path):
    dest = grading.student_config(ROOT / "_config.yml", tmp_path / "_config.yml", MASTERS)
    cfg = yaml.safe_load(dest.read_text())
    sphinx = cfg["sphinx"]
    assert "capslib.tools.student_edition" in sphinx["extra_extensions"]
    assert sphinx["config"]["hide_solutions"] is True
    assert sphinx["config"]["html_copy_source"] is False
    assert sphinx["config"]["html_theme_options"]["use_download_button"] is False
    assert sphinx["config"][se.CONFIG_KEY] == se.book_answers(MASTERS)
    # the normal config is untouched
    assert "capslib.tools.student_edition" not in (ROOT / "_config.yml").read_text()


def test_the_sphinx_hook_strips_the_text_sphinx_reads():
    class App:
        config = {se.CONFIG_KEY: {"03_soft_routing_gradients": {"backward_from_scratch": "a3"}}}
    text = CHAPTERS["03_soft_routing_gradients"].read_text()
    content = [text]
    se._strip_on_read(App, "book/03_soft_routing_gradients", content)
    assert "def backward_from_scratch(" in text and "def backward_from_scratch(" not in content[0]
    untouched = [CHAPTERS["05_em_routing"].read_text()]
    se._strip_on_read(App, "book/05_em_routing", untouched)
    assert untouched[0] == CHAPTERS["05_em_routing"].read_text()
    json.loads(content[0])   # still a notebook


def _page(tmp_path: Path, code_in_student: bool, sources_copy: bool = False) -> tuple[Path, Path, list[Path], Path]:
    """A one-chapter book: its notebook, a master that lists its answer, and two HTML builds."""
    tmp_path.mkdir(parents=True)
    chapter = tmp_path / "01_toy.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(":::{exercise}\n:label: ex-a\nWhy?\n:::\n\n:::{solution} ex-a\n"
                                      ":class: dropdown\nBecause the couplings sum to one over the parents.\n:::\n"),
        nbformat.v4.new_code_cell("def toy_scratch(s):\n    n2 = (s * s).sum(-1)  # Eq. 1\n    return s * n2\n\n"
                                  "print(toy_scratch(2))\n")]), chapter)
    master = tmp_path / "a0_toy.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_raw_cell(
        "# ASSIGNMENT CONFIG\nplugins:\n  - capslib.tools.grading.NoDelegation:\n      guard: [capslib.squash]\n"
        "      book_answers:\n        01_toy: [toy_scratch]\n")]), master)
    code_html = ('<pre><span class="k">def</span> <span class="nf">toy_scratch</span>(s):\n    n2 <span class="o">=</span>'
                 ' (s <span class="o">*</span> s).sum(<span class="o">-</span>1)  <span class="c1"># Eq. 1</span>\n'
                 '    <span class="k">return</span> s <span class="o">*</span> n2</pre>')
    book, student = tmp_path / "book", tmp_path / "student"
    for d in (book, student):
        d.mkdir()
    (book / "page.html").write_text("<p>Why?</p><p>Because the couplings sum to one over the parents.</p>" + code_html)
    (student / "page.html").write_text("<p>Why?</p>" + (code_html if code_in_student else
                                       "<pre># toy_scratch: left out of the student edition</pre>"))
    if sources_copy:
        (student / "_sources").mkdir()
        (student / "_sources" / "01_toy.ipynb").write_text(chapter.read_text())
    return book, student, [chapter], master


def test_check_student_catches_a_leaked_answer_and_a_copy_of_the_sources(tmp_path):
    book, student, sources, master = _page(tmp_path / "clean", code_in_student=False)
    assert grading.check_student_edition(book, student, sources, [master]) == 2   # one solution, one function
    book, student, sources, master = _page(tmp_path / "leak", code_in_student=True)
    with pytest.raises(AssertionError, match="01_toy.toy_scratch"):
        grading.check_student_edition(book, student, sources, [master])
    book, student, sources, master = _page(tmp_path / "copy", code_in_student=False, sources_copy=True)
    with pytest.raises(AssertionError, match="copies of the book's sources"):
        grading.check_student_edition(book, student, sources, [master])
    # vacuous: the book itself does not show the function (e.g. it was renamed in the chapter only)
    book, student, sources, master = _page(tmp_path / "vacuous", code_in_student=False)
    (book / "page.html").write_text("<p>Because the couplings sum to one over the parents.</p>")
    with pytest.raises(AssertionError, match="vacuous"):
        grading.check_student_edition(book, student, sources, [master])
