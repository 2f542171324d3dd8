"""The package's three rooms and the direction of their imports: tools -> book -> library.

``capslib`` (the library a reader reuses) imports neither ``capslib.book`` (the book's machinery) nor
``capslib.tools`` (the commands); the book never imports the commands. Every import is read from the
source (module level and inside functions alike) and also checked at run time in a fresh interpreter.
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "capslib"

# Library modules allowed to import named book modules while their split is pending: none now
# (the list may only shrink; an entry names the module and the book modules it may import).
PENDING_SPLIT: dict[str, set] = {}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every capslib module ``path`` imports, relative imports resolved (``from . import x`` gives
    ``package.x``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("capslib")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("capslib"):
                continue
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}   # from capslib.book import viz
    return found


def _within(mod: str, allowed: set) -> bool:
    return any(mod == a or mod.startswith(a + ".") for a in allowed)


def _room(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("book", "tools") else "library"


def _modules():
    return sorted(p for p in PKG.rglob("*.py"))


def test_the_three_rooms_exist_and_hold_what_the_design_names():
    names = {_module_name(p) for p in _modules()}
    for mod in ("capslib.ops", "capslib.routing", "capslib.train", "capslib.data", "capslib.engine.steps",
                "capslib.engine.checkpoints", "capslib.engine.switches", "capslib.book.session",
                "capslib.book.profiles", "capslib.book.results", "capslib.book.units", "capslib.book.ch02",
                "capslib.tools.bench", "capslib.tools.experiments", "capslib.tools.grading"):
        assert mod in names, mod
    for gone in ("capslib.session", "capslib.profiles", "capslib.viz", "capslib.bench", "capslib.grading",
                 "capslib.steps", "capslib.checkpoints", "capslib.switches", "capslib.timing"):
        assert gone not in names, f"{gone} is still in the library's room"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: _module_name(p))
def test_imports_point_tools_to_book_to_library(path):
    mod = _module_name(path)
    room = _room(mod)
    ups = {m for m in _imports(path) if _room(m) in ("book", "tools") and m not in ("capslib.book", "capslib.tools")
           and _room(m) != room}
    if room == "library":
        allowed = PENDING_SPLIT.get(mod, set())
        bad = sorted(m for m in ups if not _within(m, allowed))
        assert not bad, f"{mod} (library) imports {bad}"
        if mod not in PENDING_SPLIT:   # their "from .book import profiles" names capslib.book too
            assert not {m for m in _imports(path) if m in ("capslib.book", "capslib.tools")}, mod
    elif room == "book":
        assert not {m for m in ups if _room(m) == "tools"}, f"{mod} (book) imports the commands {sorted(ups)}"


def test_pending_splits_still_need_their_allowance():
    """An allowance a module no longer uses is dropped from the list (the list only shrinks)."""
    for mod, allowed in PENDING_SPLIT.items():
        path = PKG.parent / (mod.replace(".", "/") + ".py")
        used = {m for m in _imports(path) if _room(m) == "book"}
        unused = sorted(a for a in allowed if not any(_within(m, {a}) for m in used))
        assert not unused, f"{mod} no longer imports {unused}: remove it from PENDING_SPLIT"


def test_the_library_runs_without_loading_the_book():
    """Import every library module but the pending ones, train a step and load data, in a fresh
    interpreter: neither capslib.book nor capslib.tools is loaded."""
    lib = [_module_name(p) for p in _modules() if _room(_module_name(p)) == "library"
           and _module_name(p) not in PENDING_SPLIT and _module_name(p) != "capslib"]
    code = (f"import sys, importlib, torch\nfor m in {lib!r}: importlib.import_module(m)\n"
            "from capslib import data, models, train\n"
            "net = models.CapsNet(conv_channels=4, primary_types=2, primary_dim=4, digit_dim=4, decoder=(8,))\n"
            "x, y = torch.rand(4, 1, 28, 28), torch.arange(4)\n"
            "step = lambda m, xb, yb: (models.capsnet_loss(m(xb, yb), xb, yb), m(xb).lengths)\n"
            "train.fit(net, data.Split(x, y), step, epochs=1, batch_size=2, progress=False)\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('capslib.book', 'capslib.tools')))\n"
            "assert not bad, bad\nprint('clean')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-2000:]


# The design holds every library module to about 500 lines (the book's and the commands' modules are not
# held to it), and the reader-facing part, capslib's top-level modules, to about 4,500 lines in all: the
# chapters' experiment code lives in capslib.book, the machinery fit runs on in capslib.engine.
MAX_LINES = 500
READER_FACING_LINES = 4500
LIBRARY_FILES = sorted(PKG.glob("*.py")) + sorted((PKG / "engine").glob("*.py"))


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: p.stem)
def test_library_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PKG.parent)} has {lines} lines; the library keeps a module to {MAX_LINES}"


def test_the_reader_facing_library_stays_within_its_budget():
    """What a student opens beside the routing they derived: capslib's top-level modules, in all."""
    counts = {p.name: len(p.read_text().splitlines()) for p in PKG.glob("*.py")}
    total = sum(counts.values())
    assert total <= READER_FACING_LINES, (
        f"capslib/*.py has {total} lines (over {READER_FACING_LINES}); largest: "
        f"{sorted(counts.items(), key=lambda kv: -kv[1])[:5]}: move experiment code to capslib.book")


def test_the_engine_holds_only_what_fit_and_load_run_on():
    """capslib.engine is imported by the library's train and data (and by the book and the commands),
    never by a chapter's teaching modules: a reader of routing, layers or models meets none of it."""
    teaching = {"ops", "routing", "layers", "models", "em", "em_layers", "soft_routing", "coupling_gradient",
                "rem", "pruning", "poe", "poe_models", "multimnist", "pitfalls"}
    for name in teaching:
        found = _imports(PKG / f"{name}.py")
        assert not {m for m in found if m.startswith("capslib.engine")}, f"capslib.{name} imports the engine"


# ----------------------------------------------------------------------------- what the chapters and README say

BOOK_DIR = PKG.parent / "book"


def _code_cells(nb_path: Path) -> str:
    import nbformat

    return "\n".join(c.source for c in nbformat.read(nb_path, as_version=4).cells if c.cell_type == "code")


@pytest.mark.parametrize("nb_path", sorted(BOOK_DIR.glob("*.ipynb")), ids=lambda p: p.stem)
def test_no_chapter_imports_the_commands(nb_path):
    """Chapters (and the scoreboard) take what they teach from capslib and their plumbing from
    capslib.book; the commands (capslib.tools) are run, never imported by a page. The assignments,
    which a grader runs, are not chapters."""
    code = "\n".join(ln for ln in _code_cells(nb_path).splitlines() if not ln.lstrip().startswith(("%", "!")))
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    assert not {m for m in found if m == "capslib.tools" or m.startswith("capslib.tools.")}, (nb_path.name, found)
    assert "capslib.tools" not in code.replace("capslib.tools.", ""), nb_path.name


def _readme_layout() -> dict[str, str]:
    """The README's Layout block, cut into the three rooms' paragraphs."""
    text = (PKG.parent / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    lines = block.splitlines()
    start = {key: next(i for i, ln in enumerate(lines) if ln.startswith(prefix))
             for key, prefix in (("library", "  *.py"), ("book", "  book/"), ("tools", "  tools/"))}
    end = next(i for i, ln in enumerate(lines) if i > start["tools"] and not ln.startswith(" "))
    return {"library": "\n".join(lines[start["library"]:start["book"]]),
            "book": "\n".join(lines[start["book"]:start["tools"]]),
            "tools": "\n".join(lines[start["tools"]:end])}


def test_readme_layout_names_every_module_in_its_room():
    """Every module of the tree is named in its room's lines of the README's Layout block, and every
    name listed there as a module exists in that room."""
    import re

    rooms = _readme_layout()
    tree = {"library": ({p.stem for p in PKG.glob("*.py")} | {p.stem for p in (PKG / "engine").glob("*.py")}
                        | {"engine"}) - {"__init__"},
            "book": {p.stem for p in (PKG / "book").glob("*.py")} - {"__init__"},
            "tools": {p.stem for p in (PKG / "tools").glob("*.py")} - {"__init__"}}
    for room, mods in tree.items():
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", rooms[room]))
        missing = sorted(m for m in mods if m not in words)
        assert not missing, f"README's Layout does not name {missing} among the {room} modules"
    # the names the README lists as modules: the library's comma list and aligned column, the tools' list
    lib_listed = set(re.findall(r"^\s{2,}([a-z_]+)\s{2,}\S", rooms["library"], re.M))
    lib_listed |= set(re.findall(r"[a-z_]+", rooms["library"].split(":", 1)[1].split(";", 1)[0]))
    tools_listed = set(re.findall(r"\b[a-z]+_[a-z_]+\b", rooms["tools"]))   # snake_case names: modules
    assert lib_listed <= tree["library"], sorted(lib_listed - tree["library"])
    assert tools_listed <= tree["tools"], sorted(tools_listed - tree["tools"])
