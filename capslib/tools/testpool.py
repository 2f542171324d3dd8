"""``make test``'s checks as a pool: the unit tests, every chapter's nbval execution and the HTML builds, two at a time.

On the two-core machine ``make test`` is budgeted for, one process at two torch threads leaves a
core idle much of the time (Python between the kernels, plotting, the kernel's messaging), and
nbval's chapters cannot share a process. Two processes at one thread each keep both cores busy.
Every claim a chapter asserts is measured at one thread as well as two (``make spread``; the
the spread table of docs/claims.md), so the thread count does not change what the test checks.

    python -m capslib.tools.testpool --jobs 2 --threads 1                 # unit tests, chapters 1-7, scoreboard, builds
    python -m capslib.tools.testpool --jobs 1 --threads 2 unit 02          # those only, one at a time

Jobs start longest first (the order of :data:`ORDER`, from measured times) so that the two queues end
close together; a job waits for the jobs it reads from (chapter 7 loads chapter 2's checkpoint).
Each job's output goes to ``_build/test-logs/<job>.log``; a line per finished job is printed, and a
failed job's log tail. A chapter whose cell hit nbval's timeout (a lost kernel message) is executed
once more; any other failure counts at once. The exit status is 1 if any job failed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
LOGS = ROOT / "_build" / "test-logs"
# Longest first, from the jobs' times in the last fresh clones' pools (2026-11-26, 1 thread each: unit
# tests 408-464 s, chapter 4 about 210 s, 2 about 200, 6 165, 5 130, 7 120, 3 70, 1 and scoreboard 20):
# the unit tests once started fifth and ended alone, about 200 s after the other queue
ORDER = ["unit", "04", "02", "06", "05", "07", "03", "01", "html", "student", "scoreboard"]
# The two HTML builds of make test (the strict one and the student edition, about 25-40 s each) read the
# committed notebooks, so they need no chapter to finish: as jobs of the pool they fill the slot that the
# last chapters leave idle instead of running after the pool (about 20-25 s less in all)
BUILDS = {"html": "build-strict", "student": "book-student"}
# job -> jobs that must have finished before it starts (of those in the run): chapter 7 loads chapter 2's
# checkpoint, the scoreboard reads every chapter's results
AFTER = {"07": {"02"}, "scoreboard": {"01", "02", "03", "04", "05", "06", "07"}}
CELL_TIMEOUT = 300


def notebook(job: str) -> Path:
    if job == "scoreboard":
        return ROOT / "book" / "scoreboard.ipynb"
    found = sorted((ROOT / "book").glob(f"{job}_*.ipynb"))
    if len(found) != 1:
        raise ValueError(f"job {job!r}: expected one notebook book/{job}_*.ipynb, found {len(found)}")
    return found[0]


def command(job: str) -> list[str]:
    """The command line of one job: pytest on the unit tests (the slowest listed), nbval on one chapter,
    or one of the Makefile's HTML builds (:data:`BUILDS`)."""
    if job == "unit":
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=12", "tests"]
    if job in BUILDS:
        return ["make", "--no-print-directory", BUILDS[job]]
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
            f"--nbval-cell-timeout={CELL_TIMEOUT}", str(notebook(job).relative_to(ROOT))]


def schedule(jobs: list[str]) -> list[str]:
    """``jobs`` in start order: those of :data:`ORDER` in its order, any other after them."""
    unknown = [j for j in jobs if j not in ORDER]
    return [j for j in ORDER if j in jobs] + unknown


def _run(job: str, env: dict) -> tuple[int, float, Path]:
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{job}.log"
    t0 = time.perf_counter()
    for attempt in (1, 2):
        with open(log, "w") as fh:
            rc = subprocess.run(command(job), cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
        if rc == 0 or job == "unit" or job in BUILDS or attempt == 2 or \
                "Timeout of" not in log.read_text(errors="replace"):
            break
        print(f"{job}: a cell timed out; executing the notebook once more", flush=True)
    return rc, time.perf_counter() - t0, log


def run(jobs: list[str], n_jobs: int = 2, threads: int = 1, profile: str = "ci") -> int:
    """Run ``jobs`` (``"unit"`` or chapter numbers) ``n_jobs`` at a time at ``threads`` torch threads
    each; returns the number of failed jobs."""
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be at least 1, got {n_jobs}")
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    for job in jobs:
        if job != "unit" and job not in BUILDS:
            notebook(job)  # fails now, not in a thread, on a job that names no notebook
    env = dict(os.environ, CAPSBOOK_PROFILE=profile, CAPSBOOK_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads),
               # the players' frames of nbval's executions stay out of the book's tracked folder
               CAPSBOOK_FRAMES_DIR=str(ROOT / "_build" / "test-frames" / "_static" / "frames"),
               # nor are the figures' phone drawings made there (tests/test_reflow.py tests them)
               CAPSBOOK_PHONE_FIGURES="0")
    pending = schedule(jobs)
    done: set[str] = set()
    running: dict[str, threading.Thread] = {}
    failed: list[str] = []
    cond = threading.Condition()

    def work(job: str) -> None:
        rc, seconds, log = _run(job, env)
        what = ("unit tests" if job == "unit" else f"make {BUILDS[job]}" if job in BUILDS
                else f"nbval {notebook(job).name}")
        with cond:
            print(f"{what}: {seconds:.0f} s" + ("" if rc == 0 else f", FAILED (exit {rc}; log {log})"), flush=True)
            if rc != 0:
                lines = log.read_text(errors="replace").splitlines()
                print("\n".join(lines[-60:]), flush=True)
                failed.append(job)
            done.add(job)
            del running[job]
            cond.notify_all()

    with cond:
        while pending or running:
            ready = [j for j in pending if AFTER.get(j, set()) & set(jobs) <= done]
            if ready and len(running) < n_jobs:
                job = ready[0]
                pending.remove(job)
                running[job] = threading.Thread(target=work, args=(job,), daemon=True)
                running[job].start()
                continue
            cond.wait()
    return len(failed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m capslib.tools.testpool", description=__doc__.splitlines()[0])
    p.add_argument("jobs", nargs="*", help="'unit', chapter numbers, 'scoreboard', 'html' and 'student' "
                   "(default: all of them)")
    p.add_argument("--jobs", dest="n_jobs", type=int, default=2, help="jobs at once (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per job (default 1)")
    args = p.parse_args(argv)
    jobs = args.jobs or (["unit"] + sorted(nb.name[:2] for nb in (ROOT / "book").glob("[0-9][0-9]_*.ipynb"))
                         + ["scoreboard", *BUILDS])
    try:
        t0 = time.perf_counter()
        n_failed = run(jobs, args.n_jobs, args.threads)
    except ValueError as exc:
        p.error(str(exc))
    print(f"{len(jobs)} jobs, {args.n_jobs} at a time at {args.threads} thread(s): {time.perf_counter() - t0:.0f} s"
          + (f", {n_failed} failed" if n_failed else ""), flush=True)
    return 1 if n_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
