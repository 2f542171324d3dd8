"""The environment switches the library reads (``CAPSBOOK_*``): the profile's name, smoke runs,
progress bars, ``torch.compile``, where a run keeps its checkpoints. The book's sizes per profile are
in :mod:`capslib.book.profiles`, which reads the same switches.

``CAPSBOOK_PROFILE=ci|full`` (default ``full`` when CUDA is available, else ``ci``);
``CAPSBOOK_SMOKE=1`` shrinks any profile to a smoke test (at most ``SMOKE_EPOCHS`` epochs per
training, at most ``SMOKE_SPLITS`` images per split, files kept apart under ``<profile>-smoke``).
"""
from __future__ import annotations

import os
import time

import torch

PROFILES = ("ci", "full")
# two epochs, so that what a chapter reads between epochs (a trend, a first-to-last change, a path of
# points) has a before and an after in a smoke run too
SMOKE_EPOCHS = 2
SMOKE_SPLITS = {"train": 512, "val": 128, "test": 256}


def current() -> str:
    """The active profile name: ``$CAPSBOOK_PROFILE`` or the machine's default."""
    name = os.environ.get("CAPSBOOK_PROFILE", "").strip().lower()
    if not name:
        return "full" if torch.cuda.is_available() else "ci"
    if name not in PROFILES:
        raise ValueError(f"CAPSBOOK_PROFILE must be one of {PROFILES}; got {name!r}")
    return name


def _flag(name: str) -> bool:
    """A switch in the environment: on for any value but empty or 0."""
    return os.environ.get(name, "").strip() not in ("", "0")


def smoke() -> bool:
    """Whether ``$CAPSBOOK_SMOKE`` asks for a smoke run (any value but empty or 0)."""
    return _flag("CAPSBOOK_SMOKE")


def paper_schedule() -> bool:
    """Whether ``$CAPSBOOK_PAPER_SCHEDULE`` asks for the longer schedule a chapter's ``full`` profile
    was cut down from to fit one GPU's budget (each chapter's ``paper`` sizes; any value but empty or 0)."""
    return _flag("CAPSBOOK_PAPER_SCHEDULE")


def progress_bars() -> bool:
    """Whether training shows progress bars: off when ``$CAPSBOOK_PROGRESS`` is 0 (set by the headless
    runners, ``capslib.tools.reproduce``, ``capslib.tools.smoke`` and ``capslib.tools.spread``, so that no bar is saved
    frozen in an executed notebook); on otherwise."""
    return os.environ.get("CAPSBOOK_PROGRESS", "").strip() != "0"  # on unless set to 0


def compile_requested() -> bool:
    """Whether ``$CAPSBOOK_COMPILE`` asks :func:`capslib.train.fit` to train through
    ``torch.compile`` (any value but empty or 0). Off by default."""
    return _flag("CAPSBOOK_COMPILE")


def storage_name(profile: str | None = None) -> str:
    """Where a run keeps checkpoints and results: the profile name, ``-smoke`` appended in a
    smoke run and ``-$CAPSBOOK_TAG`` when that is set, so that a smoke or spread run never
    leaves files a real run would resume from or show."""
    profile = profile or current()
    name = f"{profile}-smoke" if smoke() else profile
    tag = os.environ.get("CAPSBOOK_TAG", "").strip()
    if tag:  # a spread run (``make spread``): its own checkpoints and results, one folder per seed
        if not tag.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"CAPSBOOK_TAG must be letters, digits, '-' or '_'; got {tag!r}")
        name = f"{name}-{tag}"
    return name


# What a run's set-up decided (``capslib.book.setup`` fills it in): the device that data and models
# default to, the seed of the minibatch order, and when the run started (for ``$CAPSBOOK_TIME_LIMIT``).
_RUN: dict = {}
_IMPORTED = time.time()


def set_run_defaults(device: torch.device, seed: int, started: float) -> None:
    """Record the run's device, seed and start time (called by ``capslib.book.setup``)."""
    _RUN.update(device=torch.device(device), seed=int(seed), started=float(started))


def default_device() -> torch.device:
    """The run's device; before any set-up, CUDA when available, else the CPU."""
    if "device" in _RUN:
        return _RUN["device"]
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_seed() -> int:
    """The run's seed; before any set-up, ``$CAPSBOOK_SEED`` or 0."""
    if "seed" in _RUN:
        return _RUN["seed"]
    raw = os.environ.get("CAPSBOOK_SEED", "").strip()
    return int(raw) if raw else 0


def run_started() -> float:
    """When the run started (its set-up; before one, when the library was imported)."""
    return _RUN.get("started", _IMPORTED)
