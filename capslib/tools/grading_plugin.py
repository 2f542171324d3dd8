"""The otter plugin that grades the book's assignments (``capslib.tools.grading.NoDelegation`` in the
masters' configuration): the delegation guard in the submission's kernel, the static scan, and the
grading of the submitted code in a fresh process that replaces otter's results. See
:mod:`capslib.tools.grading` (the guard), :mod:`capslib.tools.grading_scan` (the scan) and
:mod:`capslib.tools.grading_fresh` (the fresh process)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from capslib.tools.grading import VARIANT_KEY, _guard_names

try:  # otter is in the lock; the fallback lets the docs import this module without it
    from otter.plugins import AbstractOtterPlugin
except ImportError:  # pragma: no cover - otter is in the lock
    class AbstractOtterPlugin:  # type: ignore[no-redef]
        def __init__(self, submission_path, submission_metadata, plugin_config):
            self.submission_path, self.submission_metadata = submission_path, submission_metadata
            self.plugin_config = plugin_config


GUARD_CELL = """\
import capslib.tools.grading as _capslib_grading
_capslib_grading.install({names!r}, tests_dir="./tests", secret={secret!r})
del _capslib_grading
"""


class NoDelegation(AbstractOtterPlugin):
    """Otter plugin: grade with the configured capslib callables stubbed (see :mod:`capslib.tools.grading`),
    replace otter's results by a grading of the submitted code in a fresh process
    (:mod:`capslib.tools.grading_fresh`; the test files are read when the plugin starts, before any of
    the submission runs), and score 0 on every question that the static scan
    (:mod:`capslib.tools.grading_scan`) flags.

    ``before_execution`` scans the submission's code cells as submitted (before anything runs), then
    puts a cell that calls :func:`capslib.tools.grading.install` before the submission's first cell;
    otter's own set-up cell still comes first, so the guard is in place before any student code or ``grader.check``
    runs. ``after_grading`` sets each flagged question to 0 and adds the findings to its report:

    * a finding of autograd in a function the assignment forbids it in (``no_autograd``) hits the
      questions whose tests use that function;
    * a finding inside a top-level function ``f`` hits the questions whose tests use a name that
      reaches ``f`` (``f`` itself, or a graded function that calls it); one that no tested name
      reaches, and one at top level (a capslib import, ``exec``, patching a module), hits every
      autograded question.

    Configuration beside ``guard`` (written by :func:`capslib.tools.grading.build`, from the master):
    ``allowed_imports``, the capslib import statements the assignment hands out, ``no_autograd``, the graded
    functions whose question forbids autograd, and, for a build with variants, ``variant_tests`` (variant ->
    question -> test file): a submission whose notebook metadata names variant ``k`` (``capsbook_variant``) is
    graded by variant ``k``'s tests; one that names a variant the zip does not hold scores 0 on every question.
    """

    def __init__(self, submission_path, submission_metadata, plugin_config):
        super().__init__(submission_path, submission_metadata, plugin_config)
        self.names = _guard_names(plugin_config)
        self.allowed = tuple(plugin_config.get("allowed_imports", ()))
        self.no_autograd = tuple(plugin_config.get("no_autograd", ()))
        self.secret = plugin_config.get("secret")   # written by build(); seeds the hidden tests' inputs
        self.findings: list[tuple[Any, str | None]] = []   # (Finding, forbidden function or None)
        self.cells: list[str] = []
        # the test files as the zip holds them, read before any of the submission runs (its kernel can
        # rewrite the copies on disk); the fresh-process grading uses these
        self.tests = _read_tests(Path(submission_path).parent / "tests") if submission_path else {}
        self.process = None   # the fresh grading process, started in before_execution
        self.variant_tests = plugin_config.get("variant_tests", {}) or {}
        self.variant = 0
        self.unknown_variant = None

    def scan(self, cells: list[str]) -> None:
        from capslib.tools.grading_scan import scan_cells
        self.cells = list(cells)
        self.findings = [(f, None) for f in scan_cells(self.cells, (), allowed=self.allowed)]
        for fn in self.no_autograd:
            self.findings += [(f, fn) for f in scan_cells(self.cells, {f"autograd:{fn}"}, allowed=self.allowed)
                              if f.kind == "autograd"]

    def before_execution(self, submission):
        if self.tests and self.process is None:
            from capslib.tools.grading_fresh import start
            self.process = start()
        source = GUARD_CELL.format(names=list(self.names), secret=self.secret)
        if isinstance(submission, str):
            self.scan([submission])
            return source + "\n" + submission
        import nbformat
        self.choose_variant(submission.metadata.get(VARIANT_KEY, 0))
        self.scan([c.source for c in submission.cells if c.cell_type == "code"])
        submission.cells.insert(0, nbformat.v4.new_code_cell(source))
        return submission

    def choose_variant(self, k) -> None:
        """Grade by the tests of variant ``k`` (the submission's metadata): the zip's own files for 0, the
        configuration's ``variant_tests`` for another the zip holds; any other value is remembered and scores 0."""
        if k in (0, None, "0"):
            return
        if str(k) in self.variant_tests:
            self.variant, self.tests = int(k), dict(self.variant_tests[str(k)])
        else:
            self.unknown_variant = k

    def affected(self, tests: dict[str, set[str]]) -> dict[str, list[str]]:
        """Question -> the findings' text that zero it, given each question's names used by its tests."""
        from capslib.tools.grading_scan import reachable_definitions
        reach = {q: set().union(*(reachable_definitions(self.cells, n) for n in names)) if names else set()
                 for q, names in tests.items()}
        out: dict[str, list[str]] = {}
        for finding, fn in self.findings:
            if fn is not None:
                hit = [q for q, names in tests.items() if fn in names]
            elif finding.function is not None:
                hit = [q for q, defs in reach.items() if finding.function in defs]
            else:
                hit = []
            for q in hit or list(tests):
                out.setdefault(q, []).append(str(finding))
        return out

    def regrade(self, results) -> None:
        """Replace otter's results (computed in the submission's kernel) by a grading of the submitted
        code in a fresh process (:mod:`capslib.tools.grading_fresh`); questions otter reported that the
        zip has no test file for are dropped."""
        from otter.test_files import ExceptionTestFile
        from otter.test_files.abstract_test import TestCase, TestCaseResult

        from capslib.tools.grading_fresh import grade

        fresh = grade(self.cells, self.tests, self.names, self.secret, process=self.process)
        self.process = None
        new = {}
        for q, text in sorted(self.tests.items()):
            tf = ExceptionTestFile.from_string(text, path=f"tests/{q}.py")
            cases = fresh[q].get("cases", [])
            if len(cases) == len(tf.test_cases) and "error" not in fresh[q]:
                tf.test_case_results = [TestCaseResult(test_case=tc, message=c["message"], passed=c["passed"])
                                        for tc, c in zip(tf.test_cases, cases)]
            else:   # the fresh process could not run the tests: the reason, and no points
                tf.test_case_results = [TestCaseResult(test_case=TestCase(
                    name="grading in a fresh process", body="", hidden=False, points=0, success_message=None,
                    failure_message=None), message=fresh[q].get("error", "the tests did not all run"), passed=False)]
                tf.update_score(0)
            new[q] = tf
        results.results = new

    def after_grading(self, results):
        if self.tests:
            self.regrade(results)
        if self.unknown_variant is not None:
            self.zero_all(results, f"the submission names variant {self.unknown_variant!r}, which this autograder "
                                   f"does not hold (variants 0-{len(self.variant_tests)})")
            return
        if not self.findings:
            return
        from otter.test_files.abstract_test import TestCase, TestCaseResult
        tests = {q: _names_used(self.tests.get(q)) for q in results.results}
        affected = self.affected(tests)
        lines = []
        for q, texts in affected.items():
            reason = (f"{q} scores 0: the static scan of the submission flagged\n"
                      + "\n".join(f"  - {t}" for t in texts))
            tf = results.results[q]
            tf.test_case_results.append(TestCaseResult(
                test_case=TestCase(name="static scan (capslib.tools.grading_scan)", body="", hidden=False,
                                   points=0, success_message=None, failure_message=None),
                message=reason, passed=False))
            results.update_score(q, 0)
            lines.append(reason)
        text = "\n\n".join(lines)
        results.set_output(text if not results.output else results.output + "\n\n" + text)
        results.set_plugin_data("capslib.tools.grading.NoDelegation", {q: list(t) for q, t in affected.items()})

    def zero_all(self, results, reason: str) -> None:
        """Every question scores 0, with ``reason`` in its report."""
        from otter.test_files.abstract_test import TestCase, TestCaseResult
        for q, tf in results.results.items():
            tf.test_case_results.append(TestCaseResult(
                test_case=TestCase(name="variant", body="", hidden=False, points=0, success_message=None,
                                   failure_message=None), message=reason, passed=False))
            results.update_score(q, 0)
        results.set_output(reason if not results.output else results.output + "\n\n" + reason)


def _read_tests(folder: Path) -> dict[str, str]:
    """Question -> the text of its test file ``folder/q*.py``."""
    return {p.stem: p.read_text() for p in sorted(Path(folder).glob("q*.py"))}


def _names_used(text: str | None) -> set[str]:
    """The names a test file's text refers to (its test functions' parameters and the names it reads)."""
    import ast
    if not text:
        return set()
    tree = ast.parse(text)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
              for a in n.posonlyargs + n.args + n.kwonlyargs}
    return names
