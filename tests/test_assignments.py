"""The otter-grader assignments under book/assignments/: each master generates a student version
without solutions, its tests pass on the master's solutions, and they fail on the blank stubs
(so no test is vacuous)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat
import otter.test_files as otter_test_files
import pytest

MASTERS = sorted((Path(__file__).resolve().parents[1] / "book" / "assignments").glob("*.ipynb"))


def _code_cells(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def _environment(notebook: Path) -> dict:
    """Run a generated notebook's own code (not the grader cells) in a fresh namespace."""
    env: dict = {"__name__": "__assignment__"}
    for src in _code_cells(notebook):
        if "otter" in src or "grader." in src:
            continue
        exec(compile(src, str(notebook), "exec"), env)
    return env


def _grade(tests_dir: Path, env: dict) -> dict[str, tuple[float, float, bool]]:
    out = {}
    for path in sorted(tests_dir.glob("q*.py")):
        tf = otter_test_files.ExceptionTestFile.from_file(str(path))
        tf.run(env)
        out[path.stem] = (tf.score, tf.possible, tf.passed_all)
    return out


@pytest.fixture(scope="module", params=MASTERS, ids=[m.stem for m in MASTERS])
def generated(request, tmp_path_factory):
    master = request.param
    out = tmp_path_factory.mktemp(master.stem)
    subprocess.run([sys.executable, "-m", "otter", "assign", str(master), str(out)],
                   check=True, capture_output=True, text=True)
    return master, out


def test_there_are_assignments():
    assert len(MASTERS) >= 2


def test_student_version_has_no_solutions(generated):
    master, out = generated
    student = out / "student" / master.name
    code = "\n".join(_code_cells(student))
    assert "SOLUTION" not in code
    stubs = [src for src in _code_cells(student) if src.startswith("def my_")]
    assert stubs and all(src.rstrip().endswith("...") for src in stubs)
    assert sorted(p.name for p in (out / "student" / "tests").glob("q*.py")) == \
        sorted(p.name for p in (out / "autograder" / "tests").glob("q*.py"))


def test_solutions_pass_every_test_hidden_included(generated):
    master, out = generated
    grades = _grade(out / "autograder" / "tests", _environment(out / "autograder" / master.name))
    assert grades and all(passed for _, _, passed in grades.values()), grades
    assert sum(score for score, _, _ in grades.values()) == sum(p for _, p, _ in grades.values())


def test_blank_stubs_fail_every_public_test(generated):
    master, out = generated
    env = _environment(out / "student" / master.name)
    public = _grade(out / "student" / "tests", env)
    assert public and all(score == 0 for score, _, _ in public.values()), public
    hidden = _grade(out / "autograder" / "tests", env)
    assert all(not passed for _, _, passed in hidden.values()), hidden


def test_grader_cells_report_all_passed_in_a_kernel(generated):
    """What a student sees: run the solved notebook in a real kernel, as they would."""
    master, out = generated
    path = out / "autograder" / master.name
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    last = nb.cells[[i for i, c in enumerate(nb.cells) if "grader.check_all()" in c.source][-1]]
    report = "".join(o.get("data", {}).get("text/plain", "") for o in last.outputs)
    questions = sorted(p.stem for p in (out / "autograder" / "tests").glob("q*.py"))
    for q in questions:
        assert f"{q} results: All test cases passed!" in report, report
