"""The spread table: every claim on a trained number, measured over seeds and thread counts.

``python -m capslib.tools.spread`` (``make spread``) executes the chapters at the ``ci`` profile once
per (seed, thread count) with ``$CAPSBOOK_CLAIMS_LOG`` set, so that each
:func:`capslib.book.claims.check` logs its value instead of asserting it, and gathers the values
in ``book/results/ci_spread.json``: per claim the bound, every run's value, mean, standard
deviation, the worst run and its margin. A run keeps its checkpoints and results apart
(``$CAPSBOOK_TAG``) and removes them when it ends. Chapters of one (seed, threads) run in
order, in one job, because chapter 7 reads chapter 2's checkpoint.

    python -m capslib.tools.spread --seeds 0 1 2 3 4 --threads 2            # five seeds, two threads
    python -m capslib.tools.spread --seeds 0 1 2 3 4 --threads 1 --jobs 2   # the same at one thread, two at a time
    python -m capslib.tools.spread --table                                  # the Markdown table of the file
    python -m capslib.tools.spread --rebound    # bounds moved or claims withdrawn in the notebooks: re-judge the same values

Measurements merge into the existing file (a run replaces the values of its own seed,
thread count, processor and chapters), so the table can be refreshed a chapter at a time. Each
run records its processor (:func:`cpu_name`): processors can differ in the last bits of a
computation, and a training carries such a difference to another outcome, so runs of the same
seed on two processors are two measurements, both kept. Runs measured before processors were
recorded (2026-11-23) have none.

A run belongs to one version of its chapter: the chapter's code cells (``source``) and the library code
it computes with (``library``, :func:`library_digest`). Measuring a chapter drops its runs of any other
version; a change that cannot move a measured value is declared with ``--restamp WHY --from-rev REV``
(``tests/test_spread_restamp.py`` fails while a run of the committed file belongs to another version).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..book.claims import margin, read_log
from ..book.session import cpu_name
from ..book.spread import SPREAD_FILE, glue_claim, stats  # noqa: F401 - the readers live with the book

ROOT = Path(__file__).resolve().parent.parent.parent
BOOK = ROOT / "book"
LOCK_FILE = ROOT / "requirements.lock"
# seconds one cell may take; every ci cell takes well under it, so reaching it means a hung execution
CELL_TIMEOUT = 300


def chapters() -> list[Path]:
    """The chapter notebooks, in order (the scoreboard and assignments have no trained claims)."""
    return sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))


def run_key(seed: int, threads: int, cpu: str | None = None) -> str:
    """A run's name: seed, thread count and, for runs that recorded it, the processor."""
    return f"seed {seed}, {threads} thread{'s' if threads > 1 else ''}" + (f", {cpu}" if cpu else "")


def _one_job(seed: int, threads: int, notebooks: list[Path], workdir: Path, cell_timeout: int = CELL_TIMEOUT) -> dict:
    """Execute ``notebooks`` in order at ci under ``seed`` and ``threads``; their logged claims."""
    tag = f"spread-s{seed}-t{threads}"
    env = dict(os.environ, CAPSBOOK_PROFILE="ci", CAPSBOOK_PROGRESS="0", CAPSBOOK_SEED=str(seed), CAPSBOOK_THREADS=str(threads),
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), CAPSBOOK_TAG=tag,
               CAPSBOOK_FRAMES_DIR=str(workdir / tag / "_static" / "frames"),   # players' frames stay out of the book
               CAPSBOOK_PHONE_FIGURES="0")   # and no phone drawings are made: these outputs are not kept
    env.pop("CAPSBOOK_SMOKE", None)
    out = {}
    try:
        for nb in notebooks:
            log = workdir / f"{tag}-{nb.stem}.jsonl"
            log.unlink(missing_ok=True)
            env["CAPSBOOK_CLAIMS_LOG"] = str(log)
            digest = source_digest(nb)   # the code about to run, read now: the file may be edited while a spread runs
            library = library_digest()
            for attempt in (1, 2):  # a cell that times out (a lost kernel message) is executed once more
                log.unlink(missing_ok=True)
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, "-m", "capslib.tools.execute", f"--timeout={cell_timeout}",
                     "--output-dir", str(workdir / tag), str(nb)],
                    env=env, capture_output=True, text=True, cwd=ROOT)
                seconds = time.perf_counter() - t0
                if proc.returncode == 0 or "CellTimeoutError" not in proc.stderr:
                    break
                print(f"{run_key(seed, threads)}: {nb.stem} timed out in a cell; executing it once more", flush=True)
            error = None
            if proc.returncode != 0:
                lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
                error = " | ".join(lines[-3:])[-600:]
            out[nb.stem] = {"claims": read_log(log), "seconds": round(seconds, 1), "error": error, "source": digest,
                            "library": library}
            print(f"{run_key(seed, threads)}: {nb.stem} {seconds:.0f} s"
                  + (f", {len(out[nb.stem]['claims'])} claims" if not error else f", ERROR {error}"), flush=True)
    finally:
        from ..data import DATA_DIR
        for d in (DATA_DIR / "checkpoints" / f"ci-{tag}", BOOK / "results" / f"ci-{tag}", workdir / tag):
            shutil.rmtree(d, ignore_errors=True)
    return out


def source_digest(nb_path: Path) -> str:
    """A digest of a chapter's code cells: the version of the experiment a measurement belongs to (the
    digest a chapter's recorded results carry)."""
    from ..book.results import code_digest

    return code_digest(nb_path)


def _is_library_source(rel: str) -> bool:
    """Whether a path (relative to the repository root, with /) is library code a chapter computes with:
    capslib's Python sources, but for its commands (``capslib/tools``), which run chapters and compute none
    of their numbers."""
    return rel.startswith("capslib/") and rel.endswith(".py") and not rel.startswith("capslib/tools/")


def _digest_files(files: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha1()
    for rel, body in sorted(files):
        h.update(rel.encode() + b"\0" + body + b"\0")
    return h.hexdigest()[:12]


def library_digest(root: Path = ROOT) -> str:
    """A digest of the library code the chapters compute with (see :func:`_is_library_source`): the other
    half of the version a measurement belongs to. A library change can move a trained number as surely as
    an edit to the chapter: on 2026-11-28 a new rounding order in dynamic routing moved the numbers of every
    CapsNet chapter while their notebooks stayed as they were."""
    files = [(p.relative_to(root).as_posix(), p.read_bytes()) for p in (root / "capslib").rglob("*.py")]
    return _digest_files([(rel, body) for rel, body in files if _is_library_source(rel)])


def library_digest_at(rev: str) -> str:
    """:func:`library_digest` of the library as committed at git revision ``rev``."""
    listing = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "--", "capslib"], cwd=ROOT,
                             capture_output=True, text=True)
    if listing.returncode != 0:
        raise ValueError(f"restamp: git cannot list the library at {rev!r}")
    files = []
    for rel in (ln for ln in listing.stdout.splitlines() if _is_library_source(ln)):
        body = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True)
        if body.returncode != 0:
            raise ValueError(f"restamp: git cannot show {rel} at {rev!r}")
        files.append((rel, body.stdout))
    return _digest_files(files)


def notebook_claims(notebooks: list[Path] | None = None) -> dict[str, dict]:
    """Every ``claims.check(...)`` call in the chapters, read from their source (nothing runs):
    name -> {"chapter", "bound", "limit"}. Bounds must be literal numbers."""
    import ast

    import nbformat

    from ..book.claims import BOUNDS

    found: dict[str, dict] = {}
    for nb_path in notebooks or chapters():
        for cell in nbformat.read(nb_path, as_version=4).cells:
            if cell.cell_type != "code" or "claims.check" not in cell.source:
                continue
            code = "\n".join(ln for ln in cell.source.splitlines() if not ln.lstrip().startswith(("%", "!")))
            for node in ast.walk(ast.parse(code)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "check"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "claims"):
                    name = ast.literal_eval(node.args[0])
                    kws = [k for k in node.keywords if k.arg in BOUNDS]
                    if len(kws) != 1:
                        raise ValueError(f"{nb_path.name}: claim {name!r} must give exactly one bound")
                    if name in found:
                        raise ValueError(f"{nb_path.name}: claim {name!r} is made twice")
                    try:
                        limit = float(ast.literal_eval(kws[0].value))
                    except ValueError:
                        raise ValueError(f"{nb_path.name}: claim {name!r}: its bound must be a literal number, since the "
                                         f"spread reads it from the source; got {ast.unparse(kws[0].value)}") from None
                    found[name] = {"chapter": nb_path.stem, "bound": kws[0].arg, "limit": limit}
    return found


def rebound(path: Path = SPREAD_FILE, notebooks: list[Path] | None = None) -> dict:
    """Re-read every claim's bound from the notebooks and recompute the summary. The measured values
    do not depend on the bounds (a spread run logs, it does not assert), so a bound moved after a
    measurement is judged against the same values without re-running anything. A claim that no chapter
    makes any more (withdrawn because it failed in a run, say) leaves the table: it holds what the
    chapters assert."""
    table = json.loads(path.read_text())
    bounds = notebook_claims(notebooks)
    for entry in table["runs"].values():
        for res in entry["chapters"].values():
            res["claims"] = [c for c in res["claims"] if c["name"] in bounds]
            for c in res["claims"]:
                c["bound"], c["limit"] = bounds[c["name"]]["bound"], bounds[c["name"]]["limit"]
    table["claims"] = summarise(table["runs"])
    _write(table, path)
    return table


def rename_claim(path: Path, old: str, new: str) -> int:
    """Give a claim another name in every run and in the summary, its values untouched (a name that said
    more than the claim measures, say). The chapter's code changes with it, so its runs then need
    :func:`restamp`. Returns the number of runs renamed; refuses a name no run has or one already taken."""
    table = json.loads(path.read_text())
    if not new.strip() or new == old:
        raise ValueError("rename_claim: the new name must be non-empty and differ from the old one")
    names = {c["name"] for e in table.get("runs", {}).values() for r in e["chapters"].values() for c in r["claims"]}
    if old not in names:
        raise ValueError(f"rename_claim: no run measured a claim named {old!r}")
    if new in names:
        raise ValueError(f"rename_claim: a claim named {new!r} is measured already")
    renamed = 0
    for entry in table["runs"].values():
        for res in entry["chapters"].values():
            for c in res["claims"]:
                if c["name"] == old:
                    c["name"] = new
                    renamed += 1
    table["claims"] = summarise(table["runs"])
    _write(table, path)
    return renamed


def _write(table: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".json.tmp")
    tmp_path.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp_path, path)


def _lock_digest() -> str | None:
    return hashlib.sha1(LOCK_FILE.read_bytes()).hexdigest()[:12] if LOCK_FILE.exists() else None


def measure(seeds: list[int], threads: list[int], notebooks: list[Path], jobs: int = 1,
            path: Path = SPREAD_FILE, cell_timeout: int = CELL_TIMEOUT) -> dict:
    """Run every (seed, threads) job, merge the measurements into ``path`` and return the table
    (``cell_timeout``: seconds one cell may take, longer on a machine that other work shares). Each run
    carries the digests of the code it executed (the chapter's and the library's), read just before it
    started; runs of a version other than the chapter's code when the spread ends are dropped, with a line
    saying so for those of this spread."""
    with tempfile.TemporaryDirectory(prefix="capsbook-spread-") as tmp:
        configs = [(s, t) for t in threads for s in seeds]
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            results = list(pool.map(lambda st: (st, _one_job(st[0], st[1], notebooks, Path(tmp), cell_timeout)),
                                    configs))
    import torch

    # read the file only now: another measurement may have merged into it meanwhile
    table = json.loads(path.read_text()) if path.exists() else {}
    runs = table.setdefault("runs", {})
    cpu = cpu_name()
    digests = {nb.stem: source_digest(nb) for nb in notebooks}   # the chapters' code now, after the runs
    library = library_digest()
    for (seed, t), by_chapter in results:
        entry = runs.setdefault(run_key(seed, t, cpu), {"seed": seed, "threads": t, "cpu": cpu, "chapters": {}})
        for chapter, res in by_chapter.items():
            entry["chapters"][chapter] = dict(res, torch=torch.__version__, lock=_lock_digest(),
                                              measured=time.strftime("%Y-%m-%d %H:%M"), jobs=jobs)
            entry["chapters"][chapter].setdefault("source", digests[chapter])
            entry["chapters"][chapter].setdefault("library", library)
            if entry["chapters"][chapter]["source"] != digests[chapter]:
                print(f"{run_key(seed, t, cpu)}: {chapter} was edited after this run started; its values are "
                      "dropped: measure the chapter again", flush=True)
            elif entry["chapters"][chapter]["library"] != library:
                print(f"{run_key(seed, t, cpu)}: the library changed after this run started; its values of "
                      f"{chapter} are dropped: measure the chapter again", flush=True)
    # values measured on another version of a chapter just re-measured (its code or the library's) would mix
    # two experiments: drop them
    for key in list(runs):
        chs = runs[key]["chapters"]
        for chapter in [c for c in chs if c in digests
                        and (chs[c].get("source"), chs[c].get("library")) != (digests[c], library)]:
            del chs[chapter]
        if not chs:
            del runs[key]
    table["machine"] = f"{platform.machine()}, {os.cpu_count()} cores"
    table.setdefault("processors", {})[cpu] = time.strftime("%Y-%m-%d %H:%M")
    table["claims"] = summarise(runs)
    _write(table, path)
    return table


def summarise(runs: dict) -> dict:
    """Per claim: bound, values per run, n, mean, std, min, max, the worst run and its margin."""
    by_claim: dict[str, dict] = {}
    for key, entry in runs.items():
        for chapter, res in entry["chapters"].items():
            for c in res["claims"]:
                d = by_claim.setdefault(c["name"], {"chapter": chapter, "bound": c["bound"], "limit": c["limit"],
                                                    "values": {}})
                if (d["bound"], d["limit"]) != (c["bound"], c["limit"]):
                    d["bound_changed"] = True  # measured under another bound: re-measure
                    d["bound"], d["limit"] = c["bound"], c["limit"]
                d["values"][key] = c["value"]
    for name, d in by_claim.items():
        vals = [v for v in d["values"].values() if not math.isnan(v)]
        margins = {k: margin(v, d["bound"], d["limit"]) for k, v in d["values"].items()}
        worst = min(margins, key=lambda k: (not math.isnan(margins[k]), margins[k]))
        seeds = {runs[k]["seed"] for k in d["values"]}
        d.update(n=len(d["values"]), seeds=len(seeds),
                 mean=statistics.fmean(vals) if vals else float("nan"),
                 std=statistics.stdev(vals) if len(vals) > 1 else 0.0,
                 min=min(vals) if vals else float("nan"), max=max(vals) if vals else float("nan"),
                 worst_run=worst, worst_value=d["values"][worst], worst_margin=margins[worst],
                 holds_in_every_run=all(m > 0 or (m == 0 and d["bound"] in ("at_least", "at_most"))
                                        for m in margins.values()))
        runs_of = [(runs[k]["seed"], runs[k]["threads"], runs[k].get("cpu"), v) for k, v in d["values"].items()]
        diffs = [abs(v1 - v2) for s1, t1, c1, v1 in runs_of for s2, t2, c2, v2 in runs_of
                 if s1 == s2 and c1 == c2 and t1 < t2]
        d["max_thread_difference"] = max(diffs) if diffs else None
        # the same seed and thread count on two processors (a run without a recorded one counts as one)
        across = [abs(v1 - v2) for s1, t1, c1, v1 in runs_of for s2, t2, c2, v2 in runs_of
                  if s1 == s2 and t1 == t2 and str(c1) < str(c2)]
        d["processors"] = len({c for _, _, c, _ in runs_of})
        d["max_processor_difference"] = max(across) if across else None
    return dict(sorted(by_claim.items()))


def restamp(path: Path, notebooks: list[Path], why: str, previous: dict[str, str],
            previous_library: str | None = None) -> list[str]:
    """Declare each chapter's current code (its cells and the library's) the version its measurements
    belong to, after a change that cannot move a measured value (a figure's size, say; the person
    restamping checks that, e.g. by a re-execution whose glued numbers come out identical). Only runs
    measured on the version named by ``previous`` (chapter -> digest, see :func:`digest_at`) and
    ``previous_library`` (:func:`library_digest_at`; None: the library is the current one) move, or on
    that chapter code with the current library, or the current chapter code with that library: each gets
    the current digests, and the old ones go into its ``restamped`` list with ``why`` and the date, so
    the next ``measure`` of one thread count does not drop the other's runs as another experiment.
    Runs of any other version stay as they are. Returns one line per chapter."""
    if not why.strip():
        raise ValueError("restamp: why must say why the measurements still hold for the current code")
    table = json.loads(path.read_text())
    digests = {nb.stem: source_digest(nb) for nb in notebooks}
    library = library_digest()
    libraries = {library, previous_library or library}
    changed: dict[str, int] = {}
    others: dict[str, int] = {}
    for entry in table.get("runs", {}).values():
        for chapter, res in entry["chapters"].items():
            if chapter not in digests or (res.get("source"), res.get("library")) == (digests[chapter], library):
                continue
            if res.get("source") not in (previous.get(chapter), digests[chapter]) or res.get("library") not in libraries:
                others[chapter] = others.get(chapter, 0) + 1
                continue
            stamp = {"from": res.get("source"), "on": time.strftime("%Y-%m-%d %H:%M"), "why": why.strip()}
            if res.get("library") != library:
                stamp["from_library"] = res.get("library")
            res.setdefault("restamped", []).append(stamp)
            res["source"], res["library"] = digests[chapter], library
            changed[chapter] = changed.get(chapter, 0) + 1
    if changed:
        _write(table, path)
    return [f"{chapter}: {changed.get(chapter, 0)} run(s) restamped to {digests[chapter]}"
            + (f"; {others[chapter]} run(s) of another version left as they are" if chapter in others else "")
            for chapter in sorted(set(changed) | set(others))]


def digest_at(rev: str, nb_path: Path) -> str:
    """:func:`source_digest` of a notebook as it was at git revision ``rev``."""
    from ..book.results import digest_at_commit

    digest = digest_at_commit(rev, nb_path.resolve())
    if digest is None:
        raise ValueError(f"restamp: git cannot show {nb_path.name} at {rev!r}")
    return digest


def markdown(table: dict) -> str:
    """The table as Markdown (one row per claim), for docs/claims.md."""
    words = {"above": ">", "at_least": "≥", "below": "<", "at_most": "≤"}
    rows = ["| claim | bound | runs (seeds, processors) | mean ± sd | worst run | worst margin | "
            "1 vs 2 threads, max diff | between processors, max diff |",
            "|---|---|---|---|---|---|---|---|"]
    for name, d in table["claims"].items():
        thr = d.get("max_thread_difference")
        shown = name.replace("|", r"\|")  # a literal bar would end the Markdown cell
        cpu = d.get("max_processor_difference")
        rows.append(f"| {shown} | {words[d['bound']]} {d['limit']:g} | {d['n']} ({d['seeds']}, {d.get('processors', 1)}) | "
                    f"{d['mean']:.4g} ± {d['std']:.2g} | {d['worst_value']:.4g} ({d['worst_run']}) | "
                    f"{d['worst_margin']:.3g}{'' if d['holds_in_every_run'] else ' **fails**'} | "
                    f"{'—' if thr is None else f'{thr:.2g}'} | {'—' if cpu is None else f'{cpu:.2g}'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--jobs", type=int, default=1, help="jobs at once (use 2 only with --threads 1 on 2 cores)")
    ap.add_argument("--chapters", nargs="+", default=None, help="chapter numbers, e.g. 02 05 (default: all)")
    ap.add_argument("--table", action="store_true", help="print the Markdown table of the spread file and stop")
    ap.add_argument("--rebound", action="store_true",
                    help="re-read the bounds from the notebooks, recompute the summary, print the table and stop")
    ap.add_argument("--restamp", metavar="WHY",
                    help="mark the chosen chapters' runs measured on the code of --from-rev as measured on their "
                         "current code, saying WHY the change cannot have moved a measurement, and stop")
    ap.add_argument("--from-rev", metavar="REV", help="with --restamp: the git revision the runs were measured on")
    ap.add_argument("--rename-claim", nargs=2, metavar=("OLD", "NEW"),
                    help="rename a claim in every run (values kept), print the count and stop; restamp its chapter after")
    ap.add_argument("--file", type=Path, default=SPREAD_FILE)
    ap.add_argument("--cell-timeout", type=int, default=CELL_TIMEOUT,
                    help=f"seconds one cell may take before it counts as hung (default {CELL_TIMEOUT}; more where the "
                         "machine is shared)")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown(json.loads(args.file.read_text())))
        return 0
    if args.rebound:
        print(markdown(rebound(args.file)))
        return 0
    if args.rename_claim:
        try:
            print(f"{rename_claim(args.file, *args.rename_claim)} run(s) renamed")
        except ValueError as err:
            ap.error(str(err))
        return 0
    notebooks = chapters()
    if args.chapters:
        wanted = {c.zfill(2) for c in args.chapters}
        notebooks = [nb for nb in notebooks if nb.stem[:2] in wanted]
        if not notebooks:
            ap.error(f"--chapters: none of {sorted(wanted)} is a chapter; have {[nb.stem[:2] for nb in chapters()]}")
    if args.restamp is not None:
        if not args.chapters or not args.from_rev:
            ap.error("--restamp needs --chapters (whose change cannot move a measurement) and --from-rev "
                     "(the revision their runs were measured on)")
        try:
            previous = {nb.stem: digest_at(args.from_rev, nb) for nb in notebooks}
            lines = restamp(args.file, notebooks, args.restamp, previous, library_digest_at(args.from_rev))
        except ValueError as err:
            ap.error(str(err))
        print("\n".join(lines) or "nothing to restamp: every run already carries its chapter's current digest")
        return 0
    if any(t < 1 for t in args.threads) or args.jobs < 1 or args.cell_timeout < 1:
        ap.error("--threads, --jobs and --cell-timeout must be >= 1")
    table = measure(args.seeds, args.threads, notebooks, jobs=args.jobs, path=args.file, cell_timeout=args.cell_timeout)
    print(markdown(table))
    failing = [n for n, d in table["claims"].items() if not d["holds_in_every_run"]]
    errors = [(k, ch) for k, e in table["runs"].items() for ch, r in e["chapters"].items() if r["error"]]
    for k, ch in errors:
        print(f"error in {ch} ({k})")
    if failing:
        print("claims that fail in at least one run:", ", ".join(failing))
    return 1 if failing or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
