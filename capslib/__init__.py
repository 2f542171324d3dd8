"""capslib: the small library behind *Capsule Networks, Derived and Reproduced*.

Contract (DESIGN.md): ``squash``, ``unsquash``, ``margin_loss``, ``dynamic_routing``,
``em_routing`` and the modules ``rem``, ``soft_routing``, ``poe``, ``layers``, ``models``,
``data``, ``train``: what the book teaches and a reader reuses. What ``fit`` runs on (its step
paths, checkpoints, ``torchrun``, the environment switches) is the subpackage :mod:`capslib.engine`.
The book's machinery (set-up, profiles, results, figures) is :mod:`capslib.book`, whose
``setup()`` opens every chapter; the commands are :mod:`capslib.tools`. This package imports neither.
"""
from __future__ import annotations

import importlib

from .ops import margin_loss, squash, unsquash
from .routing import dynamic_routing

__version__ = "0.1.0"

_SUBMODULES = {"data", "layers", "models", "train", "routing", "ops", "rem", "soft_routing", "poe", "em",
               "em_layers", "poe_models", "multimnist", "pitfalls", "coupling_gradient", "checks", "pruning",
               "datasets", "engine"}


def __getattr__(name):
    if name == "em_routing":
        return importlib.import_module("capslib.em").em_routing
    if name in _SUBMODULES:
        return importlib.import_module(f"capslib.{name}")
    raise AttributeError(f"module 'capslib' has no attribute {name!r}")


__all__ = ["squash", "unsquash", "margin_loss", "dynamic_routing", "em_routing", *sorted(_SUBMODULES)]
