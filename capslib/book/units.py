"""Experiment units: paper scale as many small, complete trainings whose results are committed.

GPU time comes in short allocations on machines that start bare and forget everything, so a
paper-scale experiment is cut into **units**, each one complete training (a chapter, a name, a
seed: ``02/main/s0``) that finishes in a few minutes on one GPU. A finished unit writes
``book/results/full/<chapter>/<name>/s<seed>.json``: its metrics, per-epoch history, small arrays
for the chapter's figures (never weights), the configuration, a fingerprint, the device, torch
version, commit and wall time. Results accumulate, allocation after allocation; chapters draw their
paper-scale figures from these files, so the full edition builds on a CPU.

**Current or stale.** A result is *current* when the configuration stored in it hashes to the
unit's ``fingerprint`` now **and** its **computational probe** agrees with the probe computed now:
one seeded training step of the unit's own network, loss and augmentation at full size, in float64
on the CPU (weights drawn in float64, dropout off), its loss and per-parameter gradient norms, equal
within a relative ``PROBE_RTOL`` (different CPUs and torch versions round float64 differently in the
last digits; a change to what is computed moves these numbers by far more). Code that moves between
modules or gains a comment keeps its results; code that changes what a training computes makes them
stale. What the probe cannot see (epochs, batch size, the schedule, data, precision, a version that
a chapter bumps when its training loop changes) is in the configuration.

A unit's ``run(unit, device, smoke)`` returns ``{"metrics": {...}, "history": {...}, "arrays": {...}}``;
``smoke=True`` shrinks it to seconds (results under ``full-smoke/``, git-ignored).
"""
from __future__ import annotations

import base64
import hashlib
import importlib
import json
import math
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .results import _plain   # tensors and NumPy values to JSON-ready ones
from .stats import signed

ROOT = Path(__file__).resolve().parents[2]
# ``$CAPSBOOK_UNITS_RESULTS`` redirects where results are written and read (tests use a temporary folder)
RESULTS_ROOT = Path(os.environ.get("CAPSBOOK_UNITS_RESULTS", "").strip() or ROOT / "book" / "results")

# Chapters whose units are declared in ``capslib.book.ch<NN>`` (imported on first use).
CHAPTERS = ("02", "03", "04", "05", "06", "07")

# Rates measured on one H100 (``book/results/bench/fit_rates_h100.json``: capslib.train.fit on chapter 2's
# paper-size networks, each training its own process): images/s of one training alone, by network
# family, and the share of that rate each of k trainings gets when k share the GPU. They project a
# unit's minutes until results of its family exist (then the median measured rate of its committed
# results is used). Sharing was measured at k = 1 and 4; k = 2, 3 are interpolated linearly in the
# GPU's total images/s, and k > 4 keeps the total of k = 4.
RATES_FILE = ROOT / "book" / "results" / "bench" / "fit_rates_h100.json"
_FAMILY_OF_MODE = {"capsnet-fp32": "capsnet28", "cnn-fp32": "cnn28"}


def _measured_rates() -> tuple[dict, dict]:
    runs = json.loads(RATES_FILE.read_text())["runs"]
    steady = lambda r: float(np.median(r["images_per_s"][1:]))  # noqa: E731 - epoch 1 is warm-up
    alone = {}
    for mode, fam in _FAMILY_OF_MODE.items():
        got = [steady(r) for r in runs if r["mode"] == mode and str(r["sharing"]) == "1"]
        if got:
            alone[fam] = float(np.median(got))
    four = [steady(r) for r in runs if r["mode"] == "capsnet-fp32" and str(r["sharing"]) == "4"]
    share4 = float(np.median(four)) / alone["capsnet28"]
    total1, total4 = 1.0, 4 * share4
    share = {k: (total1 + (total4 - total1) * (k - 1) / 3) / k for k in (1, 2, 3, 4)}
    return alone, share


RATES_H100, SHARE = _measured_rates()

# Families without a ``fit`` measurement yet are projected from the step bench on the same H100
# (``book/results/bench/h100.json``: one forward, backward and Adam step on random images, fp32 eager),
# scaled by what ``fit`` achieved of that bench rate for the 28x28 CapsNet (validation, shifts, the
# epoch loop). A family whose network is in neither file is projected at ``UNBENCHED_RATE``, the
# slowest bench rate of a CapsNet-sized network, so that its projection errs long; ``status`` marks
# every projection that is not a ``fit`` measurement as an estimate.
BENCH_FILE = ROOT / "book" / "results" / "bench" / "h100.json"
_FAMILY_OF_BENCH = {"capsnet40": "02x", "capsnet28-nodecoder": "06", "em32": "05", "poe": "07"}


def _bench_rates() -> dict:
    rows = json.loads(BENCH_FILE.read_text())["rows"]
    step = {r["key"]: float(r["images_per_s"]) for r in rows if r["mode"] == "fp32 eager"}
    in_fit = RATES_H100["capsnet28"] / step["02"]
    return {fam: step[key] * in_fit for fam, key in _FAMILY_OF_BENCH.items() if key in step}


ESTIMATED_RATES_H100 = _bench_rates()
UNBENCHED_RATE = min(v for k, v in ESTIMATED_RATES_H100.items() if k.startswith("capsnet"))


# Units whose step is ``fit``'s fast path run, on a GPU, as one captured CUDA graph per step
# (``python -m capslib.tools.bench fast-check`` checks and times it; ``fast_check.json`` holds one H100's
# numbers). Such a unit keeps the GPU busy by itself: on one H100 (2026-11-26) four graphed units side by
# side each ran at 0.22-0.24 of their speed alone (02/main beside three 06/vanilla, then two 02/main
# beside 02/baseline and 05/main), so the plan gives them no gain from sharing: ``1/k`` with k running.
FAST_CHECK_FILE = ROOT / "book" / "results" / "bench" / "fast_check.json"


def graphed(unit: "Unit") -> bool:
    """Whether ``unit`` trains through ``fit``'s fast path (a CUDA graph per step on a GPU)."""
    return "fast path" in str(unit.config.get("step", ""))


def _fast_rates() -> dict:
    """Images/s of ``fit`` on the fast path, float32, alone on an H100, by family (the fast check)."""
    if not FAST_CHECK_FILE.exists():
        return {}
    got = json.loads(FAST_CHECK_FILE.read_text())
    if "H100" not in str(got.get("device")):
        return {}
    rows = [r for r in got.get("fit", []) if r.get("fast") and not r.get("amp") and r.get("step_path") == "graphed"]
    return {"capsnet28": float(rows[0]["images_per_s"])} if rows else {}


FAST_RATES_H100 = _fast_rates()


def share_of(sharing: int, is_graphed: bool = False) -> float:
    """Fraction of its speed alone that one unit gets while ``sharing`` units train on the GPU."""
    k = max(int(sharing), 1)
    if is_graphed:
        return 1.0 / k
    return SHARE.get(k, SHARE[max(SHARE)] * max(SHARE) / k)


def rate_of(family: str, is_graphed: bool = False) -> tuple[float, str]:
    """Images/s of one ``family`` training alone on one H100 and where the number comes from:
    ``"measured"`` (committed results, the fast check for a unit on the fast path, or ``fit`` rates),
    ``"bench"`` (step bench scaled) or ``"assumed"`` (no measurement of this network:
    :data:`UNBENCHED_RATE`). A graphed family without a fast-check number keeps its eager rate (an
    underestimate: the graph was measured 2x faster for the CapsNet)."""
    if is_graphed and family in FAST_RATES_H100:
        return FAST_RATES_H100[family], "measured"
    got = measured_rate(family)
    if got is not None:
        return got, "measured"
    if family in RATES_H100:
        return RATES_H100[family], "measured"
    if family in ESTIMATED_RATES_H100:
        return ESTIMATED_RATES_H100[family], "bench"
    return UNBENCHED_RATE, "assumed"
# Interpreter, CUDA context, data onto the device, the probe, cuDNN's autotuning in the first epoch
# (measured: the first epoch takes about 6 s more than the others, 8 s at four sharing)
STARTUP_SECONDS = 40.0
# The runner plans with every projection this much longer (one H100's measured rates move by a few
# per cent between epochs and runs; a unit over the budget is lost)
PLAN_MARGIN = 0.15
PROBE_RTOL = 1e-6


@dataclass(frozen=True)
class Unit:
    """One complete training: ``chapter`` ("02"), ``name`` ("main", "table1/r3-recon"), ``seed``.

    ``config``: everything that decides the run that the probe cannot see (sizes, epochs, schedule,
    data); ``family`` and ``images``: for the projection (training images processed in all);
    ``priority``: lower runs first; ``probe(unit) -> dict of numbers``: see the module's docstring;
    ``what``: one line saying what the unit measures."""
    chapter: str
    name: str
    seed: int
    run: Callable = field(compare=False, repr=False)
    config: dict = field(compare=False, repr=False, default_factory=dict)
    probe: Callable | None = field(compare=False, repr=False, default=None)
    family: str = "capsnet28"
    images: int = 0
    priority: int = 50
    what: str = ""

    @property
    def key(self) -> str:
        return f"{self.chapter}/{self.name}/s{self.seed}"

    def path(self, smoke: bool = False) -> Path:
        return RESULTS_ROOT / ("full-smoke" if smoke else "full") / self.chapter / self.name / f"s{self.seed}.json"


_REGISTRY: dict[str, Unit] = {}
_LOADED: set[str] = set()


def register(unit: Unit) -> Unit:
    """Add ``unit`` (its key must be new)."""
    if not isinstance(unit.seed, int) or unit.seed < 0:
        raise ValueError(f"unit seed must be an int >= 0; got {unit.seed!r}")
    if not (len(unit.chapter) == 2 and unit.chapter.isdigit()):
        raise ValueError(f"unit chapter must be two digits; got {unit.chapter!r}")
    if unit.key in _REGISTRY:
        raise ValueError(f"unit {unit.key} is registered twice")
    _REGISTRY[unit.key] = unit
    return unit


def _load_chapters(chapter: str | None = None) -> None:
    for ch in CHAPTERS:
        if (chapter is None or ch == chapter) and ch not in _LOADED:
            importlib.import_module(f"capslib.book.ch{ch}")
            _LOADED.add(ch)


def all_units(chapter: str | None = None) -> list[Unit]:
    """Every registered unit (of ``chapter``), by priority then key."""
    if chapter is not None and chapter not in CHAPTERS:
        raise KeyError(f"no units for chapter {chapter!r}; chapters with units: {', '.join(CHAPTERS)}")
    _load_chapters(chapter)
    return sorted((u for u in _REGISTRY.values() if chapter is None or u.chapter == chapter),
                  key=lambda u: (u.priority, u.key))


def get(key: str) -> Unit:
    """The unit named ``key`` (``02/main/s0``); a clear KeyError naming the known ones otherwise."""
    _load_chapters(key.split("/", 1)[0] if key[:2].isdigit() and key[:2] in CHAPTERS else None)
    if key not in _REGISTRY:
        near = [k for k in _REGISTRY if k.rsplit("/", 1)[0] == key.rsplit("/", 1)[0]] or sorted(_REGISTRY)
        raise KeyError(f"no unit {key!r}; known: {', '.join(near[:12])}{' ...' if len(near) > 12 else ''}")
    return _REGISTRY[key]


def select(patterns: list[str] | None = None, chapter: str | None = None) -> list[Unit]:
    """Units of ``chapter`` whose key starts with one of ``patterns`` (all when none given)."""
    units = all_units(chapter)
    if patterns:
        units = [u for u in units if any(u.key == p or u.key.startswith(p.rstrip("/") + "/") for p in patterns)]
        if not units:
            raise KeyError(f"no unit matches {patterns}")
    return units


# ----------------------------------------------------------------------------- fingerprints

def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


_PROBES: dict[tuple, dict] = {}


def probe_values(unit: Unit) -> dict:
    """The unit's computational probe (cached per probe function and configuration)."""
    if unit.probe is None:
        return {}
    cache = (unit.probe, json.dumps(unit.config, sort_keys=True, default=str))  # the function itself, not its name
    if cache not in _PROBES:
        with torch.random.fork_rng(devices=[]):
            raw = unit.probe(unit)
        _PROBES[cache] = {k: float(v) for k, v in sorted(raw.items())}
    return _PROBES[cache]


def fingerprint(unit: Unit) -> str:
    """Hash of the unit's configuration (the probe is compared by value: :func:`probe_agrees`)."""
    return _sha(json.dumps({"config": unit.config}, sort_keys=True, default=str))


def probe_agrees(stored: dict | None, now: dict) -> bool:
    """Whether a stored probe equals the probe now: the same names, every value within ``PROBE_RTOL``."""
    if not isinstance(stored, dict) or set(stored) != set(now):
        return False
    return all(math.isclose(float(stored[k]), now[k], rel_tol=PROBE_RTOL, abs_tol=1e-12) for k in now)


# ----------------------------------------------------------------------------- results

def encode_array(a, dtype: str = "float32") -> dict:
    """A small array as JSON: dtype, shape and the base-64 of its bytes (little-endian)."""
    arr = np.ascontiguousarray(np.asarray(a.detach().cpu() if isinstance(a, torch.Tensor) else a), dtype=dtype)
    return {"dtype": dtype, "shape": list(arr.shape), "b64": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<"))
                                                                             .tobytes()).decode()}


def decode_array(d: dict) -> np.ndarray:
    """The inverse of :func:`encode_array`."""
    if not isinstance(d, dict) or not {"dtype", "shape", "b64"} <= set(d):
        raise ValueError("an encoded array is a dict with dtype, shape and b64")
    dt = np.dtype(d["dtype"]).newbyteorder("<")
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=dt).reshape(d["shape"]).astype(d["dtype"])


def _commit() -> tuple[str, bool]:
    """HEAD and whether tracked files differ from it; ``$CAPSBOOK_COMMIT`` where the tree is a copy
    without git (a lent GPU machine)."""
    given = os.environ.get("CAPSBOOK_COMMIT", "").strip()
    if given or not (ROOT / ".git").exists():
        return given or "unknown", False
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, cwd=ROOT, timeout=5).stdout.strip())
        return head or "unknown", dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from .session import cpu_label
    return f"cpu ({cpu_label()})"


MAX_RESULT_BYTES = 1_500_000


def execute(unit: Unit, device: torch.device | str | None = None, smoke: bool = False) -> Path:
    """Run ``unit`` on ``device`` (default: CUDA when present) and write its result atomically (under
    ``torchrun``, data-parallel over the ranks, rank 0 writing; see :func:`capslib.train.distributed_ranks`)."""
    from ..engine.switches import smoke as smoke_env
    if smoke_env() and not smoke:
        raise RuntimeError(f"unit {unit.key}: CAPSBOOK_SMOKE is set, which shrinks the data; a paper-scale result "
                           f"is not made under it (unset it, or ask for a smoke run)")
    device = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fp = fingerprint(unit)
    started = time.time()
    out = unit.run(unit, device, smoke)
    from ..train import distributed_ranks
    ranks = distributed_ranks()
    if ranks is not None and ranks[0] != 0:   # data parallel under torchrun: rank 0 writes
        return unit.path(smoke)
    world = ranks[1] if ranks is not None else 1
    if not isinstance(out, dict) or "metrics" not in out:
        raise TypeError(f"unit {unit.key}: run must return a dict with 'metrics'")
    commit, dirty = _commit()
    payload = {
        "unit": unit.key, "chapter": unit.chapter, "name": unit.name, "seed": unit.seed,
        "what": unit.what, "smoke": smoke, "fingerprint": fp, "config": unit.config,
        "probe": probe_values(unit),
        "device": _device_name(device), "processes": world,
        # units on the GPU when it started, and whether it had the GPU to itself throughout (the
        # runner with --jobs 1 says so; a unit run by hand, ``one``, is taken to); the runner rewrites
        # both from what it saw when the unit ends (:func:`record_sharing`)
        "sharing_gpu": int(os.environ.get("CAPSBOOK_SHARING", "1") or 1),
        "ran_alone": os.environ.get("CAPSBOOK_RAN_ALONE", "1") == "1",
        "torch": torch.__version__, "commit": commit, "uncommitted_changes": dirty,
        "wall_seconds": round(time.time() - started, 1), "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
        "metrics": _plain(out["metrics"]), "history": _plain(out.get("history", {})),
        "arrays": out.get("arrays", {}),
    }
    text = json.dumps(payload, indent=1, sort_keys=False, default=str) + "\n"
    if len(text) > MAX_RESULT_BYTES:
        raise ValueError(f"unit {unit.key}: result is {len(text):,} bytes, over {MAX_RESULT_BYTES:,}: "
                         f"store fewer or smaller arrays")
    path = unit.path(smoke)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def record_sharing(unit: Unit | str, most: int, others: list[str], smoke: bool = False) -> None:
    """Write into ``unit``'s result who shared the GPU while it ran (the runner knows; the unit, which
    sees only the count when it started, does not): ``sharing_gpu`` the most units at once, itself
    included; ``shared_with`` their keys; ``ran_alone`` whether it had the GPU to itself throughout."""
    unit = get(unit) if isinstance(unit, str) else unit
    res = load(unit, smoke)
    if res is None:
        raise FileNotFoundError(f"no result of {unit.key} to annotate")
    res.update(sharing_gpu=int(most), shared_with=list(others), ran_alone=int(most) == 1)
    path = unit.path(smoke)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def load(unit: Unit | str, smoke: bool = False) -> dict | None:
    """The stored result of ``unit`` (a Unit or key), or None when it was never run."""
    unit = get(unit) if isinstance(unit, str) else unit
    p = unit.path(smoke)
    return json.loads(p.read_text()) if p.exists() else None


def state(unit: Unit, smoke: bool = False) -> tuple[str, dict | None]:
    """``("missing" | "done" | "stale", result)``: stale when the stored fingerprint is not the unit's now."""
    res = load(unit, smoke)
    if res is None:
        return "missing", None
    same = res.get("fingerprint") == fingerprint(unit) and probe_agrees(res.get("probe"), probe_values(unit))
    return ("done" if same else "stale"), res


def measured_rate(family: str) -> float | None:
    """Median images/s of the committed results of ``family`` that ran alone, in one process, on an
    H100 (each result's median epoch rate); None when there is none. Results made beside others are
    not used: how long they shared the GPU is not known."""
    rates = []
    for u in _REGISTRY.values():
        if u.family != family:
            continue
        res = load(u)
        if not res or "H100" not in str(res.get("device")) or res.get("processes", 1) != 1 \
                or res.get("ran_alone") is not True:
            continue
        ips = res.get("history", {}).get("images_per_s") or []
        if ips:
            rates.append(float(np.median(ips)))
    return float(np.median(rates)) if rates else None


def projected_seconds(unit: Unit, sharing: int = 1) -> float:
    """Projected wall time of ``unit`` on one H100 shared by ``sharing`` trainings."""
    rate, _ = rate_of(unit.family, graphed(unit))
    return STARTUP_SECONDS + unit.images / (rate * share_of(sharing, graphed(unit)))


# ----------------------------------------------------------------------------- what a chapter shows

@dataclass
class Group:
    """The results of one experiment over its seeds (``02/main``): the current ones, and the keys of
    the seeds whose result is missing or stale."""
    prefix: str
    label: str
    results: list
    missing: list
    stale: list

    def values(self, metric: str) -> list[float]:
        return [float(r["metrics"][metric]) for r in self.results]

    @property
    def complete(self) -> bool:
        return not self.missing and not self.stale


def group(prefix: str, label: str, smoke: bool = False) -> Group:
    """Every unit under ``prefix`` (``02/main``, ``02/table1/r1-recon``) with its state; ``label``
    names the experiment for readers."""
    found, missing, stale = [], [], []
    for u in select([prefix]):
        st, res = state(u, smoke)
        {"done": found, "missing": missing, "stale": stale}[st].append(res if st == "done" else u.key)
    return Group(prefix, label, found, missing, stale)


def banner(groups: list[Group]) -> str | None:
    """Markdown for a visible note naming the paper-scale runs not yet made (None when all are)."""
    lacking = [g for g in groups if not g.complete]
    if not lacking:
        return None
    parts = []
    for g in lacking:
        n = len(g.results) + len(g.missing) + len(g.stale)
        what = f"{len(g.results)} of {n} seeds run so far" + (f", {len(g.stale)} stale (made by other code)" if g.stale else "")
        parts.append(f"{g.label} ({what})")
    return ("**Paper-scale runs still to be made** for " + "; ".join(parts) +
            ". Each is a short GPU job; until it is made, this section shows the results that exist, "
            "and the rest of the chapter shows the small CPU run.")


def banner_html(groups: list[Group]) -> str | None:
    """:func:`banner` as an HTML note (the book's admonition style), for a notebook's output."""
    import html
    import re

    text = banner(groups)
    if text is None:
        return None
    body = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", html.escape(text))
    return f'<div class="admonition note"><p class="admonition-title">Paper scale</p><p>{body}</p></div>'


# ----------------------------------------------------------------------------- paper scale beside the papers' numbers

@dataclass(frozen=True)
class PaperScale:
    """The paper-scale counterpart of one of a paper's numbers: the units under ``prefix``, the value each
    result holds (``metric(result["metrics"])``), its format, and, where the row shows several numbers, the
    words that say which one the cell gives (``what``)."""
    prefix: str
    metric: Callable[[dict], float]
    fmt: str
    what: str = ""
    baseline: str | None = None    # units whose value, seed by seed, is subtracted (a paired difference)


# paper key (book/paper_results.yml) or, for a row with no paper number, the row's quantity as the chapter's
# comparison table names it -> its counterpart; declared by the chapter modules beside their units
PAPER_SCALE: dict[str, PaperScale] = {}


def paper_scale(key: str, prefix: str, metric: Callable[[dict], float], fmt: str, row: bool = False,
                what: str = "", baseline: str | None = None) -> None:
    """Declare that the units under ``prefix`` measure the paper's number ``key`` (with ``row``: the
    quantity of a comparison row that has no paper number, named exactly as the chapter's table names it):
    the comparison tables of the chapters (:func:`capslib.book.results.paper_vs_book`) then show it in
    their paper-scale column, after ``what`` where the row holds several numbers. With ``baseline`` (another
    prefix) the cell is a paired difference: each seed's value minus the baseline unit's of the same seed."""
    from . import paper

    if not row and not paper.is_key(key):
        raise ValueError(f"paper_scale: {key!r} is not a key of book/paper_results.yml")
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"paper_scale: a paper key or a row's quantity; got {key!r}")
    if key in PAPER_SCALE:
        raise ValueError(f"paper_scale: {key!r} is declared twice")
    if not callable(metric) or not isinstance(fmt, str):
        raise ValueError("paper_scale: metric must be callable and fmt a format string")
    if baseline is not None and (not isinstance(baseline, str) or baseline == prefix):
        raise ValueError(f"paper_scale: baseline must be another prefix of units than {prefix!r}; got {baseline!r}")
    PAPER_SCALE[key] = PaperScale(prefix, metric, fmt, what, baseline)


def paper_scale_cell(key, smoke: bool = False, quantity: str | None = None) -> str | None:
    """The paper-scale cell of a comparison row that shows the paper's ``key`` (or, failing that, of the row
    named ``quantity``): the mean ± SD over the seeds run, in the paper's unit where it has one other than a
    percentage (bits), and how many of the declared seeds that is, or "not yet run"; ``None`` where no unit
    measures that number."""
    _load_chapters()
    ps = PAPER_SCALE.get(key) if isinstance(key, str) else None
    if ps is None and isinstance(quantity, str):
        ps = PAPER_SCALE.get(quantity)
    if ps is None:
        return None
    g = group(ps.prefix, ps.prefix, smoke)
    declared = len(g.results) + len(g.missing) + len(g.stale)
    values = [float(ps.metric(r["metrics"])) for r in g.results]
    if ps.baseline is not None:    # paired by seed, over the seeds both sides have
        base = {r["seed"]: float(ps.metric(r["metrics"])) for r in group(ps.baseline, ps.baseline, smoke).results}
        values = [v - base[r["seed"]] for v, r in zip(values, g.results) if r["seed"] in base]
    if not values:
        return "not yet run"
    unit = ""
    if isinstance(key, str) and "%" not in ps.fmt:      # a number in the paper's unit, where it has one (bits)
        from . import paper

        if paper.is_key(key) and paper.entry(key).get("unit") not in (None, "", "%"):
            unit = f" {paper.entry(key)['unit']}"
    cell = f"{seed_spread(values, ps.fmt)}{unit} ({len(values)} of {declared} seeds)"
    return f"{ps.what} {cell}" if ps.what else cell


# ----------------------------------------------------------------------------- helpers the chapters' units share

def cuda_speed_settings(device: torch.device, benchmark: bool = True) -> None:
    """On a GPU: TF32 matrix products and convolutions (the units' declared precision) and, with
    ``benchmark``, cuDNN's autotuning; nothing on a CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        if benchmark:
            torch.backends.cudnn.benchmark = True


def seed_spread(values, fmt: str) -> str:
    """A table cell for a quantity over seeds: the mean, ± its SD over the seeds when there are two or
    more; "not yet run" when there is none."""
    if not values:
        return "not yet run"
    show = (lambda v: signed(v, fmt)) if fmt.startswith("+") else (lambda v: format(v, fmt))
    if len(values) == 1:
        return show(values[0])
    return f"{show(float(np.mean(values)))} ± {format(float(np.std(values, ddof=1)), fmt.lstrip('+'))}"


def built_in_float64(make: Callable):
    """``make()``'s network with its weights drawn in float64 (the default dtype switched for the call and
    restored after it): what every unit's probe starts from, so that no float32 rounding differs by CPU."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return make()
    finally:
        torch.set_default_dtype(previous)


def step_summary(loss: torch.Tensor, x: torch.Tensor, net: torch.nn.Module) -> dict:
    """A probe's numbers after ``loss.backward()``: the loss, the sum of the input images and the norm
    of every parameter's gradient."""
    out = {"loss": loss.item(), "x_sum": x.sum().item()}
    out.update({f"grad:{n}": p.grad.norm().item() for n, p in net.named_parameters() if p.grad is not None})
    return out
