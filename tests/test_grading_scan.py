"""The static scan of submissions (``capslib.tools.grading_scan``, issue 35 item 2): each cheating
form of the issue's audit that a reading of the source can see is flagged, and every master
solution in ``book/assignments/`` is clean. Fast: no otter, no grading run."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

import capslib.tools.grading as grading
from capslib.tools.grading_scan import NO_AUTOGRAD, Finding, allowed_imports, no_autograd, scan, scan_cells

ROOT = Path(__file__).resolve().parents[1]
MASTERS = sorted((ROOT / "book" / "assignments").glob("*.ipynb"))


def _kinds(findings: list[Finding]) -> set[str]:
    return {f.kind for f in findings}


def _solution_cells(master: Path) -> tuple[list[str], list[str]]:
    """The master's code as a solved submission holds it (test cells dropped), and the handed-out part."""
    nb = nbformat.read(master, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code" and "BEGIN TEST CONFIG" not in c.source]
    return cells, [c for c in cells if "BEGIN SOLUTION" not in c]


# ----------------------------------------------------------------------------- delegation to capslib

@pytest.mark.parametrize("src", [
    "import capslib\n",
    "import capslib.rem as r\n",
    "import capslib.tools.grading\n",
    "from capslib.rem import quantize as q\n",
    "from capslib import squash\n",
    "def my_squash(s):\n    import capslib\n    return capslib.squash(s)\n",
    "m = __import__('capslib.rem')\n",
    "def f():\n    return __import__('capslib').squash\n",
])
def test_capslib_imports_in_any_form_are_flagged(src):
    found = scan(src)
    assert "capslib" in _kinds(found) or "exec" in _kinds(found), found
    assert all(f.reason and f.line >= 1 for f in found)


def test_dunder_import_and_importlib_are_flagged():
    assert {"capslib", "exec"} <= _kinds(scan("m = __import__('capslib.rem')\n"))
    src = "import importlib\nm = importlib.import_module('capslib.rem')\n"
    found = scan(src)
    assert {"capslib", "importlib"} <= _kinds(found)
    assert {f.line for f in found if f.kind == "importlib"} == {1, 2}
    assert "importlib" in _kinds(scan("import importlib as il\n"))
    assert "importlib" in _kinds(scan("from importlib import import_module\nimport_module('torch')\n"))
    assert "importlib" in _kinds(scan("import importlib.util\n"))
    assert "importlib" in _kinds(scan("f = __builtins__.__import__\n"))


@pytest.mark.parametrize("src", ["exec('x = 1')\n", "y = eval('1 + 1')\n", "c = compile('1', 'f', 'eval')\n",
                                 "run = exec\n", "import builtins\nbuiltins.exec('x = 1')\n"])
def test_exec_eval_compile_are_flagged(src):
    assert "exec" in _kinds(scan(src)), scan(src)


def test_lookalike_methods_are_not_exec():
    src = ("import re, torch\nnet = torch.nn.Linear(2, 2)\nnet.eval()\npat = re.compile('a')\n"
           "fast = torch.compile\n")
    assert scan(src) == []


# ----------------------------------------------------------------------------- tampering with modules

@pytest.mark.parametrize("src", [
    "import torch\ntorch.testing.assert_close = lambda *a, **k: None\n",
    "import torch as T\nT.equal = lambda a, b: True\n",
    "import otter\notter.Notebook.check = lambda self, q: None\n",
    "import torch\nt = torch\nt.allclose = lambda *a, **k: True\n",
    "import torch\nsetattr(torch.testing, 'assert_close', print)\n",
    "import torch\ndelattr(torch, 'allclose')\n",
    "import torch\ndel torch.testing.assert_close\n",
    "import torch\nvars(torch)['equal'] = print\n",
    "import torch\ntorch.__dict__['equal'] = print\n",
    "import sys\nsys.modules['capslib'] = None\n",
    "import torch.autograd as ag\nag.grad = print\n",
    "from torch import testing\ntesting.assert_close = print\n",
])
def test_attribute_assignment_on_modules_is_flagged(src):
    found = scan(src)
    assert "module-attribute" in _kinds(found), found


def test_attribute_assignment_on_objects_is_not_flagged():
    src = ("import torch\nclass Box:\n    pass\nb = Box()\nb.value = 3\nnet = torch.nn.Linear(2, 2)\n"
           "net.weight.data = torch.zeros(2, 2)\nsetattr(b, 'other', 1)\n")
    assert scan(src) == []


# ----------------------------------------------------------------------------- autograd where forbidden

_AUTOGRAD_FORMS = {
    "autograd.grad": "import torch\ndef my_g(x):\n    x = x.requires_grad_()\n    return torch.autograd.grad(x.sum(), x)[0]\n",
    "backward": "import torch\ndef my_g(x):\n    x = x.clone().requires_grad_()\n    (x ** 2).sum().backward()\n    return x.grad\n",
    "torch.func": "import torch\ndef my_g(x):\n    return torch.func.jacrev(torch.sin)(x)\n",
    "from torch.func": "from torch.func import jacrev\ndef my_g(x):\n    return jacrev(lambda t: t.sin())(x)\n",
    "functional.jacobian": "from torch.autograd.functional import jacobian\ndef my_g(x):\n    return jacobian(lambda t: t.sin(), x)\n",
    "from torch import autograd": "from torch import autograd\ndef my_g(x):\n    return autograd.grad(x.sum(), x)\n",
    "alias saved earlier": "import torch\nG = torch.autograd.grad\ndef my_g(x):\n    return G(x.sum(), x)\n",
    "helper": "import torch\ndef _helper(x):\n    return torch.autograd.grad(x.sum(), x)\ndef my_g(x):\n    return _helper(x)\n",
    "getattr": "import torch\ndef my_g(x):\n    return getattr(torch, 'autograd').grad(x.sum(), x)\n",
    "vjp": "from torch.func import vjp\ndef my_g(x):\n    return vjp(lambda t: t, x)\n",
}


@pytest.mark.parametrize("form", sorted(_AUTOGRAD_FORMS))
def test_autograd_is_flagged_where_forbidden(form):
    src = _AUTOGRAD_FORMS[form]
    found = scan(src, {"autograd:my_g"})
    assert "autograd" in _kinds(found), (form, found)
    assert "autograd" in _kinds(scan(src, {"autograd"})), form
    assert "autograd" not in _kinds(scan(src)), form          # allowed when no question forbids it


def test_autograd_ban_is_scoped_to_the_function():
    src = ("import torch\ndef my_g(x):\n    return 2 * x\n"
           "def check(x):\n    x = x.requires_grad_()\n    (x ** 2).sum().backward()\n    return x.grad\n")
    assert scan(src, {"autograd:my_g"}) == []
    found = scan(src, {"autograd:check"})
    assert [f.function for f in found] == ["check"] and found[0].line == 6
    assert "check must not use autograd" in found[0].reason


def test_forbidden_entries_are_checked():
    with pytest.raises(ValueError, match="autograd:<function name>"):
        scan("x = 1\n", {"numpy"})


# ----------------------------------------------------------------------------- notebooks

def test_cells_are_one_program_and_findings_name_their_cell():
    cells = ["import torch\n", "G = torch.autograd.grad\n", "def my_g(x):\n    return G(x.sum(), x)\n",
             "x = (\n", "import capslib\n"]
    found = scan_cells(cells, {"autograd:my_g"})
    by_kind = {f.kind: f for f in found}
    assert set(by_kind) == {"autograd", "syntax", "capslib"}
    assert (by_kind["autograd"].cell, by_kind["autograd"].line) == (1, 1)
    assert by_kind["syntax"].cell == 3                       # reported, and it hides nothing after it
    assert (by_kind["capslib"].cell, by_kind["capslib"].line) == (4, 1)
    assert str(by_kind["capslib"]).startswith("cell 4, line 1: imports capslib")


def test_handed_out_imports_are_allowed_and_only_those():
    given = ["import torch\nfrom capslib.soft_routing import SoftRoutingNet   # you may use it\n"]
    allowed = allowed_imports(given)
    assert allowed == {"from capslib.soft_routing import SoftRoutingNet"}
    ok = given + ["def my_f(net):\n    return net.R\n"]
    assert scan_cells(ok, allowed=allowed) == []
    bad = ok + ["from capslib.soft_routing import manual_gradients\n"]
    assert [f.cell for f in scan_cells(bad, allowed=allowed)] == [2]


def test_uninstall_is_not_public():
    assert not hasattr(grading, "uninstall")
    with grading.guarded(["capslib.squash"]):
        assert grading.installed() == ("capslib.squash",)
        with pytest.raises(RuntimeError, match="only the guarded"):
            grading._uninstall(None)
        assert grading.installed() == ("capslib.squash",)
    assert grading.installed() == ()


def test_every_no_autograd_function_is_in_its_master():
    names = {m.stem for m in MASTERS}
    assert set(NO_AUTOGRAD) <= names
    for stem, fns in NO_AUTOGRAD.items():
        cells, _ = _solution_cells(ROOT / "book" / "assignments" / f"{stem}.ipynb")
        for fn in fns:
            assert any(c.lstrip().startswith(f"def {fn}(") for c in cells), (stem, fn)


@pytest.mark.parametrize("master", MASTERS, ids=[m.stem for m in MASTERS])
def test_master_solutions_are_clean(master):
    cells, given = _solution_cells(master)
    assert any("BEGIN SOLUTION" in c for c in cells)
    assert scan_cells(cells, no_autograd(master.stem), allowed=allowed_imports(given)) == []
    # and the scan is not blind on this notebook: a delegating line added to it is caught
    tampered = cells + ["import capslib as _c\n"]
    assert [f.kind for f in scan_cells(tampered, no_autograd(master.stem), allowed=allowed_imports(given))] \
        == ["capslib"]
