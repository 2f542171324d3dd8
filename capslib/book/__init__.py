"""The book's machinery: what the chapters need to run, record and show their experiments, but a
reader of ``capslib`` would not reuse. It imports the library (``capslib``); the library never
imports it.

- :func:`setup` (:mod:`capslib.book.session`) opens every chapter: seeds, device, one line;
- :mod:`~capslib.book.profiles` (sizes per profile), :mod:`~capslib.book.results` (recorded numbers
  and glue), :mod:`~capslib.book.claims`, :mod:`~capslib.book.paper` (the sourced table of the
  papers' numbers), :mod:`~capslib.book.stats`, :mod:`~capslib.book.spread`;
- :mod:`~capslib.book.viz` and :mod:`~capslib.book.widgets`: figures and interactive figures;
- :mod:`~capslib.book.units`: experiment units (one complete training each) and their committed
  results; ``capslib.book.chNN``: a chapter's units and the views drawn from them.
"""
from __future__ import annotations

import importlib

from .session import setup

_SUBMODULES = {"session", "profiles", "results", "claims", "paper", "stats", "spread", "viz", "timing",
               "widgets", "units", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07"}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"capslib.book.{name}")
    raise AttributeError(f"module 'capslib.book' has no attribute {name!r}")


__all__ = ["setup", *sorted(_SUBMODULES)]
