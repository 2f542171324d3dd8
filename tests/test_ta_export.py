"""capslib.tools.ta_export: the hand-graded parts of submissions as HTML pages for teaching assistants."""
import base64
import zipfile

import nbformat
import pytest

from capslib.tools import ta_export

PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")).decode()


def _submission(answer: str, shout: str) -> nbformat.NotebookNode:
    v4 = nbformat.v4
    out_cell = v4.new_code_cell("plot()")
    out_cell.outputs = [v4.new_output("stream", name="stdout", text=f"printed {shout}\n"),
                        v4.new_output("display_data", data={"image/png": PNG, "text/plain": "<Figure>"}),
                        v4.new_output("display_data", data={"text/html": "<script>steal()</script>"})]
    return v4.new_notebook(cells=[
        v4.new_code_cell('import otter\ngrader = otter.Notebook("a.ipynb")'),
        v4.new_markdown_cell("## Question 1: autograded (2 points)\n\nWrite `f`."),
        v4.new_code_cell("def f():\n    return 1"),
        v4.new_code_cell('grader.check("q1")'),
        v4.new_markdown_cell("<!-- BEGIN QUESTION -->\n\n## Question 2: explain (2 points, graded by hand)\n\n"
                             "Why is $x^2 \\geq 0$?"),
        v4.new_markdown_cell(answer),
        v4.new_markdown_cell("<!-- END QUESTION -->\n\n<!-- BEGIN QUESTION -->\n\n## Question 3: measure it\n\nPlot it."),
        out_cell,
        v4.new_markdown_cell("<!-- END QUESTION -->"),
        v4.new_code_cell("grader.check_all()"),
    ])


def test_pages_hold_only_the_hand_graded_parts_and_nothing_that_runs(tmp_path):
    folder = tmp_path / "class"
    folder.mkdir()
    nbformat.write(_submission("Because squares <script>alert(1)</script> are *never* negative.", "ALPHA"),
                   folder / "alice.ipynb")
    zpath = tmp_path / "bob.zip"
    with zipfile.ZipFile(zpath, "w") as z:
        z.writestr("bob/a.ipynb", nbformat.writes(_submission("Bob's reason.", "BETA")))
    out = tmp_path / "ta"
    r = ta_export.export([folder, zpath], out)
    assert r["submissions"] == 2 and r["questions"] == 2
    names = sorted(p.name for p in out.iterdir())
    assert names == ["alice.html", "bob.html", "index.html", "question-1.html", "question-2.html"]
    q1, q2 = (out / "question-1.html").read_text(), (out / "question-2.html").read_text()
    assert "<title>Question 2: explain (2 points, graded by hand)</title>" in q1
    assert "Bob&#39;s reason." in q1 or "Bob's reason." in q1
    assert "<em>never</em>" in q1 and "$x^2" in q1                 # Markdown and TeX survive
    assert "<script>alert" not in q1 and "&lt;script&gt;alert(1)" in q1   # raw HTML shown as text
    assert q1.index("alice") < q1.index("bob")
    assert "printed ALPHA" in q2 and "printed BETA" in q2 and "data:image/png;base64," in q2
    assert "steal()" not in q2                                      # an HTML output never reaches the page
    alice = (out / "alice.html").read_text()
    for gone in ("autograded", "def f()", "grader.check", "otter.Notebook"):
        assert gone not in alice and gone not in q1 and gone not in q2, gone
    index = (out / "index.html").read_text()
    assert "href='question-2.html'" in index and "href='bob.html'" in index


def test_anonymous_names_and_key_and_clear_errors(tmp_path, capsys):
    a, b = tmp_path / "x.ipynb", tmp_path / "sub"
    b.mkdir()
    nbformat.write(_submission("A.", "A"), a)
    nbformat.write(_submission("B.", "B"), b / "x.ipynb")          # the same file name twice
    out = tmp_path / "ta"
    ta_export.export([a, b], out, anonymous=True)
    key = (out / "key.txt").read_text().splitlines()
    assert key == ["submission 1\tx", "submission 2\tx (2)"]
    assert "x (2)" not in (out / "question-1.html").read_text() and (out / "submission-2.html").exists()
    blank = tmp_path / "blank.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("nothing by hand")]), blank)
    with pytest.raises(ValueError, match="no hand-graded question"):
        ta_export.export([blank], tmp_path / "none")
    assert ta_export.main([str(tmp_path / "notes.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "not a notebook" in capsys.readouterr().err
