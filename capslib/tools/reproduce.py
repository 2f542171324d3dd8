"""``python -m capslib.tools.reproduce [--profile full] CHAPTER ...``: execute chapters in place, one at a time.

Each notebook (``book/<CHAPTER>*.ipynb``, ``CHAPTER`` a number such as ``02``) is executed
top to bottom with nbclient at the given profile and written back over itself, so that the
committed book shows that profile's outputs. Trainings resume from their configuration-keyed
checkpoints (``data/checkpoints/<profile>/``), so a chapter cut off by a time limit continues
where it stopped on the next call. The execution time is added to the chapter's results file
(``book/results/<profile>/<chapter>.json``, key ``execution_seconds``; the file already holds the
device). With ``CAPSBOOK_TIME_LIMIT`` (seconds) set, a training that reaches the limit
stops at an epoch boundary after writing its checkpoint (:class:`capslib.train.TimeLimitReached`);
the chapter is then reported incomplete, nothing is recorded, and the same command resumes it.
A notebook that raises is not written back (its executed copy goes to
``_build/reproduce/`` for reading) and the command exits with status 1.

**The full edition on a CPU.** At ``--profile full`` on a machine without CUDA the chapters' own
trainings are not re-run (at paper size they would take hours there): every notebook keeps its
committed outputs, and only the cells tagged ``paper-scale`` are executed again, each notebook in a
fresh kernel after its first code cell (``capslib.book.setup()``), so that they draw the committed
experiment-unit results (``book/results/full/``) as they stand. A ``paper-scale`` cell therefore
imports what it uses itself. ``--paper-scale`` asks for this at any profile (``make paper-scale``
refreshes the committed notebooks in place after a GPU allocation committed new results).

This is what ``make reproduce CHAPTERS="02 04"`` runs; it needs no Jupyter server, only
``nbclient`` and ``ipykernel`` (see the offline bundle, ``make bundle``).

``--into DIR`` (what ``make book`` runs) leaves every tracked file alone: the book's sources are
copied into ``DIR``, the copies are executed there (every chapter and the scoreboard with ``all``),
results go to ``DIR/book/results`` (``$CAPSBOOK_RESULTS``), and ``jupyter-book build DIR`` then
publishes them. One line per notebook: its time and profile.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
BOOK = ROOT / "book"


def notebook_of(chapter: str) -> Path:
    """``"02"`` (or ``"2"``, or a notebook's file name) -> ``book/02_....ipynb``."""
    name = Path(chapter).name
    if name.endswith(".ipynb"):
        path = BOOK / name
        if not path.exists():
            raise FileNotFoundError(f"no notebook {path}")
        return path
    if not name.isdigit():
        raise ValueError(f"chapter must be a number such as 02 or a notebook name; got {chapter!r}")
    found = sorted(BOOK.glob(f"{int(name):02d}_*.ipynb"))
    if len(found) != 1:
        raise FileNotFoundError(f"chapter {chapter!r}: expected one book/{int(name):02d}_*.ipynb, found {len(found)}")
    return found[0]


def every_notebook() -> list[Path]:
    """Every chapter in order, then the scoreboard (which reads their results)."""
    return sorted(BOOK.glob("[0-9]*.ipynb")) + [BOOK / "scoreboard.ipynb"]


# What ``--into`` copies: the book's configuration and sources, never results or checkpoints.
SOURCES = ("_config.yml", "_toc.yml", "references.bib")


def stage(into: Path) -> Path:
    """Copy the book's sources into ``into`` (emptied first); returns the copied ``book`` folder."""
    into = Path(into).resolve()
    if into == ROOT or ROOT.is_relative_to(into) or into.is_relative_to(BOOK):
        raise ValueError(f"--into must be a folder outside the book's sources; got {into}")
    shutil.rmtree(into, ignore_errors=True)
    (into / "book").mkdir(parents=True)
    for name in SOURCES:
        shutil.copy2(ROOT / name, into / name)
    for path in BOOK.iterdir():
        if path.is_file() and path.suffix in (".md", ".ipynb", ".yml", ".bib"):
            shutil.copy2(path, into / "book" / path.name)
    for folder in ("_static", "_theme"):  # the book's CSS, page template and favicon
        if (BOOK / folder).is_dir():
            shutil.copytree(BOOK / folder, into / "book" / folder)
    return into / "book"


FRAME_FILE = re.compile(r"frames/([0-9a-f]{16})/(?:n?\d+|narrow)[.]png")   # players' frames, phone drawings


def referenced_frames(book: Path = BOOK) -> set[str]:
    """The frame folders (digests) that the players in ``book``'s notebooks load."""
    return {m.group(1) for path in book.rglob("*.ipynb") for m in FRAME_FILE.finditer(path.read_text())}


def prune_frames(book: Path = BOOK) -> list[str]:
    """Remove the frame folders under ``book/_static/frames`` that no notebook loads any more (a re-executed
    player writes its frames under a new digest); returns their names."""
    root = book / "_static" / "frames"
    if not root.is_dir():
        return []
    keep = referenced_frames(book)
    gone = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in keep)
    for name in gone:
        shutil.rmtree(root / name)
    return gone


def execute(path: Path, profile: str, timeout: int | None = None, env: dict | None = None) -> tuple[bool, float, object]:
    """Execute ``path`` at ``profile``; returns (succeeded, seconds, executed notebook)."""
    import nbformat
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    from .execute import client, environment

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    try:
        client(nb, path, timeout=timeout).execute(env=environment(profile, **(env or {})))
        ok = True
    except CellTimeoutError as err:
        print(f"{path.name}: a cell ran past {timeout} s: {str(err)[:300]}", file=sys.stderr)
        ok = False
    except CellExecutionError as err:
        if getattr(err, "ename", "") == "TimeLimitReached":
            print(f"{path.name}: incomplete, {err.evalue}", file=sys.stderr)
        else:
            print(str(err)[-3000:], file=sys.stderr)
        ok = False
    return ok, time.perf_counter() - start, nb


PAPER_SCALE_TAG = "paper-scale"


def paper_scale_cells(nb) -> list[int]:
    """Indices of the cells tagged ``paper-scale`` (code cells only)."""
    return [i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and PAPER_SCALE_TAG in c.get("metadata", {}).get("tags", [])]


def render_paper_scale(path: Path, profile: str, timeout: int | None = None,
                       env: dict | None = None) -> tuple[bool, float, object]:
    """Execute only ``path``'s first code cell and its ``paper-scale`` cells, in that order, in a fresh
    kernel; the paper-scale cells' new outputs replace theirs, every other cell keeps its committed
    outputs. Returns (succeeded, seconds, the whole notebook); a notebook without such cells is
    returned unexecuted."""
    import nbformat
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    from .execute import client, environment

    nb = nbformat.read(path, as_version=4)
    tagged = paper_scale_cells(nb)
    if not tagged:
        return True, 0.0, nb
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    order = [first] + [i for i in tagged if i != first]
    part = nbformat.v4.new_notebook(metadata=nb.metadata)
    part.cells = [nbformat.from_dict(dict(nb.cells[i])) for i in order]
    start = time.perf_counter()
    try:
        # the page's other cells keep their committed outputs: capslib.book.page describes those
        client(part, path, timeout=timeout).execute(env=environment(profile, **{"CAPSBOOK_PAPER_SCALE_ONLY": "1",
                                                                                **(env or {})}))
        ok = True
    except (CellTimeoutError, CellExecutionError) as err:
        print(f"{path.name}: a paper-scale cell failed: {str(err)[-2000:]}", file=sys.stderr)
        ok = False
    if ok:
        for i, cell in zip(order[1:], part.cells[1:]):
            nb.cells[i]["outputs"] = cell["outputs"]
            nb.cells[i]["execution_count"] = cell.get("execution_count")
    return ok, time.perf_counter() - start, nb


def paper_scale_only(profile: str, forced: bool, cuda: bool | None = None) -> bool:
    """Whether a run renders only the paper-scale cells: asked for, or the full profile on a machine
    without CUDA (where the chapters' paper-size trainings would take hours)."""
    if forced:
        return True
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    return profile == "full" and not cuda


def record_wall_time(path: Path, profile: str, seconds: float) -> None:
    """Add the notebook's execution time (kernel start to last cell) to the chapter's results file,
    if the notebook wrote one (``wall_seconds`` there is the session's, from ``capslib.book.setup()``)."""
    results = BOOK / "results" / profile / f"{path.stem}.json"
    if results.exists():
        payload = json.loads(results.read_text())
        payload["execution_seconds"] = round(seconds, 1)
        tmp = results.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m capslib.tools.reproduce", description=__doc__.splitlines()[0])
    p.add_argument("chapters", nargs="+", help="chapter numbers (02 04 ...) or notebook names; 'all': every one")
    p.add_argument("--profile", default="full", choices=["ci", "full", "auto"],
                   help="auto: this machine's (full with a GPU, else ci)")
    p.add_argument("--timeout", type=int, default=None, help="seconds per cell (default: none)")
    p.add_argument("--fresh", action="store_true",
                   help="train everything from scratch: checkpoints in a new empty folder (make publish)")
    p.add_argument("--into", type=Path, default=None,
                   help="execute copies in this folder (tracked files untouched) instead of in place")
    p.add_argument("--paper-scale", action="store_true",
                   help="execute only the cells tagged paper-scale (after each notebook's first code cell); "
                        "the default at --profile full without a GPU")
    a = p.parse_args(argv)
    import nbformat

    from ..book import profiles

    profile = profiles.current() if a.profile == "auto" else a.profile
    paths = every_notebook() if a.chapters == ["all"] else [notebook_of(c) for c in a.chapters]
    only_paper = paper_scale_only(profile, a.paper_scale)
    if only_paper and not a.paper_scale:
        print("full profile without a GPU: every chapter keeps its committed outputs and only its paper-scale "
              "cells are executed, from the committed experiment-unit results", flush=True)
    run = (lambda path, t, env=None: render_paper_scale(path, profile, t, env)) if only_paper else \
        (lambda path, t, env=None: execute(path, profile, t, env))
    what = "paper-scale cells of" if only_paper else "executed"
    if a.fresh:  # the kernels inherit it; earlier checkpoints stay where they were, unused
        fresh = ROOT / "_build" / "publish-checkpoints" / time.strftime("%Y%m%d-%H%M%S")
        fresh.mkdir(parents=True)
        os.environ["CAPSBOOK_CHECKPOINTS"] = str(fresh)
        print(f"training from scratch: checkpoints in {fresh.relative_to(ROOT)}", flush=True)
    if a.into is not None:
        staged = stage(a.into)
        env = {"CAPSBOOK_RESULTS": str(staged / "results"), "CAPSBOOK_FRAMES_DIR": str(staged / "_static" / "frames")}
        failed = 0
        for path in paths:
            copy = staged / path.name
            ok, seconds, nb = run(copy, a.timeout, env)
            nbformat.write(nb, copy)
            print(f"{what if ok else 'FAILED  '} {path.name} at {profile} in {seconds:.0f} s", flush=True)
            failed += not ok
        return 1 if failed else 0
    failed = 0
    for path in paths:
        ok, seconds, nb = run(path, a.timeout)
        if ok:
            nbformat.write(nb, path)
            if not only_paper:
                record_wall_time(path, profile, seconds)
            print(f"{what} {path.name} at {profile} in {seconds:.0f} s", flush=True)
        else:
            out = ROOT / "_build" / "reproduce"
            out.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, out / path.name)
            print(f"FAILED {path.name} after {seconds:.0f} s; executed copy in {out / path.name}", flush=True)
            failed += 1
    gone = prune_frames()
    if gone:
        print(f"removed {len(gone)} frame folder(s) that no player loads any more", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
