"""The otter-grader assignments under book/assignments/ (issue 16).

Every master is built as an instructor builds it (``capslib.tools.grading.build``: otter assign, the
autograder zip with capslib inside). For every master, in-process with the same guard the otter
plugin installs (``capslib.tools.grading.install``): the solutions earn every point (hidden tests
included), the blank student version earns none, and each delegation route -- for every student
function paired with a capslib callable -- earns nothing on its question, with the
DelegationError as the reason in every failed test, while a plain wrapper without the guard does earn
points (so the zero comes from the guard, not from a broken wrapper). Through otter's own grading of the zip (a
separate kernel, ``otter.api.grade_submission``) on assignment 6 only, to keep the time down:
the solved notebook gets full marks, the blank one zero, and three notebooks that together use
every delegation route get zero on each delegating question.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import otter.test_files as otter_test_files
import pytest

import capslib.tools.grading as grading

ROOT = Path(__file__).resolve().parents[1]
MASTERS = sorted((ROOT / "book" / "assignments").glob("*.ipynb"))
OTTER_GRADED = "a6_parse_tree_entropy"        # the assignment graded through otter's own runner
ROUTES = ("alias_before_install", "alias", "wrapper", "getattr", "import_inside", "importlib",
          "from_import", "reference", "reload")
OTTER_ROUTES = ("importlib", "reference", "reload")   # graded through otter's own runner too


# ----------------------------------------------------------------------------- helpers

def _code_cells(notebook: Path) -> list[str]:
    nb = nbformat.read(notebook, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _config(out: Path) -> dict:
    """The NoDelegation plugin's configuration in the generated autograder."""
    cfg = json.loads((out / "autograder" / "otter_config.json").read_text())
    for plugin in cfg.get("plugins", []):
        if isinstance(plugin, dict) and "capslib.tools.grading.NoDelegation" in plugin:
            return plugin["capslib.tools.grading.NoDelegation"]
    raise AssertionError(f"{out.name}: the master does not configure capslib.tools.grading.NoDelegation")


def _split(name: str) -> tuple[str, list[str]]:
    """'capslib.rem.quantize' -> ('capslib.rem', ['quantize']): the longest importable prefix."""
    import importlib
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        return ".".join(parts[:k]), parts[k:]
    raise ValueError(name)


def _route_source(route: str, fn: str, target: str) -> str:
    """A definition of the student function ``fn`` that delegates to ``target`` by ``route``."""
    module, attrs = _split(target)
    chain = "".join(f".{a}" for a in attrs)
    head = f"def {fn}(*args, **kwargs):\n"
    if route in ("alias", "alias_before_install"):
        pre = f"import {module}\n_alias_{fn} = {module}{chain}\n" if route == "alias" else ""
        return pre + head + f"    return _alias_{fn}(*args, **kwargs)\n"
    if route == "wrapper":
        return f"import {module}\n" + head + f"    return {module}{chain}(*args, **kwargs)\n"
    if route == "getattr":
        get = module
        for a in attrs:
            get = f"getattr({get}, {a!r})"
        return f"import {module}\n" + head + f"    return {get}(*args, **kwargs)\n"
    if route == "import_inside":
        return head + f"    import {module}\n    return {module}{chain}(*args, **kwargs)\n"
    if route == "importlib":
        rest = "".join(f".{a}" for a in attrs[1:])
        return ("import importlib\n" + head +
                f"    return getattr(importlib.import_module({module!r}), {attrs[0]!r}){rest}(*args, **kwargs)\n")
    if route == "from_import":
        rest = "".join(f".{a}" for a in attrs[1:])
        return f"from {module} import {attrs[0]} as _from_{fn}\n" + head + f"    return _from_{fn}{rest}(*args, **kwargs)\n"
    if route == "reference":
        return "import capslib.tools.grading\n" + head + \
            f"    return capslib.tools.grading.reference({target!r})(*args, **kwargs)\n"
    if route == "reload":
        defining = grading.resolve(target).__module__
        return (f"import importlib, sys, {module}\n" + head +
                f"    importlib.reload(sys.modules[{defining!r}])\n"
                f"    return {module}{chain}(*args, **kwargs)\n")
    raise ValueError(route)


def _exec_cells(cells: list[str], env: dict, label: str) -> None:
    """Run submission cells as a kernel would with errors allowed: a failing cell is skipped."""
    for i, src in enumerate(cells):
        if "grader" in src or "otter" in src:
            continue
        try:
            exec(compile(src, f"<{label} cell {i}>", "exec"), env)
        except Exception:
            pass


def _grade(tests_dir: Path, env: dict, only: set[str] | None = None) -> dict[str, dict]:
    out = {}
    for path in sorted(tests_dir.glob("q*.py")):
        if only is not None and path.stem not in only:
            continue
        tf = otter_test_files.ExceptionTestFile.from_file(str(path.resolve()))
        tf.run(env)
        out[path.stem] = {"score": tf.score, "possible": tf.possible,
                          "messages": [r.message for r in tf.test_case_results if not r.passed]}
    return out


def _questions_using(tests_dir: Path, fn: str) -> set[str]:
    return {p.stem for p in tests_dir.glob("q*.py") if f"({fn})" in p.read_text() or f"{fn}," in p.read_text()}


@pytest.fixture(autouse=True)
def _quiet_matplotlib(monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, "show", lambda *a, **k: None)
    yield
    plt.close("all")


@pytest.fixture(scope="module", params=MASTERS, ids=[m.stem for m in MASTERS])
def built(request, tmp_path_factory):
    master = request.param
    out = tmp_path_factory.mktemp(master.stem)
    zip_path = grading.build(master, out)
    return master, out, zip_path


@pytest.fixture(scope="module")
def solved_env(built):
    """The solved notebook's namespace, its cells run with the assignment's guard installed."""
    master, out, _ = built
    cfg = _config(out)
    tests_dir = out / "autograder" / "tests"
    env: dict = {"__name__": "__submission__"}
    with grading.guarded(cfg["guard"], tests_dir=str(tests_dir)):
        _exec_cells(_code_cells(out / "autograder" / master.name), env, "solution")
    return env


# ----------------------------------------------------------------------------- every master

def test_there_are_assignments():
    assert len(MASTERS) >= 3


def test_student_version_has_no_solutions(built):
    master, out, zip_path = built
    student = out / "student" / master.name
    code = "\n".join(_code_cells(student))
    assert "BEGIN SOLUTION" not in code and "END SOLUTION" not in code
    stubs = [src for src in _code_cells(student) if src.lstrip().startswith("def my_")]
    assert stubs and all(src.rstrip().endswith("...") for src in stubs)
    # no hidden test reaches the student's folder, and no written answer either
    public = {p.name for p in (out / "student" / "tests").glob("q*.py")}
    assert public == {p.name for p in (out / "autograder" / "tests").glob("q*.py")}
    for p in (out / "student" / "tests").glob("q*.py"):
        assert "hidden=True" not in p.read_text()
    solved_md = [c.source for c in nbformat.read(out / "autograder" / master.name, 4).cells
                 if c.cell_type == "markdown"]
    student_md = "\n".join(c.source for c in nbformat.read(student, 4).cells if c.cell_type == "markdown")
    answers = [s for s in solved_md if s not in student_md]
    assert all(a[:60] not in student_md for a in answers)


def test_zip_is_complete(built):
    import zipfile
    master, out, zip_path = built
    names = set(zipfile.ZipFile(zip_path).namelist())
    assert {"run_autograder", "setup.sh", "otter_config.json", "environment.yml",
            "capslib/tools/__init__.py", "capslib/tools/grading.py", "files/capslib/tools/grading.py"} <= names
    assert {f"tests/{p.name}" for p in (out / "autograder" / "tests").glob("q*.py")} <= names


def test_tests_take_expected_values_only_from_reference(built):
    """A test that called capslib directly would fail under the guard for every submission."""
    master, out, _ = built
    guarded_leaves = {n.rsplit(".", 1)[-1] for n in _config(out)["guard"]}
    for p in (out / "autograder" / "tests").glob("q*.py"):
        src = p.read_text()
        for leaf in guarded_leaves:
            for prefix in ("capslib.", "rem.", "routing.", "ops."):
                assert f"{prefix}{leaf}(" not in src, f"{p.name} calls {leaf} directly; use reference()"


def test_solutions_earn_every_point(built, solved_env, monkeypatch):
    """The master's solutions earn every point, with torch's comparisons and with the ones the grading process
    uses (through numpy: capslib.tools.grading_fresh.assert_close_numpy and its siblings)."""
    import torch

    from capslib.tools import grading_fresh

    master, out, _ = built
    tests_dir = out / "autograder" / "tests"
    with grading.guarded(_config(out)["guard"], tests_dir=str(tests_dir)):
        grades = _grade(tests_dir, dict(solved_env))
    assert grades and all(g["score"] == g["possible"] > 0 for g in grades.values()), grades
    monkeypatch.setattr(torch.testing, "assert_close", grading_fresh.assert_close_numpy)
    monkeypatch.setattr(torch, "allclose", grading_fresh.allclose_numpy)
    monkeypatch.setattr(torch, "equal", grading_fresh.equal_numpy)
    with grading.guarded(_config(out)["guard"], tests_dir=str(tests_dir)):
        through_numpy = _grade(tests_dir, dict(solved_env))
    assert through_numpy == grades, through_numpy


def test_blank_student_version_earns_nothing(built):
    master, out, _ = built
    tests_dir = out / "autograder" / "tests"
    env: dict = {"__name__": "__submission__"}
    with grading.guarded(_config(out)["guard"], tests_dir=str(tests_dir)):
        _exec_cells(_code_cells(out / "student" / master.name), env, "blank")
        grades = _grade(tests_dir, env)
    assert grades and all(g["score"] == 0 for g in grades.values()), grades


def test_every_delegation_route_earns_nothing(built, solved_env):
    master, out, _ = built
    cfg = _config(out)
    tests_dir = out / "autograder" / "tests"
    pairs = {fn: target for fn, target in grading.delegates(cfg).items() if fn in solved_env}
    assert pairs, f"{master.stem}: no student function is paired with a guarded capslib callable"
    for fn, target in pairs.items():
        questions = _questions_using(tests_dir, fn)
        assert questions, f"no test calls {fn}"
        for route in ROUTES:
            src = _route_source(route, fn, target)
            env = dict(solved_env)
            if route == "alias_before_install":
                env[f"_alias_{fn}"] = grading.resolve(target)   # taken before the stub exists
            with grading.guarded(cfg["guard"], tests_dir=str(tests_dir)):
                exec(compile(src, f"<route {route}>", "exec"), env)
                grades = _grade(tests_dir, env, only=questions)
            for q, g in grades.items():
                assert g["score"] == 0, (fn, route, q, g)
                assert all("DelegationError" in m for m in g["messages"]), (fn, route, q, g["messages"])
            if route != "wrapper":
                continue  # one control per function: the failure messages above already name the guard
            control = dict(solved_env)
            exec(compile(src, f"<control {route}>", "exec"), control)
            unguarded = _grade(tests_dir, control, only=questions)
            assert sum(g["score"] for g in unguarded.values()) > 0, \
                f"without the guard, {route} delegation of {fn} should earn points: {unguarded}"


# ----------------------------------------------------------------------------- secret inputs, strict errors

def _case_results(tests_dir: Path, env: dict) -> dict[str, bool]:
    """Test function name -> passed, over every test file of the assignment."""
    out = {}
    for path in sorted(tests_dir.glob("q*.py")):
        tf = otter_test_files.ExceptionTestFile.from_file(str(path.resolve()))
        tf.run(env)
        out.update({r.test_case.body.test_func.__name__: r.passed for r in tf.test_case_results})
    return out


def _hidden_tests(tests_dir: Path) -> dict[str, str]:
    """Hidden test function name -> its source."""
    import ast
    out = {}
    for path in tests_dir.glob("q*.py"):
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Call) and any(k.arg == "hidden" and getattr(k.value, "value", None) is True
                                                    for k in d.keywords) for d in node.decorator_list):
                out[node.name] = ast.get_source_segment(src, node)
    return out


def _graded_functions(env: dict) -> list[str]:
    """The functions the student writes (the masters name them ``my_...``)."""
    return [k for k, v in env.items() if k.startswith("my_") and callable(v)]


def _tests_calling(tests_dir: Path, text: str) -> set[str]:
    """The test functions whose source contains ``text``."""
    import ast
    out = set()
    for path in tests_dir.glob("q*.py"):
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") \
                    and text in ast.get_source_segment(src, node):
                out.add(node.name)
    return out


def test_zip_holds_a_fresh_secret_and_the_student_folder_does_not(built):
    import re
    import zipfile
    master, out, zip_path = built
    cfg = json.loads(zipfile.ZipFile(zip_path).read("otter_config.json"))
    entry = next(p[grading._PLUGIN] for p in cfg["plugins"] if isinstance(p, dict) and grading._PLUGIN in p)
    secret = entry["secret"]
    assert re.fullmatch(r"[0-9a-f]{32}", secret), secret       # build() without a secret draws one
    assert "book_answers" not in entry
    for f in (out / "student").rglob("*"):
        if f.is_file():
            assert secret not in f.read_text(errors="replace"), f
    # every hidden test that draws random inputs draws them from the secret, never from a fixed seed
    # (the public tests' inputs are known to the student anyway)
    hidden = _hidden_tests(out / "autograder" / "tests")
    assert hidden
    for test, src in hidden.items():
        assert "manual_seed" not in src and "torch.Generator(" not in src, test
        if any(f"torch.{r}(" in src for r in ("rand", "randn", "randint")):
            assert "hidden_generator()" in src, test


def test_grading_secret_reaches_the_zip(tmp_path, monkeypatch):
    import zipfile
    master = next(m for m in MASTERS if m.stem == OTTER_GRADED)
    monkeypatch.setenv("GRADING_SECRET", "the instructor's secret")
    assert grading._main(["build", str(master), "--out", str(tmp_path)]) == 0
    text = zipfile.ZipFile(grading.autograder_zip(tmp_path / master.stem)).read("otter_config.json").decode()
    assert "the instructor's secret" in text
    assert "the instructor's secret" not in (tmp_path / master.stem / "student" / master.name).read_text()


@pytest.fixture(scope="module")
def solved_master(tmp_path_factory):
    """name -> (guard names, tests folder, a copy of the solved notebook's namespace), built once per master."""
    cache: dict = {}

    def get(name: str) -> tuple[list[str], Path, dict]:
        if name not in cache:
            master = next(m for m in MASTERS if m.stem == name)
            out = tmp_path_factory.mktemp(f"solved_{name}")
            grading.build(master, out)
            cfg = _config(out)
            tests_dir = out / "autograder" / "tests"
            env: dict = {"__name__": "__submission__"}
            with grading.guarded(cfg["guard"], tests_dir=str(tests_dir)):
                _exec_cells(_code_cells(out / "autograder" / master.name), env, "solution")
            cache[name] = (cfg["guard"], tests_dir, env)
        guard, tests_dir, env = cache[name]
        return guard, tests_dir, dict(env)
    return get


def _call_key(fn: str, args: tuple, kwargs: dict) -> tuple:
    import torch

    def one(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", str(v.dtype), tuple(v.shape), v.detach().cpu().contiguous().numpy().tobytes())
        if isinstance(v, torch.nn.Module):
            return ("module", tuple(one(t) for t in v.state_dict().values()))
        return ("value", repr(v))
    return (fn, tuple(one(a) for a in args), tuple((k, one(v)) for k, v in sorted(kwargs.items())))


@pytest.mark.parametrize("name", ["a3_soft_routing_gradients", "a6_parse_tree_entropy",
                                  "a7_products_of_expert_capsules"])
def test_a_recorded_table_does_not_replay(name, solved_master):
    """Issue 35: hidden inputs came from fixed seeds or the notebook's seeded generator, so a table of
    inputs and outputs recorded in one grading replayed in the next. The table is recorded from the
    master under one secret; under the same secret it replays to full marks (the hole, as it was), under
    another every hidden test that draws its inputs from the secret fails."""
    guard, tests_dir, solved = solved_master(name)
    fns = _graded_functions(solved)
    table: dict = {}

    def recorder(fn, f):
        def record(*args, **kwargs):
            try:
                result = ("return", f(*args, **kwargs))
            except ValueError as err:
                result = ("raise", err)
            table[_call_key(fn, args, kwargs)] = result
            if result[0] == "raise":
                raise result[1]
            return result[1]
        return record

    def replayer(fn):
        def replay(*args, **kwargs):
            how, value = table[_call_key(fn, args, kwargs)]   # an input never seen: KeyError
            if how == "raise":
                raise value
            return value
        return replay

    recording = dict(solved, **{fn: recorder(fn, solved[fn]) for fn in fns})
    with grading.guarded(guard, tests_dir=str(tests_dir), secret="term 1"):
        assert all(_case_results(tests_dir, recording).values())
    replaying = dict(solved, **{fn: replayer(fn) for fn in fns})
    with grading.guarded(guard, tests_dir=str(tests_dir), secret="term 1"):
        same = _case_results(tests_dir, replaying)
    with grading.guarded(guard, tests_dir=str(tests_dir), secret="term 2"):
        other = _case_results(tests_dir, replaying)
    assert all(same.values()), same
    drawn = _tests_calling(tests_dir, "hidden_generator(")
    assert drawn, "no hidden test draws from the secret"
    failed = {t for t, ok in other.items() if not ok}
    # an error test draws its (valid) inputs from the secret too, but the replayed table raised for them:
    # only the tests that compare values are what a table would have to answer
    assert drawn - failed <= _tests_calling(tests_dir, "assert_error_names(") | _tests_calling(tests_dir, "must raise"), \
        sorted(drawn - failed)
    assert failed <= drawn, sorted(failed - drawn)   # the public tests' known inputs still replay


@pytest.mark.parametrize("name", ["a3_soft_routing_gradients", "a4_coupling_gradient", "a5_em_routing",
                                  "a7_products_of_expert_capsules"])
def test_an_error_naming_every_argument_fails_the_error_tests(name, solved_master):
    """Issue 35: the error tests only looked for the bad argument's name in the message, so a
    ``ValueError`` that named every argument passed. Each graded function of the master is wrapped to
    re-raise its ``ValueError`` naming all its arguments: every error test fails, every other test passes."""
    import inspect
    guard, tests_dir, env = solved_master(name)

    def vague(f):
        names = ", ".join(inspect.signature(f).parameters)

        def g(*args, **kwargs):
            try:
                return f(*args, **kwargs)
            except ValueError:
                raise ValueError(f"one of {names} is wrong") from None
        return g

    for fn in _graded_functions(env):
        env[fn] = vague(env[fn])
    with grading.guarded(guard, tests_dir=str(tests_dir)):
        results = _case_results(tests_dir, env)
    strict = _tests_calling(tests_dir, "assert_error_names(")
    assert strict, f"{name} has no strict error test"
    assert {t for t, ok in results.items() if not ok} == strict, results


def test_assert_error_names_is_strict():
    def f(u_hat, grad_v, iterations=3):
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1; got {iterations}")
        if u_hat is None:
            raise ValueError("u_hat or grad_v is wrong")
        if grad_v is None:
            raise ValueError("grad_vs are bad")
        return 0
    params = ("u_hat", "grad_v", "iterations")
    grading.assert_error_names(f, "iterations", params, 1, 2, iterations=0)
    with pytest.raises(AssertionError, match="no other argument; it also names \\['grad_v'\\]"):
        grading.assert_error_names(f, "u_hat", params, None, 2)
    with pytest.raises(AssertionError, match="should name 'grad_v'"):   # 'grad_vs' is not 'grad_v'
        grading.assert_error_names(f, "grad_v", params, 1, None)
    with pytest.raises(AssertionError, match="no ValueError for a bad u_hat"):
        grading.assert_error_names(f, "u_hat", params, 1, 2)
    with pytest.raises(ValueError, match="one of the arguments"):
        grading.assert_error_names(f, "x", params, 1, 2)


def test_an_argument_named_like_an_english_word_counts_only_quoted():
    def m_step(V, a, message):
        raise ValueError(message)
    params = ("V", "a", "message")
    grading.assert_error_names(m_step, "V", params, 1, 2, "V holds a NaN")          # the article names nothing
    grading.assert_error_names(m_step, "a", params, 1, 2, "`a` holds a NaN")
    grading.assert_error_names(m_step, "a", params, 1, 2, "'a' must be finite")
    with pytest.raises(AssertionError, match="should name 'a'"):
        grading.assert_error_names(m_step, "a", params, 1, 2, "a holds NaN")        # unquoted: read as the article
    with pytest.raises(AssertionError, match="it also names \\['a'\\]"):
        grading.assert_error_names(m_step, "V", params, 1, 2, "V and `a` hold NaN")


def test_hidden_generator_is_for_test_files_and_follows_the_secret():
    import torch
    with pytest.raises(grading.DelegationError):
        exec(compile("capslib_grading.hidden_generator('t')", "<submission cell>", "exec"),
             {"capslib_grading": grading})
    with grading.guarded(["capslib.rem.quantize"], secret="a"):
        a1, a2 = grading.hidden_generator("t"), grading.hidden_generator("t")
        other_label = grading.hidden_generator("u")
    with grading.guarded(["capslib.rem.quantize"], secret="b"):
        b = grading.hidden_generator("t")
    draw = lambda g: torch.rand(4, generator=g)
    x = draw(a1)
    assert torch.equal(x, draw(a2))
    assert not torch.equal(x, draw(b)) and not torch.equal(x, draw(other_label))
    torch.manual_seed(0)   # the notebook's seed does not reach it
    with grading.guarded(["capslib.rem.quantize"], secret="a"):
        assert torch.equal(draw(grading.hidden_generator("t")), x)


# ----------------------------------------------------------------------------- through otter

def _notebook_with(notebook: Path, replacements: dict[str, str], dest: Path) -> Path:
    nb = nbformat.read(notebook, as_version=4)
    for fn, src in replacements.items():
        cells = [c for c in nb.cells if c.cell_type == "code" and c.source.lstrip().startswith(f"def {fn}(")]
        assert len(cells) == 1, f"one cell must define {fn}"
        cells[0].source = src
    nbformat.write(nb, dest)
    return dest


# issue 35's tampers of the kernel: otter's call_func replaced by a no-op, the test files the kernel's
# checker reads overwritten, a fake question written; none is a construct the static scan flags
_KERNEL_TAMPERS = """\
import pathlib
from otter.test_files import exception_test as _et
getattr(_et, "test_case").call_func = lambda self, env: None
for _p in pathlib.Path("tests").glob("q*.py"):
    _p.write_text("from otter.test_files import test_case\\n@test_case(points=None)\\ndef test_ok():\\n    pass\\n")
pathlib.Path("tests", "q99.py").write_text(pathlib.Path("tests", "q1.py").read_text())
"""


_GRADE_SCRIPT = """
import json, sys, otter.api
r = otter.api.grade_submission(sys.argv[1], sys.argv[2], quiet=True)
print("RESULTS" + json.dumps({k: {"score": v.score, "possible": v.possible,
      "messages": [t.message for t in v.test_case_results if not t.passed]} for k, v in r.results.items()}))
"""


def _otter_grade(submission: Path, zip_path: Path) -> dict:
    env = dict(os.environ, MPLBACKEND="Agg")
    # once more when the grading kernel died because another process took its port as it started (make test
    # runs notebook kernels side by side; seen once in a fresh clone: "Address already in use")
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _GRADE_SCRIPT, str(submission), str(zip_path)],
                           capture_output=True, text=True, cwd=submission.parent, env=env, timeout=300)
        if p.returncode == 0 or "Address already in use" not in p.stderr:
            break
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULTS")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS"):])


@pytest.fixture(scope="module")
def otter_built(tmp_path_factory):
    """The assignment graded through otter's runner, built once: (master, out, zip)."""
    master = next(m for m in MASTERS if m.stem == OTTER_GRADED)
    out = tmp_path_factory.mktemp("otter_built")
    return master, out, grading.build(master, out, variants=1 + len(grading.variants_of(master)))


def test_otter_grades_the_zip(tmp_path, otter_built):
    master, out, zip_path = otter_built
    cfg = _config(out)
    solved = out / "autograder" / master.name
    pairs = grading.delegates(cfg)
    fns = sorted(fn for fn in pairs if any(c.lstrip().startswith(f"def {fn}(") for c in _code_cells(solved)))
    # Through otter's runner, one notebook whose graded functions each take another route (every route
    # is graded in-process for every master by test_every_delegation_route_earns_nothing; here the
    # routes that reach furthest: importing by name, asking the reference for the library, reloading
    # the module). Each otter grading costs about 20 s of CPU, mostly a kernel importing torch.
    routes = list(OTTER_ROUTES[:len(fns)])
    plans: list[dict[str, str]] = []
    for i, route in enumerate(routes):
        k, fn = divmod(i, len(fns))
        if k == len(plans):
            plans.append({})
        plans[k][fns[fn]] = route
    submissions = {"solved": solved, "blank": out / "student" / master.name}
    for k, plan in enumerate(plans):
        d = tmp_path / f"routes{k}"
        d.mkdir()
        submissions[f"routes{k}"] = _notebook_with(
            solved, {fn: _route_source(r, fn, pairs[fn]) for fn, r in plan.items()}, d / master.name)
    for name in ("solved", "blank"):
        d = tmp_path / name
        d.mkdir()
        submissions[name] = d / master.name
        nb = nbformat.read(solved if name == "solved" else out / "student" / master.name, 4)
        if name == "blank":   # the blank notebook with issue 35's kernel tampers (see _KERNEL_TAMPERS)
            nb.cells.append(nbformat.v4.new_code_cell(_KERNEL_TAMPERS))
        nbformat.write(nb, submissions[name])
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(submissions, pool.map(lambda p: _otter_grade(p, zip_path), submissions.values())))
    solved_r, blank_r = results["solved"], results["blank"]
    assert solved_r and all(v["score"] == v["possible"] > 0 for v in solved_r.values()), solved_r
    # the tampers pass every test in the kernel (the control below) and the static scan does not see
    # them: the zeros come from the fresh-process grading, which also drops the fake q99
    assert set(blank_r) == set(solved_r) and all(v["score"] == 0 for v in blank_r.values()), blank_r
    assert not any("static scan" in m for v in blank_r.values() for m in v["messages"]), blank_r
    from capslib.tools.grading_scan import scan
    assert scan(_KERNEL_TAMPERS) == []
    from otter.test_files import exception_test
    saved = exception_test.test_case.call_func
    try:
        exec(compile(_KERNEL_TAMPERS.split("for _p")[0], "<tamper control>", "exec"), {})
        tf = otter_test_files.ExceptionTestFile.from_file(str(out / "autograder" / "tests" / "q1.py"))
        tf.run({})
        assert tf.score == tf.possible > 0   # in the kernel, a blank notebook would have had every point
    finally:
        exception_test.test_case.call_func = saved
    tests_dir = out / "autograder" / "tests"
    for k, plan in enumerate(plans):
        r = results[f"routes{k}"]
        for fn, route in plan.items():
            for q in _questions_using(tests_dir, fn):
                assert r[q]["score"] == 0, (route, fn, q, r[q])
                # the run-time guard's failures (the static scan adds its own entry: see the next test)
                guard_msgs = [m for m in r[q]["messages"] if not m.startswith(f"{q} scores 0: the static scan")]
                assert guard_msgs and all("DelegationError" in m for m in guard_msgs), (route, fn, q, r[q]["messages"])


def test_otter_zeroes_what_the_static_scan_flags(tmp_path, otter_built):
    """The master with one added line, ``import capslib as _c`` inside one graded function (harmless at
    run time: nothing guarded is called): the static scan zeroes the questions whose tests use that
    function, with the finding in their report, and only those (the unmodified master's full marks are
    checked on the same zip in test_otter_grades_the_zip)."""
    master, out, zip_path = otter_built
    solved = out / "autograder" / master.name
    tests_dir = out / "autograder" / "tests"
    fns = sorted(fn for fn in grading.delegates(_config(out))
                 if any(c.lstrip().startswith(f"def {fn}(") for c in _code_cells(solved)))
    fn = next(f for f in fns if _questions_using(tests_dir, f) != {p.stem for p in tests_dir.glob("q*.py")})
    nb = nbformat.read(solved, 4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.lstrip().startswith(f"def {fn}("))
    head, body = cell.source.split("\n", 1)
    cell.source = f"{head}\n    import capslib as _c\n{body}"
    d = tmp_path / "flagged"
    d.mkdir()
    nbformat.write(nb, d / master.name)
    r = _otter_grade(d / master.name, zip_path)
    hit = _questions_using(tests_dir, fn)
    assert hit and set(r) - hit, (fn, hit, r)
    for q in hit:
        assert r[q]["possible"] > 0 and r[q]["score"] == 0, (q, r[q])
        assert any("static scan" in m and "imports capslib" in m and fn in m for m in r[q]["messages"]), r[q]
    for q in set(r) - hit:
        assert r[q]["score"] == r[q]["possible"] > 0 and not r[q]["messages"], (q, r[q])


# ----------------------------------------------------------------------------- tampering with the grader

_SUBCLASS_EQUAL = """
import torch
class _AlwaysEqual(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.equal, torch.allclose):
            return True
        return super().__torch_function__(func, types, args, kwargs or {})
def my_quantize(c, levels=11):
    return torch.zeros(c.shape, dtype=torch.long).as_subclass(_AlwaysEqual)
"""
_PATCHED_COMPARISONS = """
import torch
def my_class_codes(c, lengths, levels=11):
    setattr(torch, "equal", lambda a, b: True)
    setattr(torch.testing, "assert_close", lambda *a, **k: None)
    return torch.zeros(c.shape[:2], dtype=torch.long), torch.zeros(c.shape[0], dtype=torch.long)
"""
_FORGED_FILENAME = """
def my_parse_tree_entropy(codes, predicted, num_classes):
    ns = {}
    exec(compile("import capslib.tools.grading as g\\n"
                 "def f(*a):\\n    return g.reference('capslib.rem.parse_tree_entropy')(*a)\\n", "<frozen x>", "exec"), ns)
    return ns["f"](codes, predicted, num_classes)
"""
_SECOND_COPY = """
def my_count_parse_trees(codes, predicted, num_classes):
    import importlib.util, pathlib, torch
    import capslib
    spec = importlib.util.spec_from_file_location("capslib.rem_copy", pathlib.Path(capslib.__file__).with_name("rem.py"))
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy.count_parse_trees(codes, predicted, num_classes)
"""
_TAMPERS = {"my_quantize": _SUBCLASS_EQUAL, "my_class_codes": _PATCHED_COMPARISONS,
            "my_parse_tree_entropy": _FORGED_FILENAME, "my_count_parse_trees": _SECOND_COPY}


def test_tampers_score_nothing_in_the_fresh_process(otter_built):
    """Issue 35's tampers that a graded function can do while a test runs it, one per question of the
    assignment graded through otter: a tensor subclass whose ``__torch_function__`` says "equal" (q1),
    comparisons patched from inside the function (q2), code compiled under the forged file name
    ``"<frozen x>"`` that asks :func:`reference` for the answer (q3), a second copy of ``capslib.rem``
    loaded from its file under another name (q4). Graded as otter grades, in the submission's own
    namespace, q1, q2 and q4 earn points (the control); graded in the fresh process (what the zip's
    plugin does) all four score 0. The forged name is refused by the guard in both. (The honest master
    keeps its marks through the same plugin in test_otter_grades_the_zip.)"""
    from capslib.tools.grading_fresh import grade
    from capslib.tools.grading_plugin import _read_tests

    master, out, _ = otter_built
    cfg = _config(out)
    tests_dir = out / "autograder" / "tests"
    solved = _code_cells(out / "autograder" / master.name)
    cells = [next((t for fn, t in _TAMPERS.items() if c.lstrip().startswith(f"def {fn}(")), c) for c in solved]
    assert sum(c in _TAMPERS.values() for c in cells) == 4
    question = {"my_quantize": "q1", "my_class_codes": "q2", "my_parse_tree_entropy": "q3",
                "my_count_parse_trees": "q4"}
    assert all(_questions_using(tests_dir, fn) >= {q} for fn, q in question.items())

    import torch
    saved = (torch.equal, torch.testing.assert_close)
    env: dict = {"__name__": "__submission__"}
    try:
        with grading.guarded(cfg["guard"], tests_dir=str(tests_dir)):
            _exec_cells(cells, env, "tampered")
            in_kernel = _grade(tests_dir, env)
    finally:
        torch.equal, torch.testing.assert_close = saved
    assert all(in_kernel[q]["score"] > 0 for q in ("q1", "q2", "q4")), in_kernel   # the holes, as they were
    assert in_kernel["q3"]["score"] == 0 and all("DelegationError" in m for m in in_kernel["q3"]["messages"])

    fresh = grade(cells, _read_tests(tests_dir), cfg["guard"], "a secret")
    passed = {q: [c["passed"] for c in r["cases"]] for q, r in fresh.items()}
    for q in ("q1", "q2", "q3", "q4"):
        assert not any(passed[q]), (q, fresh[q])
    assert any("subclass of torch.Tensor" in c["message"] for c in fresh["q1"]["cases"]), fresh["q1"]
    assert all("DelegationError" in c["message"] for c in fresh["q3"]["cases"]), fresh["q3"]
    assert all("second copy of capslib" in c["message"] for c in fresh["q4"]["cases"]), fresh["q4"]


def test_the_fresh_process_wrapper_allows_nested_graded_calls_and_catches_a_copy():
    """In process (fast): the wrapper the fresh process puts around each graded function lets one graded
    function call another (a5's em_routing calls its M-step), restores a patched comparison, and fails
    a call that runs a guarded function from a second copy of its module."""
    import importlib.util
    import torch
    import capslib
    from capslib.tools.grading_fresh import _checked, _copy_watch, _protected

    with grading.guarded(["capslib.rem.quantize"]):
        snapshot = _protected()
        watch = _copy_watch()
        env: dict = {}
        exec(compile("import torch\n"
                     "def my_inner(x):\n    return x + 1\n"
                     "def my_outer(x):\n    torch.equal = lambda a, b: True\n    return my_inner(x) * 2\n",
                     "<submission>", "exec"), env)
        for name in ("my_inner", "my_outer"):
            env[name] = _checked(env[name], name, snapshot, watch)
        real_equal = snapshot[[m for m, _, _ in snapshot].index(torch)][1]["equal"]
        assert torch.equal(env["my_outer"](torch.ones(2)), torch.full((2,), 4.0))
        assert torch.equal is real_equal and sys.getprofile() is None
        spec = importlib.util.spec_from_file_location("capslib.rem_copy", Path(capslib.__file__).with_name("rem.py"))
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
        sneaky = _checked(lambda c: copy.quantize(c, 3), "my_quantize", snapshot, watch)
        with pytest.raises(grading.DelegationError, match="second copy of capslib"):
            sneaky(torch.rand(4))
        assert sys.getprofile() is None


def test_extract_takes_only_what_the_tests_reach():
    from capslib.tools.grading_fresh import extract, test_parameters
    cells = ["import torch\nimport matplotlib.pyplot as plt\n",
             "SCALE = 2.0\nG = torch.autograd.grad\n",
             "def _helper(x):\n    return SCALE * x\n\ndef my_f(x):\n    return _helper(x)\n",
             "import otter\notter.test_files.exception_test.test_case.call_func = None\nplt.plot([1])\n",
             "def unrelated():\n    pass\n", "this is not python(\n"]
    src = extract(cells, ["my_f"])
    assert "def my_f" in src and "def _helper" in src and "SCALE = 2.0" in src and "import torch" not in src
    assert "call_func" not in src and "plt" not in src and "unrelated" not in src and "G =" not in src
    assert "import torch" in extract(cells, ["G"])
    assert test_parameters({"q1": "def test_a(my_f, env):\n    pass\ndef helper(x):\n    pass\n"}) == ["my_f"]


# ----------------------------------------------------------------------------- the student edition check

def test_student_edition_check_catches_a_leak_and_a_vacuous_build(tmp_path):
    src = tmp_path / "page.md"
    src.write_text("# Page\n\n:::{exercise}\n:label: ex-a\nWhy?\n:::\n\n:::{solution} ex-a\n:class: dropdown\n"
                   "Because the couplings sum to one over the parents, $c_{ij}$ is a distribution.\n:::\n")
    book, student, empty = tmp_path / "book", tmp_path / "student", tmp_path / "empty"
    for d in (book, student, empty):
        d.mkdir()
    (book / "page.html").write_text("<p>Why?</p><p>Because the couplings sum to one over the "
                                    "<em>parents</em>, \\(c_{ij}\\) is a distribution.</p>")
    (student / "page.html").write_text("<p>Why?</p>")
    (empty / "page.html").write_text("<p>Nothing here.</p>")
    assert grading.check_student_edition(book, student, [src]) == 1
    with pytest.raises(AssertionError, match="found in the student edition"):
        grading.check_student_edition(book, book, [src])
    with pytest.raises(AssertionError, match="vacuous"):
        grading.check_student_edition(empty, student, [src])


def test_assignments_page_lists_every_master_with_its_points():
    """book/assignments.md's table names each master with its questions' points, in order."""
    import re
    page = (ROOT / "book" / "assignments.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(a\d_\w+)` \|[^|]*\|(.*)\|\s*$", page, re.M)}
    for master in MASTERS:
        assert master.stem in rows, f"book/assignments.md has no row for {master.stem}"
        listed = [int(p) for p in re.findall(r"\((\d+)\)\*?(?:;|\s*$)", rows[master.stem].strip())]
        nb = nbformat.read(master, as_version=4)
        points = [int(re.search(r"points: (\d+)", c.source).group(1)) for c in nb.cells
                  if c.cell_type == "raw" and c.source.startswith("# BEGIN QUESTION")]
        assert listed == points, (master.stem, listed, points)


# ----------------------------------------------------------------------------- per-student variants

VARIANT_MASTERS = [m for m in MASTERS if grading.variants_of(m)]


def test_some_assignments_declare_variants_and_bad_ones_are_refused(tmp_path):
    assert {m.stem for m in VARIANT_MASTERS} == {m.stem for m in MASTERS}    # every assignment has one
    master = VARIANT_MASTERS[0]
    with pytest.raises(ValueError, match="variant"):
        grading.variant_master(master, len(grading.variants_of(master)) + 1, tmp_path / "x.ipynb")
    with pytest.raises(ValueError, match="asked for"):
        grading.build(master, tmp_path / "out", variants=2 + len(grading.variants_of(master)))
    # a replacement that no longer matches the master is an error, not a silent copy of the master
    nb = nbformat.read(master, as_version=4)
    nb.cells[0].source = nb.cells[0].source.replace("replace:\n", "replace:\n            - [\"no such text\", \"x\"]\n", 1)
    stale = tmp_path / master.name
    nbformat.write(nb, stale)
    with pytest.raises(ValueError, match="occurs in no cell"):
        grading.variant_master(stale, 1, tmp_path / "v1.ipynb")


@pytest.mark.parametrize("master", VARIANT_MASTERS, ids=[m.stem for m in VARIANT_MASTERS])
def test_each_variant_is_answered_by_its_own_solution_and_not_by_the_masters(master, tmp_path, solved_master):
    """A build with variants: each variant's student notebook says which it is, its tests travel in the one zip, its
    own solution earns every point of them, and the master's solution (a neighbour's answer) loses points on them:
    the variants differ in what the answers must be."""
    n = 1 + len(grading.variants_of(master))
    out = tmp_path / "out"
    grading.build(master, out, variants=n)
    cfg = _config(out)
    assert sorted(cfg["variant_tests"]) == [str(k) for k in range(1, n)] and "variants" not in cfg
    _, _, masters_env = solved_master(master.stem)          # the master's own solution: a neighbour's answer
    for k in range(1, n):
        assert (out / f"solved-v{k}" / master.name).is_file()
        student = out / f"student-v{k}" / master.name
        assert nbformat.read(student, as_version=4).metadata[grading.VARIANT_KEY] == k
        # a student notebook says nothing of the other variants (the configuration with its pairs stays behind)
        assert "variants:" not in student.read_text() and "replace:" not in student.read_text()
        assert not (set(_code_cells(student)) & set(cfg["variant_tests"][str(k)].values()))
        tests_dir = tmp_path / f"tests-v{k}"
        tests_dir.mkdir()
        for q, text in cfg["variant_tests"][str(k)].items():
            (tests_dir / f"{q}.py").write_text(text)
        env: dict = {"__name__": "__submission__"}
        with grading.guarded(cfg["guard"], tests_dir=str(tests_dir)):
            _exec_cells(_code_cells(grading.variant_master(master, k, tmp_path / f"v{k}" / master.name)), env,
                        f"variant {k}")
            own = _grade(tests_dir, env)
            neighbour = _grade(tests_dir, masters_env)
        assert all(r["score"] == r["possible"] for r in own.values()), own
        lost = {q for q in own if neighbour[q]["score"] < own[q]["score"]}
        assert lost, f"variant {k}: the master's own solution earns every point of the variant's tests"
    assert nbformat.read(out / "student" / master.name, as_version=4).metadata[grading.VARIANT_KEY] == 0
    assert "replace:" not in (out / "student" / master.name).read_text()


def test_the_plugin_grades_by_the_variant_the_notebook_names():
    from capslib.tools.grading_plugin import NoDelegation
    plugin = NoDelegation(None, None, {"guard": ["capslib.squash"], "variant_tests": {"1": {"q1": "v1 tests"}}})
    plugin.tests = {"q1": "master tests"}
    plugin.choose_variant(0)
    assert plugin.tests == {"q1": "master tests"} and plugin.unknown_variant is None
    plugin.choose_variant(1)
    assert plugin.tests == {"q1": "v1 tests"} and plugin.variant == 1
    plugin.choose_variant(7)
    assert plugin.unknown_variant == 7


def test_otter_grades_a_variant_by_its_metadata(tmp_path, otter_built):
    """Through otter's runner: the solved notebook of variant 1 earns every point, which it can only do if the
    zip grades it by variant 1's tests (its answers differ from the master's on the questions the variant
    changes)."""
    master, out, zip_path = otter_built
    if not grading.variants_of(master):
        pytest.skip(f"{master.stem} declares no variant")
    solved = tmp_path / master.name
    solved.write_bytes((out / "solved-v1" / master.name).read_bytes())
    assert nbformat.read(solved, as_version=4).metadata[grading.VARIANT_KEY] == 1
    results = _otter_grade(solved, zip_path)
    auto = {q: r for q, r in results.items() if r["possible"]}
    assert auto and all(r["score"] == r["possible"] for r in auto.values()), results


# ----------------------------------------------------------------------------- planted bugs

# A plausible bug per assignment, planted in the master's solution (question, text in the solution, the bug): each
# passes every public test of its question and must fail a hidden one (issue 35: the hidden tests earn their keep).
PLANTED = {
    "a1_squash_and_margin": ("q1", "torch.sqrt(n2 + 1e-20))", "torch.sqrt(n2))"),                    # 0/0 at s = 0
    "a2_routing_by_agreement": ("q1", "u_route = u_hat.detach() if detach else u_hat", "u_route = u_hat"),
    "a3_soft_routing_gradients": ("q1", 'raise ValueError(f"{name} holds NaN or infinite values")', "pass"),
    "a4_coupling_gradient": ("q1", "lam = float(logit_scale)", "lam = 1.0"),                          # scale ignored
    "a5_em_routing": ("q1", "w = rp / S.clamp_min(eps).unsqueeze(1)", "w = rp / S.unsqueeze(1)"),   # 0/0, silent
    "a6_parse_tree_entropy": ("q1", ".clamp(0, levels - 1).long()", ".long()"),                        # no clamp
    "a7_products_of_expert_capsules": ("q1", "-torch.log1p((z * z).sum(dim=-1))", "-torch.log(1 + (z * z).sum(dim=-1))"),
}


def test_every_assignment_has_a_planted_bug():
    assert set(PLANTED) == {m.stem for m in MASTERS}


def test_a_planted_bug_passes_the_public_tests_and_fails_a_hidden_one(built):
    master, out, _ = built
    q, old, new = PLANTED[master.stem]
    cfg = _config(out)
    tests_dir = out / "autograder" / "tests"
    cells = _code_cells(out / "autograder" / master.name)
    assert sum(old in c for c in cells) == 1, f"{master.stem}: the bug's text must stand once in the solution"
    env: dict = {"__name__": "__submission__"}
    with grading.guarded(cfg["guard"], tests_dir=str(tests_dir)):
        _exec_cells([c.replace(old, new) for c in cells], env, "planted bug")
        tf = otter_test_files.ExceptionTestFile.from_file(str((tests_dir / f"{q}.py").resolve()))
        tf.run(env)
    cases = [(r.test_case.hidden, r.passed) for r in tf.test_case_results]
    assert any(not hidden for hidden, _ in cases) and any(hidden for hidden, _ in cases)
    assert all(passed for hidden, passed in cases if not hidden), f"{master.stem}: a public test catches the bug"
    assert not all(passed for hidden, passed in cases if hidden), f"{master.stem}: no hidden test catches the bug"


# capslib routines that compute what a question asks under another name (the audit's "unguarded equivalents"):
# each is guarded too, so a submission that calls it earns nothing on the questions it answers
EQUIVALENTS = {
    "a2_routing_by_agreement": {
        "my_wrong_axis_routing": "import capslib.pitfalls\n"
                                 "def my_wrong_axis_routing(u_hat, iterations=3):\n"
                                 "    return capslib.pitfalls.routing(u_hat, iterations, softmax_over='inputs')\n",
        "my_dynamic_routing": "import capslib.coupling_gradient\n"
                              "def my_dynamic_routing(u_hat, iterations=3, detach=False):\n"
                              "    return capslib.coupling_gradient.scaled_routing(u_hat, iterations, 1.0, detach)\n"},
}


@pytest.mark.parametrize("stem", sorted(EQUIVALENTS))
def test_equivalent_routines_under_other_names_earn_nothing(stem, solved_master):
    guard, tests_dir, solved = solved_master(stem)
    for fn, src in EQUIVALENTS[stem].items():
        questions = _questions_using(tests_dir, fn)
        env = dict(solved)
        with grading.guarded(guard, tests_dir=str(tests_dir)):
            exec(compile(src, f"<equivalent {fn}>", "exec"), env)
            grades = _grade(tests_dir, env, only=questions)
        assert questions and all(g["score"] == 0 for g in grades.values()), (fn, grades)
        control = dict(solved)
        exec(compile(src, f"<control {fn}>", "exec"), control)   # without the guard the routine answers
        assert sum(g["score"] for g in _grade(tests_dir, control, only=questions).values()) > 0, fn


def test_the_couplings_with_their_graph_are_guarded_in_assignment_7():
    master = next(m for m in MASTERS if m.stem == "a7_products_of_expert_capsules")
    import yaml
    cfg = yaml.safe_load(nbformat.read(master, as_version=4).cells[0].source)
    guard = cfg["plugins"][0]["capslib.tools.grading.NoDelegation"]["guard"]
    assert "capslib.poe._routing_differentiable" in guard
    import torch
    import capslib.poe
    with grading.guarded(guard):
        with pytest.raises(grading.DelegationError):
            capslib.poe._routing_differentiable(torch.randn(1, 2, 3, 4), 2, "outputs")
