"""``python -m capslib.tools.allocation``: a short GPU allocation as one command, and its results brought home.

    run --seconds S --out DIR [--jobs N] [--check-seconds C] [--peers P] [--peers-seconds T] [--only KEY ...] [--smoke]
        on the lent machine, from the repository root. First the fast check of the graphed training step
        (``python -m capslib.tools.bench fast-check``), given at most C seconds (0: skipped); if it fails or
        runs out of time, the units train on the static step (``CAPSBOOK_NO_GRAPH=1``). Then, where P
        (default ``.gpu/peers``, ``make peers``) holds the two public implementations, capslib's steps timed
        against theirs (``python -m capslib.tools.side_by_side``; at most T seconds, 0: skipped; its report
        beside the fast check's). Then ``experiments run`` on what is left of the S seconds, less the time
        kept for packing. Last, the
        unit results, the bench reports and the units' logs are packed into DIR/results.tgz, with
        DIR/summary.txt (what ran, each step's seconds and exit status): a lent machine hands back a
        few files, not a tree of them. S is the wall time of the whole command, so give the device call
        a limit a little above it.
    unpack FILE [--root ROOT]
        back here: the archive's files written into the repository, every member checked first (a plain
        file under one of the folders ``run`` packs; no link, no absolute path, no ``..``), then the state
        of every unit whose result came back. Commit the results; ``make paper-scale`` redraws the pages.

Rehearse it on a CPU before an allocation: ``run --seconds 120 --out /tmp/alloc --smoke --check-seconds 0``
(smoke results go to ``book/results/full-smoke/``, which git ignores).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from ..book import units as U
from .experiments import LOG_DIR

PACK_SECONDS = 20.0          # kept back from the budget for packing and the summary
SIDE_BY_SIDE = "side_by_side.json"   # capslib.tools.side_by_side's report, beside the fast check's
ARCHIVE = "results.tgz"


def packed_folders(smoke: bool = False) -> list[str]:
    """The folders, as the archive names them (relative to the repository root), that ``run`` packs and
    ``unpack`` accepts: the unit results, the bench reports, the units' logs."""
    return ["book/results/full-smoke" if smoke else "book/results/full", "book/results/bench", "_build/experiments"]


def _sources(smoke: bool = False) -> list[tuple[str, Path]]:
    """Each packed folder's archive name and where it is on disk: the results where the units write them
    (``$CAPSBOOK_UNITS_RESULTS`` may move them), the bench reports where the plan reads the fast check, the
    runner's logs."""
    on_disk = [U.RESULTS_ROOT / ("full-smoke" if smoke else "full"), U.FAST_CHECK_FILE.parent, LOG_DIR]
    return list(zip(packed_folders(smoke), on_disk))


def _step(name: str, cmd: list[str], seconds: float, env: dict, lines: list[str]) -> int:
    """Run one step with a time limit; note its exit status and seconds in ``lines``."""
    t = time.time()
    try:
        rc = subprocess.run(cmd, cwd=U.ROOT, env=env, timeout=max(seconds, 1.0)).returncode
    except subprocess.TimeoutExpired:
        rc = "timed out"
    lines.append(f"{name}: exit {rc}, {time.time() - t:.0f} s")
    print(lines[-1], flush=True)
    return 0 if rc == 0 else 1


def pack(out: Path, smoke: bool = False, sources: list[tuple[str, Path]] | None = None) -> list[str]:
    """Every plain file of the packed folders (``sources``: archive name and folder on disk, by default
    :func:`_sources`) into ``out/results.tgz``; returns the names they have there."""
    out.mkdir(parents=True, exist_ok=True)
    files = sorted((f"{name}/{p.relative_to(folder).as_posix()}", p) for name, folder in (sources or _sources(smoke))
                   if folder.is_dir() for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    with tarfile.open(out / ARCHIVE, "w:gz") as tar:
        for name, p in files:
            tar.add(p, arcname=name, recursive=False)
    return [name for name, _ in files]


def unpack(archive: Path, root: Path = U.ROOT) -> list[str]:
    """Write the archive's files under ``root`` after checking every member; returns their paths."""
    allowed = {f for smoke in (False, True) for f in packed_folders(smoke)}
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            parts = Path(m.name).parts
            if (not m.isfile() or Path(m.name).is_absolute() or ".." in parts
                    or not any(m.name.startswith(f + "/") for f in allowed)):
                raise ValueError(f"unpack: {m.name!r} is not a result file this tool packs; nothing was written")
        for m in members:
            target = root / m.name
            target.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(m).read()
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
    return [m.name for m in members]


def _run(args) -> int:
    t0 = time.time()
    out = Path(args.out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    lines = [f"allocation of {args.seconds:.0f} s, {args.jobs} unit(s) at a time" + (" (smoke)" if args.smoke else "")]
    if args.check_seconds > 0:   # its report goes where the plan reads it (a rehearsal's stays in DIR)
        out.mkdir(parents=True, exist_ok=True)
        report = out / U.FAST_CHECK_FILE.name if args.smoke else U.FAST_CHECK_FILE
        if _step("fast check", [sys.executable, "-m", "capslib.tools.bench", "fast-check", "--json", str(report)],
                 min(args.check_seconds, args.seconds - PACK_SECONDS), env, lines):
            env["CAPSBOOK_NO_GRAPH"] = "1"
            lines.append("the units train on the static step (CAPSBOOK_NO_GRAPH=1)")
    peers = Path(args.peers)
    if args.peers_seconds > 0 and peers.is_dir():   # issue 30's table: capslib beside the public implementations
        report = out / SIDE_BY_SIDE if args.smoke else U.FAST_CHECK_FILE.parent / SIDE_BY_SIDE
        _step("side by side", [sys.executable, "-m", "capslib.tools.side_by_side", "--peers", str(peers),
                               "--out", str(report)],
              min(args.peers_seconds, args.seconds - PACK_SECONDS - (time.time() - t0)), env, lines)
    elif args.peers_seconds > 0:
        lines.append(f"side by side: skipped, no {peers} (make peers)")
    budget = args.seconds - PACK_SECONDS - (time.time() - t0)
    rc = 1
    if budget > 10:
        cmd = [sys.executable, "-m", "capslib.tools.experiments", "run", "--budget", f"{budget:.0f}",
               "--jobs", str(args.jobs)] + (["--only", *args.only] if args.only else []) + (["--smoke"] if args.smoke else [])
        rc = _step("experiments run", cmd, budget + PACK_SECONDS / 2, env, lines)
    else:
        lines.append(f"no time left for units ({budget:.0f} s)")
    states = [f"  {u.key}: {U.state(u, smoke=args.smoke)[0]}" for u in U.select(args.only)]
    names = pack(out, smoke=args.smoke)
    lines += [f"packed {len(names)} files into {ARCHIVE}; units now:"] + states
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print(f"{len(names)} files in {out / ARCHIVE}; {time.time() - t0:.0f} s in all", flush=True)
    return rc


def _unpack(args) -> int:
    root = Path(args.root).resolve()
    names = set(unpack(Path(args.file), root))
    print(f"{len(names)} files written under {root}")
    for u in U.select():
        for smoke in (False, True):
            if f"{packed_folders(smoke)[0]}/{u.chapter}/{u.name}/s{u.seed}.json" in names:
                state = U.state(u, smoke=smoke)[0] if root == U.ROOT.resolve() else "written"
                print(f"  {u.key}{' (smoke)' if smoke else ''}: {state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="fast check, units inside the time left, results packed for the way back")
    r.add_argument("--seconds", type=float, required=True, help="wall time of the whole command")
    r.add_argument("--out", required=True, help="folder the lent machine hands back ($OUT)")
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--check-seconds", type=float, default=150.0, help="time for the fast check (0: skip it)")
    r.add_argument("--peers", default=".gpu/peers", help="the public implementations' trees (make peers)")
    r.add_argument("--peers-seconds", type=float, default=90.0,
                   help="time for timing capslib against them, when PEERS exists (0: skip it)")
    r.add_argument("--only", nargs="*", help="unit keys or key prefixes")
    r.add_argument("--smoke", action="store_true", help="tiny sizes, results under full-smoke/ (rehearsal)")
    u = sub.add_parser("unpack", help="an allocation's results.tgz into the repository")
    u.add_argument("file")
    u.add_argument("--root", default=str(U.ROOT))
    args = ap.parse_args(argv)
    if args.cmd == "run" and (args.seconds <= PACK_SECONDS or args.jobs < 1):
        ap.error(f"--seconds must exceed {PACK_SECONDS:.0f} and --jobs be at least 1")
    try:
        return _run(args) if args.cmd == "run" else _unpack(args)
    except ValueError as err:
        ap.error(str(err))


if __name__ == "__main__":
    raise SystemExit(main())
