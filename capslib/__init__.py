"""capslib: the small library behind *Capsule Networks, Derived and Reproduced*.

Contract (DESIGN.md): ``squash``, ``unsquash``, ``margin_loss``,
``dynamic_routing``, ``em_routing`` and the modules ``rem``, ``soft_routing``,
``poe``, ``layers``, ``models``, ``data``, ``train``, ``viz``, ``widgets``,
``profiles``, ``results``. ``setup()`` opens every chapter.
"""
from __future__ import annotations

import importlib

from .ops import margin_loss, squash, unsquash
from .routing import dynamic_routing
from .session import setup

__version__ = "0.1.0"

_SUBMODULES = {"data", "layers", "models", "train", "viz", "widgets", "profiles", "results", "session",
               "routing", "ops", "rem", "soft_routing", "poe", "em", "claims", "paper", "stats"}


def __getattr__(name):
    if name == "em_routing":
        return importlib.import_module("capslib.em").em_routing
    if name in _SUBMODULES:
        return importlib.import_module(f"capslib.{name}")
    raise AttributeError(f"module 'capslib' has no attribute {name!r}")


__all__ = ["squash", "unsquash", "margin_loss", "dynamic_routing", "em_routing", "setup", *sorted(_SUBMODULES)]
