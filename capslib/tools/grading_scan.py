"""A static scan of a submission's code for delegation and forbidden tools (issue 35, item 2).

The run-time guard of :mod:`capslib.tools.grading` stops a graded function from reaching capslib's
implementation while grading; this scan reads the submission's source *before* anything runs and
flags the constructs an honest solution never needs:

* any import of capslib -- ``import capslib...``, ``from capslib... import``, ``__import__("capslib")``,
  ``importlib.import_module("capslib...")`` -- except the import statements the assignment itself hands
  out (``allowed``, e.g. a3's ``from capslib.soft_routing import SoftRoutingNet``);
* ``exec``, ``eval``, ``compile`` and ``__import__`` (used or merely named), ``importlib`` and
  ``builtins`` in any form;
* attribute assignment (``=``, ``+=``, ``del``, ``setattr``, ``vars(m)[...] =``) on a module-like name:
  a name the submission bound by an import, or one of the well-known module names (``torch``,
  ``otter``, ``np``, ...);
* where a question forbids autograd: ``torch.autograd`` (any ``.autograd`` attribute), ``torch.func``,
  ``functorch``, ``.backward(...)``, and calls of ``grad``/``jacrev``/``jacfwd``/``vjp``/``jvp``/
  ``hessian``/``jacobian``/``vmap``-free functional transforms by name.

``forbidden`` says where autograd is forbidden: ``"autograd"`` for the whole source, or
``"autograd:my_fn"`` for the function ``my_fn`` and everything it reaches by name among the
submission's top-level definitions (functions, classes, assignments, imports), so a helper or a
module-level alias (``G = torch.autograd.grad``) used by ``my_fn`` is flagged as well.

The scan is deliberately conservative (an honest master solution produces no finding; tested for every
master in ``tests/test_grading_scan.py``) and it is not a sandbox: a name built at run time
(``getattr(torch, "auto" + "grad")``) passes it. It is a second line beside the run-time guard.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterable

#: names that are modules in any reasonable notebook, whether or not the scanned source imports them
KNOWN_MODULES = frozenset({"torch", "otter", "capslib", "np", "numpy", "math", "sys", "os", "builtins",
                           "importlib", "F", "nn", "plt", "matplotlib", "functools", "inspect", "types",
                           "gc", "random", "operator", "scipy", "sns", "seaborn", "pytest", "unittest"})
_CODE_RUNNERS = frozenset({"exec", "eval", "compile", "__import__"})
_AUTOGRAD_CALLS = frozenset({"grad", "jacrev", "jacfwd", "vjp", "jvp", "hessian", "jacobian", "vhp", "hvp",
                             "functional_call", "grad_and_value"})
_AUTOGRAD_STRINGS = frozenset({"autograd", "torch.autograd", "torch.func", "functorch", "backward"})

#: the graded functions whose question forbids autograd, per assignment (from the questions' text:
#: "no autograd" / "without autograd"); ``scan(..., forbidden=no_autograd(name))``
NO_AUTOGRAD: dict[str, tuple[str, ...]] = {
    "a1_squash_and_margin": ("my_squash_jacobian", "my_margin_grad"),
    "a3_soft_routing_gradients": ("my_manual_gradients",),
    "a4_coupling_gradient": ("my_gradient_terms",),
    "a7_products_of_expert_capsules": ("my_data_term",),
}


def no_autograd(assignment: str) -> frozenset[str]:
    """The ``forbidden`` set for an assignment: ``autograd:<fn>`` for each function in :data:`NO_AUTOGRAD`."""
    return frozenset(f"autograd:{fn}" for fn in NO_AUTOGRAD.get(assignment, ()))


@dataclass(frozen=True)
class Finding:
    """One flagged construct: where it is (cell index when known, 1-based line) and why."""
    line: int
    reason: str
    cell: int | None = None
    function: str | None = None   # the top-level function it sits in, None at module level
    kind: str = ""                # "capslib", "exec", "importlib", "module-attribute", "autograd"

    def __str__(self) -> str:
        where = (f"cell {self.cell}, " if self.cell is not None else "") + f"line {self.line}"
        inside = f" (in {self.function})" if self.function else ""
        return f"{where}{inside}: {self.reason}"


def _root(node: ast.AST) -> str | None:
    """The name at the root of ``a.b.c`` / ``a.b[0].c`` / ``a().b``, or None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # pragma: no cover - unparse handles every expression node
        return "<expression>"


def _is_capslib(module: str | None) -> bool:
    return bool(module) and (module == "capslib" or module.startswith("capslib."))


def _normalise_import(stmt: str) -> str:
    return ast.unparse(ast.parse(stmt.strip()).body[0])


def allowed_imports(given_sources: Iterable[str]) -> frozenset[str]:
    """The capslib import statements in the code an assignment hands out (its non-solution cells)."""
    out = set()
    for src in given_sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _is_capslib(node.module):
                out.add(ast.unparse(node))
            elif isinstance(node, ast.Import) and any(_is_capslib(a.name) for a in node.names):
                out.add(ast.unparse(node))
    return frozenset(out)


class _Scanner(ast.NodeVisitor):
    def __init__(self, modules: set[str], allowed: frozenset[str], autograd: bool):
        self.modules = modules
        self.allowed = allowed
        self.autograd = autograd
        self.found: list[tuple[int, str, str]] = []

    def flag(self, node: ast.AST, kind: str, reason: str) -> None:
        self.found.append((getattr(node, "lineno", 0), kind, reason))

    # imports -------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if _is_capslib(a.name) and ast.unparse(node) not in self.allowed:
                self.flag(node, "capslib", f"imports {a.name}: the graded work must not use capslib")
            top = a.name.split(".")[0]
            if top in ("importlib", "builtins"):
                self.flag(node, "importlib", f"imports {a.name}: dynamic imports and builtins are not allowed")
            if self.autograd and (a.name.startswith(("torch.autograd", "torch.func")) or top == "functorch"):
                self.flag(node, "autograd", f"imports {a.name}: this question forbids autograd")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if _is_capslib(module) and ast.unparse(node) not in self.allowed:
            self.flag(node, "capslib", f"imports from {module}: the graded work must not use capslib")
        top = module.split(".")[0]
        if top in ("importlib", "builtins"):
            self.flag(node, "importlib", f"imports from {module}: dynamic imports and builtins are not allowed")
        names = {a.name for a in node.names}
        if self.autograd and (module.startswith(("torch.autograd", "torch.func")) or top == "functorch"
                              or (module == "torch" and names & {"autograd", "func"})):
            self.flag(node, "autograd", f"imports from {module}: this question forbids autograd")

    # names and attributes --------------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        if node.id in _CODE_RUNNERS:
            self.flag(node, "exec", f"uses {node.id}: running code built from strings is not allowed")
        elif node.id in ("importlib", "__builtins__", "builtins"):
            self.flag(node, "importlib", f"uses {node.id}: dynamic imports and builtins are not allowed")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            root = _root(node.value)
            if root in self.modules:
                verb = "assigns" if isinstance(node.ctx, ast.Store) else "deletes"
                self.flag(node, "module-attribute",
                          f"{verb} {_dotted(node)}: changing a module's attributes is not allowed")
        if node.attr in _CODE_RUNNERS and _root(node) in ("builtins", "__builtins__"):
            self.flag(node, "exec", f"uses {_dotted(node)}: running code built from strings is not allowed")
        if self.autograd:
            if node.attr == "autograd":
                self.flag(node, "autograd", f"uses {_dotted(node)}: this question forbids autograd")
            elif node.attr == "func" and _root(node) in self.modules:
                self.flag(node, "autograd", f"uses {_dotted(node)}: this question forbids autograd (torch.func)")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        # vars(torch)["x"] = ..., torch.__dict__["x"] = ..., sys.modules["capslib"] = ...
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            base = node.value
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "vars" \
                    and base.args and _root(base.args[0]) in self.modules:
                self.flag(node, "module-attribute", f"writes {_dotted(node)}: changing a module's namespace is not allowed")
            elif isinstance(base, ast.Attribute) and _root(base) in self.modules:
                self.flag(node, "module-attribute", f"writes {_dotted(node)}: changing a module's namespace is not allowed")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        first = node.args[0] if node.args else None
        const = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
        if name in ("setattr", "delattr") and isinstance(f, ast.Name) and first is not None \
                and (_root(first) in self.modules or isinstance(first, ast.Call)):
            self.flag(node, "module-attribute", f"calls {name} on {_dotted(first)}: changing a module's "
                      "attributes is not allowed")
        if name in ("import_module", "__import__") and const is not None and _is_capslib(const):
            self.flag(node, "capslib", f"imports {const} dynamically: the graded work must not use capslib")
        if self.autograd:
            if name == "backward" and isinstance(f, ast.Attribute):
                self.flag(node, "autograd", f"calls {_dotted(f)}(): this question forbids autograd")
            elif name in _AUTOGRAD_CALLS:
                self.flag(node, "autograd", f"calls {_dotted(f)}(): this question forbids autograd")
            if name in ("getattr", "import_module", "__import__") and any(
                    isinstance(a, ast.Constant) and a.value in _AUTOGRAD_STRINGS for a in node.args):
                self.flag(node, "autograd", f"reaches autograd through {_dotted(node)}: this question forbids it")
        self.generic_visit(node)


def _bound_modules(tree: ast.AST) -> set[str]:
    """Names the source binds by an import (``import a.b`` binds ``a``; ``from x import y as z`` binds ``z``)."""
    names = set(KNOWN_MODULES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name != "*":
                    names.add(a.asname or a.name)
    for _ in range(3):   # aliases of module-like names: ``t = torch``, ``tt = torch.testing``
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Name, ast.Attribute)) \
                    and _root(node.value) in names:
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _top_level_bindings(tree: ast.Module) -> dict[str, list[ast.stmt]]:
    out: dict[str, list[ast.stmt]] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(stmt.name, []).append(stmt)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out.setdefault(n.id, []).append(stmt)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for a in stmt.names:
                out.setdefault(a.asname or a.name.split(".")[0], []).append(stmt)
    return out


def _reachable(start: str, bindings: dict[str, list[ast.stmt]]) -> list[ast.stmt]:
    """The top-level statements ``start`` reaches by name, transitively (``start``'s own definition first)."""
    seen_names, stmts, todo = set(), [], [start]
    while todo:
        name = todo.pop()
        if name in seen_names or name not in bindings:
            continue
        seen_names.add(name)
        for stmt in bindings[name]:
            if any(stmt is s for s in stmts):
                continue
            stmts.append(stmt)
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                continue
            todo.extend(n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id != name)
    return stmts


def _function_of(tree: ast.Module) -> list[tuple[int, int, str]]:
    return [(s.lineno, s.end_lineno or s.lineno, s.name) for s in tree.body
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def scan(source: str, forbidden: Iterable[str] = frozenset(), *, allowed: Iterable[str] = frozenset(),
         cell: int | None = None) -> list[Finding]:
    """The findings in ``source`` (one cell or a whole notebook's code joined), in line order.

    Args:
        source: Python source. IPython magics and shell lines (``%...``, ``!...``) are blanked first.
        forbidden: ``"autograd"`` (autograd forbidden in the whole source) and/or ``"autograd:NAME"``
            (forbidden in the function ``NAME`` and what it reaches by name).
        allowed: import statements that the assignment hands out and that may import from capslib.
        cell: the cell index to report with each finding.
    A source that does not parse gives one finding of kind ``"syntax"`` (the scan cannot vouch for it).
    """
    forbidden = set(forbidden)
    unknown = {f for f in forbidden if f != "autograd" and not f.startswith("autograd:")}
    if unknown:
        raise ValueError(f"forbidden entries must be 'autograd' or 'autograd:<function name>'; got {sorted(unknown)}")
    allowed_norm = frozenset(_normalise_import(a) for a in allowed)
    lines = [("" if l.lstrip().startswith(("%", "!")) else l) for l in source.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError as e:
        return [Finding(e.lineno or 0, f"the code does not parse ({e.msg}), so it cannot be checked", cell,
                        None, "syntax")]
    modules = _bound_modules(tree)
    raw: dict[tuple[int, str, str], None] = {}
    base = _Scanner(modules, allowed_norm, autograd="autograd" in forbidden)
    base.visit(tree)
    raw.update(dict.fromkeys(base.found))
    scoped = sorted(f.split(":", 1)[1] for f in forbidden if f.startswith("autograd:"))
    if scoped and "autograd" not in forbidden:
        bindings = _top_level_bindings(tree)
        for fn in scoped:
            sc = _Scanner(modules, allowed_norm, autograd=True)
            for stmt in _reachable(fn, bindings):
                sc.visit(stmt)
            for line, kind, reason in sc.found:
                if kind == "autograd":
                    raw[(line, kind, reason.replace("this question forbids", f"{fn} must not use"))] = None
    spans = _function_of(tree)
    out = []
    for line, kind, reason in sorted(raw):
        fn = next((name for a, b, name in spans if a <= line <= b), None)
        out.append(Finding(line, reason, cell, fn, kind))
    return out


def scan_cells(cells: Iterable[str], forbidden: Iterable[str] = frozenset(), *,
               allowed: Iterable[str] = frozenset()) -> list[Finding]:
    """:func:`scan` over a notebook's code cells, in order, as one program (a helper defined in one
    cell and used in another is followed); each finding names its cell (index in ``cells``)."""
    cells = list(cells)
    starts, joined, syntax, at = [], [], [], 1
    for i, src in enumerate(cells):
        starts.append(at)
        text = src if src.endswith("\n") else src + "\n"
        bad = [f for f in scan(src, (), allowed=allowed, cell=i) if f.kind == "syntax"]
        if bad:   # a cell that does not parse is reported and blanked, so it cannot hide the others
            syntax.extend(bad)
            text = "\n" * text.count("\n")
        joined.append(text)
        at += text.count("\n")
    out = list(syntax)
    for f in scan("".join(joined), forbidden, allowed=allowed):
        i = max(k for k, s in enumerate(starts) if s <= f.line)
        out.append(Finding(f.line - starts[i] + 1, f.reason, i, f.function, f.kind))
    return out


def reachable_definitions(cells: Iterable[str], name: str) -> set[str]:
    """The top-level functions and classes that ``name`` reaches by name in the notebook's code cells
    (itself included when it is one); empty when the code does not parse or ``name`` is not defined."""
    lines = [("" if l.lstrip().startswith(("%", "!")) else l) for l in "\n".join(cells).splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return set()
    return {s.name for s in _reachable(name, _top_level_bindings(tree))
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
