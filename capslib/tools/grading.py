"""Grading the book's otter-grader assignments so that delegating to capslib earns nothing.

An assignment asks a student to write, say, the parse-tree entropy in plain PyTorch; capslib holds
an implementation of the same thing. A submission whose function simply calls capslib would pass
every test that compares with capslib. This module removes that route: during grading, every
capslib callable an assignment grades is replaced by a stub that raises :class:`DelegationError`,
and the tests obtain expected values only through :func:`reference`, which refuses to serve code
written by the submission.

Interface for assignment masters (``book/assignments/*.ipynb``)
---------------------------------------------------------------
1. The ``# ASSIGNMENT CONFIG`` names the plugin and what it guards::

       plugins:
         - capslib.tools.grading.NoDelegation:
             guard:
               - capslib.rem.quantize
               - capslib.rem.parse_tree_entropy

   A guard entry is the dotted name of a function defined in capslib (``capslib.squash``), of a
   class (every function in the class body is stubbed, so instantiating or subclassing it fails),
   of one method (``capslib.soft_routing.SoftRoutingNet.forward``) or of a whole module
   (``capslib.rem``: every function and class defined in it). Decorated functions are followed
   through ``__wrapped__`` to capslib's own code.

   Convention for the delegation tests (``tests/test_assignments.py``): the student function
   graded against ``capslib.x.name`` is called ``my_name`` and takes the same arguments (so that a
   wrapper around capslib would pass if nothing stopped it). A master may name other pairs
   explicitly with ``delegates: {my_function: capslib.dotted.name}`` beside ``guard``; a guarded
   callable with no student counterpart (a helper) needs no pair.

2. Tests (public and hidden) get expected values ONLY through ``reference``::

       import capslib.tools.grading
       expected = capslib.tools.grading.reference("capslib.rem.quantize")(c, 11)

   never by calling capslib directly: during grading the direct call raises like any other.
   ``reference`` works the same in a student's own notebook (``grader.check``) and under the
   autograder.

How it works
------------
* :func:`install` (run by the plugin in a cell put before the submission's first cell, so before
  any student code and before any ``grader.check`` the notebook contains) keeps a private copy of
  each guarded function and then replaces the *code object* (``__code__``) of the function itself
  with a stub. Every name bound to that function object -- the module attribute, a package
  re-export such as ``capslib.squash``, an alias the student took, ``getattr``, ``from ... import
  ... as``, ``importlib.import_module``, an import inside the student's function -- now runs the
  stub. The stub raises :class:`DelegationError` unless a :func:`reference` call is running (then
  it runs the private copy, so capslib code that calls another guarded function still works).
* Re-loading a guarded module (``importlib.reload``, deleting it from ``sys.modules`` and importing
  again) would create fresh, unstubbed functions; a finder placed first on ``sys.meta_path``
  refuses to load a guarded module again while the guard is installed.
* :func:`reference` walks the call stack outward from its caller. It serves the call only if it
  reaches a frame of a test file before any frame of code that is not a test file, the standard
  library, an installed package or capslib itself. A student function is compiled from a notebook
  cell (or ``exec``), so when it calls ``reference`` -- directly, through an alias, through a
  helper -- its frame sits between the test and ``reference`` and the call is refused. The
  callable ``reference`` returns checks the stack again each time it is called.

Threat model (what this stops and what it does not)
---------------------------------------------------
It stops *delegation*: a graded function that reaches capslib's implementation of the graded thing
by a module-level alias taken before or after the guard, a wrapper, ``getattr``, an import inside
the function, ``importlib.import_module``, ``from capslib.x import f as g``, ``importlib.reload``,
or through :func:`reference`. ``tests/test_assignments.py`` grades a submission for each of those
routes and checks it scores zero with a :class:`DelegationError` in every failure message.

Otter runs the tests in the submission's kernel, where a submission can defeat the grader itself
(replace otter's ``call_func``, rewrite the test files, patch ``assert_close``). The otter plugin
(:mod:`capslib.tools.grading_plugin`) therefore grades the submitted code again in a fresh process
(:mod:`capslib.tools.grading_fresh`) and keeps only those results, beside the static scan
(:mod:`capslib.tools.grading_scan`). Code compiled under a name in angle brackets (``"<frozen x>"``)
counts as submission code here, whatever the name. Hidden tests draw their inputs from the zip's
secret (:func:`hidden_generator`); error tests require the bad argument and only it in the message
(:func:`assert_error_names`).

Known ways around the guard, not stopped: restoring the original code objects from this module's
private state (reachable by introspection, e.g. ``gc.get_referrers``); loading a second copy of
capslib from its file with ``importlib.util.spec_from_file_location`` under another module name
(the static scan flags ``importlib``); code compiled under the forged path of a real file (in the
standard library, site-packages or the tests folder) so that its frames look trusted. Copying
capslib's source text into the notebook is plagiarism, not delegation,
and is left to the instructor. The guard is a tool against the easy shortcut, not a sandbox.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import sys
import sysconfig
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

_CAPSLIB_DIR = str(Path(__file__).resolve().parent.parent)


class DelegationError(RuntimeError):
    """A graded capslib callable was reached by submission code while grading."""


# ----------------------------------------------------------------------------- resolving names

def resolve(name: str) -> Any:
    """The object a dotted name such as ``capslib.rem.quantize`` or ``capslib.X.method`` names."""
    if not isinstance(name, str) or not name.startswith("capslib"):
        raise ValueError(f"a guarded name must be a dotted name inside capslib, e.g. "
                         f"'capslib.rem.quantize'; got {name!r}")
    parts = name.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                raise ValueError(f"cannot resolve {name!r}: {'.'.join(parts[:i])!r} has no "
                                 f"attribute {part!r}") from None
    return obj


def _is_capslib_code(fn: types.FunctionType) -> bool:
    return str(Path(fn.__code__.co_filename).resolve()).startswith(_CAPSLIB_DIR + os.sep)


def _functions_of(name: str, obj: Any) -> list[tuple[str, types.FunctionType]]:
    """Every capslib function object that guarding ``obj`` must stub, with a label for each."""
    found: list[tuple[str, types.FunctionType]] = []

    def add_function(label: str, f: Any) -> None:
        seen = set()
        while f is not None and id(f) not in seen:  # follow decorators to capslib's own code
            seen.add(id(f))
            if isinstance(f, (staticmethod, classmethod)):
                f = f.__func__
                continue
            if isinstance(f, types.FunctionType) and _is_capslib_code(f):
                found.append((label, f))
            f = getattr(f, "__wrapped__", None)

    def add_class(label: str, cls: type) -> None:
        for attr, value in vars(cls).items():
            if isinstance(value, property):
                for part in (value.fget, value.fset, value.fdel):
                    add_function(f"{label}.{attr}", part)
            else:
                add_function(f"{label}.{attr}", value)

    if isinstance(obj, types.ModuleType):
        for attr, value in vars(obj).items():
            if getattr(value, "__module__", None) != obj.__name__:
                continue
            if isinstance(value, type):
                add_class(f"{name}.{attr}", value)
            else:
                add_function(f"{name}.{attr}", value)
    elif isinstance(obj, type):
        add_class(name, obj)
    else:
        add_function(name, getattr(obj, "__func__", obj))  # a bound or class method: its function
    if not found:
        raise ValueError(f"{name!r} names no function defined in capslib ({type(obj).__name__}); "
                         "guard a capslib function, class, method or module")
    return found


# ----------------------------------------------------------------------------- the stubs

_state = threading.local()


def _reference_depth() -> int:
    return getattr(_state, "depth", 0)


@contextlib.contextmanager
def _reference_mode() -> Iterator[None]:
    _state.depth = _reference_depth() + 1
    try:
        yield
    finally:
        _state.depth -= 1


@dataclass
class _Guard:
    names: tuple[str, ...]
    tests_dir: str | None
    stubbed: dict[int, tuple[types.FunctionType, types.CodeType]] = field(default_factory=dict)
    originals: dict[str, types.FunctionType] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    modules: set[str] = field(default_factory=set)
    test_files: frozenset[str] = frozenset()
    finder: Any = None
    secret: str | None = None


_GUARD: _Guard | None = None


def _gate(key: str, args: tuple, kwargs: dict) -> Any:
    """What a stubbed capslib function runs instead of its code."""
    guard = _GUARD
    if guard is not None and _reference_depth() > 0 and key in guard.originals:
        return guard.originals[key](*args, **kwargs)
    label = guard.labels.get(key, key) if guard is not None else key
    raise DelegationError(f"{label} is graded in this assignment: while grading it cannot be "
                          "called from the submission (write it yourself)")


def _stub_code(fn: types.FunctionType, key: str) -> types.CodeType:
    """A code object that calls ``_gate(key, ...)`` with the same free variables as ``fn``."""
    free = fn.__code__.co_freevars
    cells = "".join(f"    {v} = None\n" for v in free)
    touch = f"        if False: ({', '.join(free)},)\n" if free else ""
    src = (f"def _outer():\n{cells}"
           f"    def _stub(*__args, **__kwargs):\n{touch}"
           f"        import capslib.tools.grading as __grading\n"
           f"        return __grading._gate({key!r}, __args, __kwargs)\n"
           f"    return _stub\n")
    namespace: dict = {}
    exec(compile(src, f"<capslib.tools.grading stub of {key}>", "exec"), namespace)
    code = namespace["_outer"]().__code__
    if code.co_freevars != free:
        raise RuntimeError(f"cannot stub {key}: free variables {free} came out as {code.co_freevars}")
    return code.replace(co_name=fn.__code__.co_name, co_qualname=fn.__code__.co_qualname)


class _ReloadBlocker:
    """A meta-path finder that refuses to load a guarded capslib module a second time."""

    def __init__(self, modules: Iterable[str]):
        self.modules = frozenset(modules)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.modules:
            raise ImportError(f"{fullname} holds graded code: it cannot be loaded again while grading "
                              "(DelegationError)")
        return None


def _test_files(tests_dir: str | None) -> frozenset[str]:
    if tests_dir is None:
        return frozenset()
    folder = Path(tests_dir)
    if not folder.is_dir():
        raise ValueError(f"tests_dir must be the folder of the assignment's test files; "
                         f"{tests_dir!r} is not a directory")
    return frozenset(str(p.resolve()) for p in folder.glob("*.py"))


def install(names: Iterable[str], tests_dir: str | None = None, secret: str | None = None) -> None:
    """Stub every capslib callable in ``names`` (see the module docstring) until the guard is lifted.

    There is no public way to lift it: :func:`guarded` lifts its own guard when its block ends
    (for the tests); under otter the guard lasts as long as the grading process.

    Args:
        names: dotted names of capslib functions, classes, methods or modules.
        tests_dir: the folder of the test files being graded; only their frames may call
            :func:`reference` while the guard is installed (None: any ``tests/*.py``).
        secret: the grading secret that seeds :func:`hidden_generator` (the autograder zip's, set
            when it was built); None: a fresh secret of this process.
    """
    global _GUARD
    names = tuple(names)
    if isinstance(names, str) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"names must be a non-empty list of dotted capslib names; got {names!r}")
    if _GUARD is not None:
        raise RuntimeError("capslib.tools.grading: a guard is already installed")
    if secret is not None and (not isinstance(secret, str) or not secret):
        raise ValueError(f"secret must be a non-empty string; got {secret!r}")
    guard = _Guard(names=names, tests_dir=tests_dir, test_files=_test_files(tests_dir), secret=secret)
    targets: list[tuple[str, types.FunctionType]] = []
    for name in names:
        targets.extend(_functions_of(name, resolve(name)))
    try:
        for label, fn in targets:
            if id(fn) in guard.stubbed:
                continue
            key = f"{fn.__module__}:{fn.__code__.co_qualname}:{id(fn)}"
            copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                      fn.__closure__)
            copy.__kwdefaults__ = fn.__kwdefaults__
            copy.__dict__.update(fn.__dict__)
            copy.__qualname__ = fn.__qualname__
            guard.originals[key] = copy
            guard.labels[key] = label
            stub = _stub_code(fn, key)
            guard.stubbed[id(fn)] = (fn, fn.__code__)
            fn.__code__ = stub
            guard.modules.add(fn.__module__)
    except BaseException:
        for fn, code in guard.stubbed.values():
            fn.__code__ = code
        raise
    guard.finder = _ReloadBlocker(guard.modules)
    sys.meta_path.insert(0, guard.finder)
    _GUARD = guard


def _uninstall(guard: _Guard) -> None:
    """Give every function ``guard`` stubbed its code back, if ``guard`` is still the installed one.

    Private, and only for :func:`guarded`, which installed the guard (issue 35: a public
    ``uninstall()`` let a submission switch the guard off). Not a wall: a submission that reaches it
    must import capslib, which :mod:`capslib.tools.grading_scan` flags, and the module's state
    stays reachable by introspection (see the threat model above).
    """
    global _GUARD
    if guard is None or _GUARD is not guard:
        raise RuntimeError("capslib.tools.grading: only the guarded() block that installed a guard may lift it")
    _GUARD = None
    for fn, code in guard.stubbed.values():
        fn.__code__ = code
    if guard.finder in sys.meta_path:
        sys.meta_path.remove(guard.finder)


def installed() -> tuple[str, ...]:
    """The names the installed guard was given (empty when none is installed)."""
    return _GUARD.names if _GUARD is not None else ()


@contextlib.contextmanager
def guarded(names: Iterable[str], tests_dir: str | None = None, secret: str | None = None) -> Iterator[None]:
    """``install`` for the duration of a ``with`` block."""
    install(names, tests_dir, secret)
    guard = _GUARD
    try:
        yield
    finally:
        _uninstall(guard)


# ----------------------------------------------------------------------------- reference values

def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {_CAPSLIB_DIR}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            dirs.add(str(Path(paths[key]).resolve()))
    for p in sys.path:  # site-packages folders of the running environment (venvs, user site)
        if p and os.path.basename(p) in ("site-packages", "dist-packages"):
            dirs.add(str(Path(p).resolve()))
    return tuple(d + os.sep for d in dirs)


_LIBRARY_DIRS = _library_dirs()


def _frame_kind(code: types.CodeType) -> str:
    """'test', 'library' or 'submission' for the code a frame runs (by the file it was compiled from).

    A name in angle brackets is a file name anyone can give ``compile``: such code counts as library
    only when it is one of the guard's own stubs (by identity), never by its name (issue 35: code
    compiled as ``"<frozen x>"`` was served by :func:`reference`). Python's frozen modules never sit
    between a test and :func:`reference`.
    """
    filename = code.co_filename
    if filename.startswith("<"):
        guard = _GUARD
        if guard is not None and any(fn.__code__ is code for fn, _ in guard.stubbed.values()):
            return "library"
        return "submission"  # exec'd strings, IPython input, forged names
    path = str(Path(filename).resolve())
    guard = _GUARD
    if guard is not None and guard.tests_dir is not None:
        if path in guard.test_files:
            return "test"
    elif Path(path).parent.name == "tests" and path.endswith(".py"):
        return "test"
    if path.startswith(_LIBRARY_DIRS):
        return "library"
    return "submission"


def _check_caller(what: str, frame: types.FrameType | None) -> None:
    while frame is not None:
        kind = _frame_kind(frame.f_code)
        if kind == "test":
            return
        if kind == "submission":
            raise DelegationError(
                f"{what} may be called only by the assignment's test files; it was reached through "
                f"{frame.f_code.co_name!r} in {frame.f_code.co_filename} (submission code)")
        frame = frame.f_back
    raise DelegationError(f"{what} may be called only by the assignment's test files")


def reference(name: str) -> Callable[..., Any]:
    """The capslib implementation ``name`` (e.g. ``"capslib.rem.quantize"``) for a test to compare with.

    The only way a test should compute expected values. Works whether or not a guard is
    installed; refuses (:class:`DelegationError`) when called, or when the callable it returns is
    called, with submission code between the caller and the nearest test-file frame.
    """
    what = f"capslib.tools.grading.reference({name!r})"
    _check_caller(what, sys._getframe(1))
    target = resolve(name)
    if not callable(target):
        raise ValueError(f"{name!r} is not callable ({type(target).__name__})")

    def run(*args: Any, **kwargs: Any) -> Any:
        _check_caller(what, sys._getframe(1))
        with _reference_mode():
            return target(*args, **kwargs)

    run.__name__ = f"reference_{name.rsplit('.', 1)[-1]}"
    run.__doc__ = f"capslib's {name}, for tests only."
    return run


# ----------------------------------------------------------------------------- secret inputs, strict errors

_PROCESS_SECRET = secrets.token_hex(16)   # when no grading secret is installed: fresh for each process


def hidden_generator(label: str | None = None):
    """A ``torch.Generator`` for a hidden test's random inputs, seeded from the grading secret.

    The secret is the one the autograder zip was built with (``make assignments GRADING_SECRET=...``,
    by default a fresh random one per build), installed with the guard; without one, a secret drawn
    once per process. So the inputs are the same every time one zip grades (a regrade gives the same
    score) but neither the notebook's seed nor an earlier build's inputs predict them: a table of
    inputs and outputs recorded elsewhere does not replay. ``label`` (default: the calling test
    function's name) gives each test its own stream. Only test files may call it.
    """
    import hashlib

    import torch

    caller = sys._getframe(1)
    _check_caller("capslib.tools.grading.hidden_generator", caller)
    if label is None:
        label = caller.f_code.co_name
    guard = _GUARD
    secret = guard.secret if guard is not None and guard.secret else _PROCESS_SECRET
    digest = hashlib.sha256(f"{secret}\0{label}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)


# argument names that are also English words standing alone ("V holds a NaN"): they count as named only quoted
WORD_NAMES = frozenset({"a", "A", "I"})


def _identifiers(text: str) -> set[str]:
    import re

    found = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)) - WORD_NAMES
    return found | set(re.findall(r"[`'\"]([A-Za-z_][A-Za-z0-9_]*)[`'\"]", text))


def assert_error_names(fn: Callable[..., Any], bad: str, params: Iterable[str], *args: Any, **kwargs: Any) -> None:
    """Assert that ``fn(*args, **kwargs)`` raises ``ValueError`` whose message names ``bad`` and no other
    of the function's arguments ``params`` (its parameter names as the assignment states them).

    A name counts as named when it appears as a whole identifier in the message (``u_hat`` in
    "u_hat must be (B, I, J, D)", not in "u_hats"), or, for a name that is also an English word standing alone
    (:data:`WORD_NAMES`: ``a``, ``A``, ``I``), when it appears quoted ("`a` holds NaN"; in "V holds a NaN" the
    article names nothing). A message naming every argument names none usefully, and fails.
    """
    params = tuple(params)
    if bad not in params:
        raise ValueError(f"bad must be one of the arguments {params}; got {bad!r}")
    try:
        fn(*args, **kwargs)
    except ValueError as err:
        named = _identifiers(str(err)) & set(params)
        if bad not in named:
            raise AssertionError(f"the error should name {bad!r}: {err}") from None
        if named != {bad}:
            raise AssertionError(f"the error should name {bad!r} and no other argument; it also names "
                                 f"{sorted(named - {bad})}: {err}") from None
    else:
        raise AssertionError(f"no ValueError for a bad {bad}")


# ----------------------------------------------------------------------------- the otter plugin

def _guard_names(config: Any) -> list[str]:
    if not isinstance(config, dict) or "guard" not in config:
        raise ValueError("capslib.tools.grading.NoDelegation needs a config {guard: [dotted capslib names]}; "
                         f"got {config!r}")
    names = config["guard"]
    if isinstance(names, str) or not isinstance(names, list) or not names:
        raise ValueError(f"NoDelegation's guard must be a non-empty list of dotted capslib names; got {names!r}")
    for n in names:
        _functions_of(n, resolve(n))  # fails early, at otter assign, on a name that guards nothing
    delegates = config.get("delegates", {})
    if not isinstance(delegates, dict):
        raise ValueError(f"NoDelegation's delegates must map student names to capslib names; got {delegates!r}")
    return names


def __getattr__(name: str) -> Any:
    """``capslib.tools.grading.NoDelegation`` (the name the masters' configuration uses) lives in
    :mod:`capslib.tools.grading_plugin`, imported only when asked for: otter takes seconds to import,
    and the guard and :func:`reference` do not need it."""
    if name == "NoDelegation":
        from capslib.tools.grading_plugin import NoDelegation
        return NoDelegation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def delegates(config: dict) -> dict[str, str]:
    """Student function name -> capslib name, for the delegation tests (convention: ``my_<name>``)."""
    pairs = {f"my_{n.rsplit('.', 1)[-1]}": n for n in _guard_names(config)
             if not isinstance(resolve(n), (type, types.ModuleType))}
    pairs.update(config.get("delegates", {}))
    return pairs


# ----------------------------------------------------------------------------- per-student variants

VARIANT_KEY = "capsbook_variant"   # a student notebook's metadata: the variant it was handed out as


def variants_of(master: str | Path) -> list[dict]:
    """The variants a master declares beside ``guard`` (``variants:``, a list of ``{name, replace}``, each
    ``replace`` a list of ``[text in the master, text in this variant]`` pairs); variant 0, the master as
    written, is not listed. A variant changes what the answer must be (a constant, a convention, a unit),
    in the questions' text, the solutions and the tests alike."""
    import nbformat
    import yaml

    nb = nbformat.read(str(master), as_version=4)
    head = next((c for c in nb.cells if c.cell_type == "raw" and c.source.startswith("# ASSIGNMENT CONFIG")), None)
    if head is None:
        raise ValueError(f"{master}: no '# ASSIGNMENT CONFIG' cell")
    cfg = yaml.safe_load(head.source)
    entry = [p[_PLUGIN] for p in cfg.get("plugins", []) if isinstance(p, dict) and _PLUGIN in p]
    found = (entry[0] or {}).get("variants", []) if entry else []
    for k, v in enumerate(found, start=1):
        pairs = v.get("replace") if isinstance(v, dict) else None
        if not isinstance(v, dict) or not str(v.get("name", "")).strip() or not pairs or not all(
                isinstance(pr, list) and len(pr) == 2 and all(isinstance(t, str) and t for t in pr) for pr in pairs):
            raise ValueError(f"{master}: variant {k} must be {{name: ..., replace: [[old, new], ...]}}; got {v!r}")
    return found


def variant_master(master: str | Path, k: int, dest: str | Path) -> Path:
    """Write variant ``k`` of ``master`` to ``dest``: every ``replace`` pair of the variant applied to every cell
    but the configuration (each pair must change at least one cell, so a variant cannot silently go stale as the
    master changes), and ``k`` in the notebook's metadata (``capsbook_variant``). ``k = 0``: the master itself."""
    import nbformat

    nb = nbformat.read(str(master), as_version=4)
    if k:
        found = variants_of(master)
        if not 1 <= k <= len(found):
            raise ValueError(f"{Path(master).name} declares {len(found)} variant(s) besides the master; got {k}")
        for old, new in found[k - 1]["replace"]:
            hits = 0
            for cell in nb.cells:
                if cell.cell_type == "raw" and cell.source.startswith("# ASSIGNMENT CONFIG"):
                    continue
                if old in cell.source:
                    hits += 1
                    cell.source = cell.source.replace(old, new)
            if not hits:
                raise ValueError(f"{Path(master).name}, variant {k} ({found[k - 1]['name']}): {old!r} occurs in "
                                 f"no cell of the master")
    nb.metadata[VARIANT_KEY] = k
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(dest))
    return dest


def _mark_variant(notebook: Path, k: int) -> None:
    import nbformat

    nb = nbformat.read(str(notebook), as_version=4)
    if nb.metadata.get(VARIANT_KEY) != k:
        nb.metadata[VARIANT_KEY] = k
        nbformat.write(nb, str(notebook))


# ----------------------------------------------------------------------------- building the package

def autograder_zip(out: str | Path) -> Path:
    """The autograder zip that :func:`build` wrote under ``out``."""
    zips = sorted(Path(out, "autograder").glob("*-autograder.zip"))
    if len(zips) != 1:
        raise FileNotFoundError(f"expected one *-autograder.zip in {Path(out, 'autograder')}; found {zips}")
    return zips[0]


def build(master: str | Path, out: str | Path, secret: str | None = None, variants: int = 1) -> Path:
    """Otter Assign on one master into ``out`` (``student/``, ``autograder/``), and a zip that grades.

    ``variants`` > 1 also builds variants 1 .. variants - 1 of the master (:func:`variants_of`): each has its own
    student folder, ``student-v<k>/`` (its notebook marked with the variant in its metadata), its solved notebook in
    ``solved-v<k>/`` (for the instructor, like ``autograder/``'s), and its tests travel
    in the one zip (in the plugin's configuration, ``variant_tests``), which grades a submission by the tests of the
    variant its metadata names.

    ``secret`` seeds the hidden tests' inputs (:func:`hidden_generator`); it is written into the
    zip's ``otter_config.json`` (never into the student folder). None: a fresh random secret, so each
    build draws new hidden inputs.

    The zip otter generates is renamed ``<name>-autograder.zip`` (no time stamp) and gets capslib's
    source twice: at the top (next to ``run_otter.py``, so that the grading process can import the
    :class:`NoDelegation` plugin on Gradescope) and under ``files/`` (copied beside the submission, so
    that the notebook's kernel imports the same capslib). Returns the zip's path.
    """
    import shutil
    import zipfile

    from otter.assign import main as otter_assign

    master, out = Path(master).resolve(), Path(out).resolve()
    if not master.is_file() or master.suffix != ".ipynb":
        raise ValueError(f"master must be an otter master notebook (.ipynb); got {master}")
    if not isinstance(variants, int) or variants < 1:
        raise ValueError(f"variants must be an int >= 1; got {variants!r}")
    declared = len(variants_of(master))
    if variants - 1 > declared:
        raise ValueError(f"{master.name} declares {declared} variant(s) besides the master; {variants} asked for")
    if out.exists():
        shutil.rmtree(out)
    otter_assign(str(master), str(out), no_pdfs=True)
    _mark_variant(out / "student" / master.name, 0)
    variant_tests: dict[str, dict[str, str]] = {}
    for k in range(1, variants):   # each variant assigned on its own; its student folder and its tests kept
        work = out / "variants" / f"v{k}"
        otter_assign(str(variant_master(master, k, work / "master" / master.name)), str(work / "built"),
                     no_pdfs=True)
        shutil.move(str(work / "built" / "student"), str(out / f"student-v{k}"))
        (out / f"solved-v{k}").mkdir()            # the variant's solved notebook, for the instructor
        shutil.move(str(work / "built" / "autograder" / master.name), str(out / f"solved-v{k}" / master.name))
        _mark_variant(out / f"solved-v{k}" / master.name, k)
        _mark_variant(out / f"student-v{k}" / master.name, k)
        variant_tests[str(k)] = {p.stem: p.read_text() for p in sorted((work / "built" / "autograder" / "tests").glob("q*.py"))}
    shutil.rmtree(out / "variants", ignore_errors=True)
    made = sorted((out / "autograder").glob("*-autograder_*.zip"))
    if len(made) != 1:
        raise RuntimeError(f"otter assign did not write one autograder zip for {master.name} "
                           f"(is 'generate' set in its ASSIGNMENT CONFIG?); found {made}")
    target = out / "autograder" / f"{master.stem}-autograder.zip"
    made[0].rename(target)
    if secret is None:
        secret = secrets.token_hex(16)
    elif not isinstance(secret, str) or not secret.strip():
        raise ValueError(f"secret must be a non-empty string; got {secret!r}")
    config_text = _scan_config(out / "autograder" / "otter_config.json", out / "student" / master.name,
                               master.stem, secret, variant_tests)
    with zipfile.ZipFile(target) as zf:   # the zip's otter_config.json gets the scan's configuration too
        entries = [(info, zf.read(info)) for info in zf.infolist()]
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for info, data in entries:
            zf.writestr(info, config_text if info.filename == "otter_config.json" else data)
    sources = sorted(Path(_CAPSLIB_DIR).rglob("*.py"))  # the subpackages (book, tools) too
    with zipfile.ZipFile(target, "a", compression=zipfile.ZIP_DEFLATED) as zf:
        for p in sources:
            rel = p.relative_to(_CAPSLIB_DIR).as_posix()
            zf.write(p, arcname=f"capslib/{rel}")
            zf.write(p, arcname=f"files/capslib/{rel}")
    return target


def _scan_config(config_path: Path, student: Path, stem: str, secret: str,
                 variant_tests: dict[str, dict[str, str]] | None = None) -> str:
    """Add the static scan's settings, the grading secret and the variants' tests (``variant_tests``: variant ->
    question -> test file text) to NoDelegation's entry in ``config_path``; the new JSON text.

    ``allowed_imports``: the capslib imports in the student notebook's code (what the assignment hands
    out); ``no_autograd``: :data:`capslib.tools.grading_scan.NO_AUTOGRAD` for this assignment.
    """
    import json

    import nbformat

    from capslib.tools.grading_scan import NO_AUTOGRAD, allowed_imports

    cfg = json.loads(config_path.read_text())
    given = [c.source for c in nbformat.read(student, as_version=4).cells if c.cell_type == "code"]
    entries = [p for p in cfg.get("plugins", []) if isinstance(p, dict) and _PLUGIN in p]
    if len(entries) != 1:
        raise RuntimeError(f"{config_path}: expected one {_PLUGIN} plugin entry; found {len(entries)}")
    entries[0][_PLUGIN]["allowed_imports"] = sorted(allowed_imports(given))
    entries[0][_PLUGIN]["no_autograd"] = list(NO_AUTOGRAD.get(stem, ()))
    entries[0][_PLUGIN]["secret"] = secret
    entries[0][_PLUGIN].pop("book_answers", None)   # the student edition's business, not the grader's
    entries[0][_PLUGIN].pop("variants", None)       # the build's business: the grader gets their tests
    if variant_tests:
        entries[0][_PLUGIN]["variant_tests"] = variant_tests
    text = json.dumps(cfg, indent=2)
    config_path.write_text(text)
    return text


_PLUGIN = "capslib.tools.grading.NoDelegation"


# ----------------------------------------------------------------------------- the student edition

def student_config(source: str | Path = "_config.yml", dest: str | Path = "_build/student/_config.yml",
                   masters: Iterable[str | Path] | None = None) -> Path:
    """The book's Jupyter Book config for the student edition.

    sphinx-exercise's ``hide_solutions`` switched on; the chapters' functions that answer an assignment
    left out (:mod:`capslib.tools.student_edition`, driven by the masters' ``book_answers``; default:
    ``book/assignments/*.ipynb`` beside ``source``); no copy of the sources in the HTML (``_sources``
    would hold the notebooks whole, solutions and answers included) and so no download button.
    """
    import yaml

    from capslib.tools.student_edition import CONFIG_KEY, book_answers

    source = Path(source)
    if masters is None:
        masters = sorted((source.parent / "book" / "assignments").glob("*.ipynb"))
    cfg = yaml.safe_load(source.read_text())
    sphinx = cfg.setdefault("sphinx", {})
    config = sphinx.setdefault("config", {})
    config["hide_solutions"] = True
    config[CONFIG_KEY] = book_answers(masters)
    config["html_copy_source"] = False
    config.setdefault("html_theme_options", {})["use_download_button"] = False
    extensions = sphinx.setdefault("extra_extensions", [])
    if "capslib.tools.student_edition" not in extensions:
        extensions.append("capslib.tools.student_edition")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dest


_MARKUP = "$`*\\{}[]()|<>_#"


def solution_fragments(sources: Iterable[str | Path]) -> dict[str, str]:
    """For each ``{solution}`` block in the book's sources, a stretch of its plain words.

    Keyed by ``file:label``. The stretch is the longest run of the body free of markup (math,
    code, emphasis), so that it reads the same in the source and in the rendered HTML.
    """
    import re

    out: dict[str, str] = {}
    for path in map(Path, sources):
        if path.suffix == ".ipynb":
            import nbformat
            texts = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"]
        else:
            texts = [path.read_text()]
        for text in texts:
            for m in re.finditer(r"^(:::+|```+)\{solution\}\s*(\S*)\s*\n(.*?)^\1\s*$", text, re.S | re.M):
                body = "\n".join(l for l in m.group(3).splitlines() if not l.lstrip().startswith(":"))
                runs = re.split("[" + re.escape(_MARKUP) + "]", body)
                best = max((_words(r) for r in runs), key=len, default="")
                if len(best.split()) < 3:
                    raise ValueError(f"{path}: the solution {m.group(2)!r} has no plain-text stretch of 3 words "
                                     "to look for in the HTML")
                out[f"{path.name}:{m.group(2)}"] = best
    return out


def _html_text(folder: Path) -> str:
    import html
    import re

    pages = sorted(folder.rglob("*.html"))
    if not pages:
        raise FileNotFoundError(f"no HTML pages under {folder}: build the book first")
    text = " ".join(re.sub(r"<[^>]+>", " ", p.read_text(errors="replace")) for p in pages)
    return _words(html.unescape(text))


def _words(text: str) -> str:
    """Letters and digits only: typography (smart quotes, dashes) differs between source and HTML."""
    import re

    return " " + " ".join(re.findall(r"[A-Za-z0-9]+", text)) + " "


def check_student_edition(normal: str | Path, student: str | Path, sources: Iterable[str | Path],
                          masters: Iterable[str | Path] = ()) -> int:
    """Fail unless every solution's text, and every chapter function a master lists in ``book_answers``,
    is in the normal build and none is in the student build. Returns how many were checked."""
    from capslib.tools.student_edition import answer_sources, book_answers, leaked_answers

    sources = [Path(s) for s in sources]
    fragments = solution_fragments(sources)
    if not fragments:
        raise ValueError("no {solution} blocks found in the sources")
    copies = sorted(str(p.relative_to(student)) for p in Path(student).rglob("_sources/**/*")
                    if p.suffix in (".ipynb", ".md", ".txt"))
    if copies:   # Sphinx's copies of the sources (the download button's files) hold everything
        raise AssertionError(f"the student edition {student} holds copies of the book's sources: {copies[:5]}")
    normal_text, student_text = _html_text(Path(normal)), _html_text(Path(student))
    # a stretch may also occur outside its solution: what counts is that the student edition
    # holds fewer copies than the book, i.e. the solution's own copy is gone
    missing = [k for k, f in fragments.items() if f not in normal_text]
    leaked = [k for k, f in fragments.items() if student_text.count(f) >= normal_text.count(f)]
    answers = book_answers(masters)
    code = answer_sources({p.stem: p for p in sources if p.suffix == ".ipynb"}, answers)
    code_missing, code_leaked = leaked_answers(normal_text, student_text, code)
    if missing or code_missing:
        raise AssertionError(f"solution text or answering code not found in the normal build {normal} (the check "
                             f"would be vacuous): {missing + code_missing}")
    if leaked or code_leaked:
        raise AssertionError(f"solution text or a chapter's answer to an assignment found in the student edition "
                             f"{student}: {leaked + code_leaked}")
    return len(fragments) + len(code)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m capslib.tools.grading",
                                     description="Student notebooks and autograder zips of otter masters")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="otter assign each master into OUT/<master name>/")
    b.add_argument("masters", nargs="+")
    b.add_argument("--out", required=True)
    b.add_argument("--variants", type=int, default=int(os.environ.get("VARIANTS") or 1),
                   help="build this many variants of each master that declares them (default: $VARIANTS, else 1: "
                        "the master only); a master with fewer declared variants builds all it has")
    b.add_argument("--secret", default=os.environ.get("GRADING_SECRET") or None,
                   help="seeds the hidden tests' inputs (default: $GRADING_SECRET, else a fresh random secret "
                        "per assignment); written into each autograder zip only")
    c = sub.add_parser("student-config", help="write the student edition's Jupyter Book config")
    c.add_argument("--source", default="_config.yml")
    c.add_argument("--dest", default="_build/student/_config.yml")
    c.add_argument("--masters", nargs="*", help="otter masters whose book_answers to leave out "
                   "(default: book/assignments/*.ipynb beside --source)")
    k = sub.add_parser("check-student", help="no solution text in the student edition, all of it in the book")
    k.add_argument("--normal", required=True)
    k.add_argument("--student", required=True)
    k.add_argument("--masters", nargs="*", default=(), help="otter masters whose book_answers must be "
                   "in the book and not in the student edition")
    k.add_argument("sources", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "student-config":
        print(student_config(args.source, args.dest, args.masters))
        return 0
    if args.command == "check-student":
        n = check_student_edition(args.normal, args.student, args.sources, args.masters)
        print(f"student edition: none of the {n} solutions and chapter answers to assignments appears in "
              f"{args.student}; all appear in {args.normal}")
        return 0
    for m in args.masters:
        dest = Path(args.out) / Path(m).stem
        n = min(args.variants, 1 + len(variants_of(m)))
        zip_path = build(m, dest, args.secret, variants=n)
        handouts = f"{dest}/student" + "".join(f", {dest}/student-v{k}" for k in range(1, n))
        print(f"{m} -> {handouts} (hand out{', one variant per student' if n > 1 else ''}), {zip_path} "
              f"(upload to Gradescope or grade with otter run)")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
