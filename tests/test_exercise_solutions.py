"""The Python in the chapters' exercise solutions, checked against the chapters and capslib.

A solution's code is never executed by the chapter it sits in (it is Markdown, in a dropdown), so nothing
else would notice when a function it calls is renamed, loses a keyword, or a profile setting it reads goes
away. For every ``python`` block of every ``{solution}``:

* it parses;
* every name it reads is bound by the block itself, by the chapter's code cells, or is a builtin;
* every ``module.attribute`` it reads, where the chapter imported ``module``, exists, and a call of it
  passes only keywords the function accepts;
* every setting it reads from the chapter's profile (``cfg.x``, ``S.x``) is a setting of that chapter.

The blocks that need nothing of the chapter are run, and two solutions whose text states a result are run
on small inputs with that result asserted.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import types
from pathlib import Path

import nbformat
import pytest
import torch

from capslib.book import profiles

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "book").glob("0*.ipynb"))
SOLUTION = re.compile(r":::\{solution\}\s*(\S+)(.*?)\n:::", re.S)
PYTHON = re.compile(r"```python\n(.*?)```", re.S)
IPYTHON_NAMES = {"display", "get_ipython"}   # what a notebook's kernel adds to the builtins


def solution_blocks(nb) -> list[tuple[str, str]]:
    """``(exercise label, code)`` of every python block inside a solution of the notebook."""
    return [(m.group(1), code) for cell in nb.cells if cell.cell_type == "markdown"
            for m in SOLUTION.finditer(cell.source) for code in PYTHON.findall(m.group(2))]


def _code(nb) -> str:
    # IPython lines (magics, shell escapes) are not Python
    return "\n".join("\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
                     for cell in nb.cells if cell.cell_type == "code")


def bound_names(tree: ast.AST) -> set[str]:
    """Every name a tree binds anywhere: assignments, loop and with targets, imports, definitions and their
    arguments, comprehension targets, exception names."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def chapter_modules(tree: ast.AST) -> dict[str, types.ModuleType]:
    """The names the chapter's imports bind to modules (``from capslib import poe``, ``import numpy as np``)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = importlib.import_module(a.name)
                else:
                    top = a.name.split(".")[0]
                    out[top] = importlib.import_module(top)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                try:
                    out[a.asname or a.name] = importlib.import_module(f"{node.module}.{a.name}")
                except ModuleNotFoundError:
                    pass          # a function or class, not a module
    return out


def settings_names(tree: ast.AST, chapter: str) -> dict[str, str]:
    """Names the chapter binds to a profile's settings (``cfg = profiles.settings(CHAPTER)``): name -> chapter."""
    out = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "settings" and node.value.args):
            arg = node.value.args[0]
            out[node.targets[0].id] = arg.value if isinstance(arg, ast.Constant) else chapter
    return out


CASES = [(path, label, code) for path in CHAPTERS for label, code in solution_blocks(nbformat.read(path, 4))]


def test_every_chapter_with_solution_code_is_checked():
    assert len(CASES) >= 10, [label for _, label, _ in CASES]


@pytest.mark.parametrize("path,label,code", CASES, ids=[f"{p.stem[:2]}-{label}" for p, label, _ in CASES])
def test_a_solutions_code_reads_only_what_the_chapter_and_capslib_have(path, label, code):
    nb = nbformat.read(path, 4)
    chapter_tree = ast.parse(_code(nb))
    block = ast.parse(code)                                   # it parses
    known = bound_names(chapter_tree) | bound_names(block) | set(dir(builtins)) | IPYTHON_NAMES
    unknown = sorted({n.id for n in ast.walk(block) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                     - known)
    assert not unknown, f"{label}: reads names nothing binds: {unknown}"

    modules = {**chapter_modules(chapter_tree), **chapter_modules(block)}
    settings = {name: vars(profiles.settings(ch, "ci")) for name, ch in settings_names(chapter_tree, path.stem).items()}
    problems = []
    for node in ast.walk(block):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            continue
        owner, attr = node.value.id, node.attr
        if owner in settings and owner not in bound_names(block) and attr not in settings[owner]:
            problems.append(f"{owner}.{attr} is not a setting of {path.stem}")
        if owner in modules and not hasattr(modules[owner], attr):
            problems.append(f"{owner}.{attr} does not exist ({modules[owner].__name__})")
    for node in ast.walk(block):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in modules):
            continue
        fn = getattr(modules[node.func.value.id], node.func.attr, None)
        if fn is None or not callable(fn):
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            continue
        bad = [k.arg for k in node.keywords if k.arg is not None and k.arg not in sig.parameters]
        if bad:
            problems.append(f"{node.func.value.id}.{node.func.attr} takes no keyword {bad}")
    assert not problems, f"{label}: " + "; ".join(problems)


SELF_CONTAINED = [(label, code) for _, label, code in CASES if label in ("ch1-ex-unsquash", "ch3-ex-softmax")]


@pytest.mark.parametrize("label,code", SELF_CONTAINED, ids=[label for label, _ in SELF_CONTAINED])
def test_a_self_contained_solution_runs_and_its_checks_hold(label, code):
    import capslib
    exec(compile(code, label, "exec"), {"torch": torch, "capslib": capslib})


def test_both_normalisations_train_the_same_w_with_one_iteration_as_the_solution_says():
    """ch7-ex-inputs: with W scaled by a = I/J, the learning rate by a^2 and the l2 weight by 1/a^2, training
    with sum_i c_ij = 1 is a times training with sum_j c_ij = 1 when routing runs one iteration; the solution
    says the reconstruction curves then coincide. Its code, on a small random problem."""
    import capslib
    from capslib import poe_models
    label, code = next((lb, c) for _, lb, c in CASES if lb == "ch7-ex-inputs")
    g = torch.Generator().manual_seed(3)
    I, J, D_in, D_out = 12, 3, 4, 5
    X_train = capslib.squash(torch.randn(64, I, D_in, generator=g))
    W = torch.zeros(I, J, D_out, D_in)
    cfg = types.SimpleNamespace(cd_lr=0.05, cd_l2=1e-3, init_std=0.1, cd_epochs=3, cd_batch=16, cd_momentum=0.5,
                                cd_decay=0.9)
    ns = {"W": W, "X_train": X_train, "cfg": cfg, "torch": torch, "poe_models": poe_models}
    exec(compile(code, label, "exec"), ns)
    out, inp, a = ns["runs"]["outputs"], ns["runs"]["inputs"], ns["a"]
    assert a == I / J
    torch.testing.assert_close(torch.tensor(inp["reconstruction"]), torch.tensor(out["reconstruction"]),
                               rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.tensor(inp["weight_norm"]), a * torch.tensor(out["weight_norm"]),
                               rtol=1e-5, atol=1e-7)
    assert out["weight_norm"][-1] != out["weight_norm"][0]      # W did train


def test_the_orphan_parent_takes_more_from_votes_that_agree_with_nobody_as_the_solution_says():
    """ch2-ex-leaky: on votes like the chapter's toy (20 children agreeing on one parent, 10 on another) plus
    ten of pure noise, the children that agree send more of their output to the real parents than the noise
    does; every child starts at J / (J + 1) and none sends all of it. The solution's code, run as written."""
    import torch.nn.functional as F
    import capslib
    label, code = next((lb, c) for _, lb, c in CASES if lb == "ch2-ex-leaky")
    g = torch.Generator().manual_seed(5)
    I_toy, J_toy, D_toy = 30, 4, 8
    toy = 0.35 * torch.randn(1, I_toy, J_toy, D_toy, generator=g)
    poses = F.normalize(torch.randn(2, D_toy, generator=g), dim=1)
    toy[0, :20, 0] = poses[0] + 0.15 * torch.randn(20, D_toy, generator=g)
    toy[0, 20:, 2] = poses[1] + 0.15 * torch.randn(10, D_toy, generator=g)
    ns = {"toy": toy, "I_toy": I_toy, "J_toy": J_toy, "D_toy": D_toy, "torch": torch, "capslib": capslib}
    exec(compile(code, label, "exec"), ns)
    kept = ns["kept"]
    assert kept.shape == (I_toy + 10,) and bool((kept < 1).all())
    assert kept[:I_toy].mean() > kept[I_toy:].mean() + 0.03, kept
    _, c1 = ns["routing_orphan"](ns["votes"], iterations=1)
    torch.testing.assert_close(c1[0].sum(-1), torch.full((I_toy + 10,), J_toy / (J_toy + 1)))


def _chapter2_toy(seed: int):
    """Votes shaped like chapter 2's toy: 30 children, 4 parents; children 0-19 agree on parent 0, 20-29 on 2."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(seed)
    toy = 0.35 * torch.randn(1, 30, 4, 8, generator=g)
    poses = F.normalize(torch.randn(2, 8, generator=g), dim=1)
    toy[0, :20, 0] = poses[0] + 0.15 * torch.randn(20, 8, generator=g)
    toy[0, 20:, 2] = poses[1] + 0.15 * torch.randn(10, 8, generator=g)
    return toy


def test_scaled_votes_sharpen_the_couplings_as_the_solution_says():
    """ch2-ex-scale: small votes leave the couplings near uniform (1/J = 1/4), large ones put most of a child's
    coupling (here: at least three times the uniform share) on the parent it agrees with, from the first update. The solution's code, run as written on toy votes like the chapter's; what it prints is
    read back."""
    from capslib.routing import routing_trace
    label, code = next((lb, c) for _, lb, c in CASES if lb == "ch2-ex-scale")
    for seed in (0, 1, 2):
        toy, printed = _chapter2_toy(seed), []
        exec(compile(code, label, "exec"), {"toy": toy, "routing_trace": routing_trace,
                                            "print": lambda *a: printed.append(a)})
        alphas, means = [a for a, _ in printed], [m for _, m in printed]
        assert alphas == [0.1, 1, 10] and means == sorted(means), printed
        assert abs(means[0] - 1 / 4) < 0.02 and means[-1] > 3 / 4, printed
        after_one_update = routing_trace(10 * toy, 3)[0][1][0, :20, 0].mean().item()
        assert after_one_update > 3 / 4, after_one_update
