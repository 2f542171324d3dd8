"""``python -m capslib.tools.smoke [--profile full] [notebook ...]``: does a profile run end to end?

Executes the chapters with ``CAPSBOOK_SMOKE=1`` (see :mod:`capslib.book.profiles`): the profile's
networks and code paths, but at most two epochs and a few hundred images, checkpoints and
results under ``<profile>-smoke``. The executed copies go to ``_build/smoke/<profile>/`` (the
committed notebooks are not touched). Every cell runs even after an error, and the errors are
sorted into two kinds:

- a claim of the chapter that a two-epoch run cannot meet (an accuracy floor, say), or a bare
  ``AssertionError``. Listed, expected, not a failure. ``claims.check`` only logs in a smoke run (as in a
  spread run), so the rest of the claim's cell still runs.
- anything else (a shape mismatch, a missing key, a dtype clash, running out of memory): the
  profile would crash. Listed, and the command exits with status 1.

Run it on a GPU machine before ``make reproduce`` (``make smoke``); on a CPU it still checks
every ``full`` code path, slowly.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def chapter_notebooks() -> list[Path]:
    book = ROOT / "book"
    return sorted(book.glob("[0-9]*.ipynb")) + [book / "scoreboard.ipynb"]


def run_notebook(path: Path, out_dir: Path, profile: str, timeout: int | None = None) -> dict:
    """Execute one notebook in a smoke run; returns its seconds and errors by kind."""
    import nbformat

    from ..book.claims import LOG_ENV, not_met, read_log
    from .execute import client as notebook_client, environment

    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"{path.stem}.claims.jsonl"
    log.unlink(missing_ok=True)
    # claims.check logs instead of raising (as in a spread run), so a claim a two-epoch run cannot meet does not
    # stop the rest of its cell, whose names later cells read; the players' frames and phone drawings of these
    # copies stay out of the book's tracked folder
    env = environment(profile, CAPSBOOK_SMOKE="1", CAPSBOOK_FRAMES_DIR=str(out_dir / "_static" / "frames"),
                      CAPSBOOK_PHONE_FIGURES="0", **{LOG_ENV: str(log)})  # for the kernel only
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    client = notebook_client(nb, path, timeout=timeout, allow_errors=True)
    claims, crashes = [], []
    try:
        client.execute(env=env)
    except Exception as err:  # the kernel died (out of memory, usually) or a cell timed out
        ran = [i for i, c in enumerate(nb.cells) if c.get("execution_count") is not None]
        where = f"cell {ran[-1]}" if ran else "the first cell"
        crashes.append(f"{where}: {type(err).__name__}: {str(err).strip()[:200]} (no later cell ran)")
    seconds = time.perf_counter() - start
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") != "error":
                continue
            line = f"cell {index}: {output['ename']}: {output['evalue'][:300]}"
            (claims if output["ename"] == "AssertionError" else crashes).append(line)
    claims += [not_met(c["name"], c["value"], c["bound"], c["limit"]) for c in read_log(log) if not c["holds"]]
    nbformat.write(nb, out_dir / path.name)
    return {"seconds": seconds, "claims": claims, "crashes": crashes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m capslib.tools.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every chapter and the scoreboard")
    parser.add_argument("--profile", default="full", choices=["ci", "full"])
    parser.add_argument("--timeout", type=int, default=None, help="seconds per cell (default: none)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the smoke checkpoints of an earlier smoke run (default: train afresh)")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or chapter_notebooks()
    missing = [str(p) for p in notebooks if not Path(p).exists()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    out_dir = ROOT / "_build" / "smoke" / args.profile
    if not args.resume:  # a loaded checkpoint would skip the training code this run is meant to check
        from ..data import DATA_DIR
        shutil.rmtree(DATA_DIR / "checkpoints" / f"{args.profile}-smoke", ignore_errors=True)
    failed = 0
    for path in notebooks:
        report = run_notebook(Path(path).resolve(), out_dir, args.profile, args.timeout)
        status = "CRASH" if report["crashes"] else "ok"
        print(f"{status:5s} {Path(path).name}: {report['seconds']:.0f} s, "
              f"{len(report['claims'])} claim(s) not met at smoke scale, {len(report['crashes'])} crash(es)",
              flush=True)
        for line in report["claims"]:
            print(f"      claim  {line}")
        for line in report["crashes"]:
            print(f"      CRASH  {line}")
        failed += bool(report["crashes"])
    print(f"executed copies in {out_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
