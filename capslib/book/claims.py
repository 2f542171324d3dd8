"""Claims on trained numbers: asserted where the chapter makes them, measured over seeds.

A chapter states what a trained run shows with :func:`check` instead of a bare ``assert``::

    claims.check("02 CapsNet test accuracy", test_accuracy, at_least=0.90)

In a normal execution (nbval, ``make book``) a claim that does not hold raises
``AssertionError`` naming the claim, the value and the bound. In a spread run (``make
spread``, :mod:`capslib.tools.spread`) ``$CAPSBOOK_CLAIMS_LOG`` names a file: every claim is
appended to it as one JSON line and nothing raises, so one execution measures every claim
of a chapter. The spread table (``book/results/ci_spread.json``) gathers those lines over
seeds and thread counts; ``tests/test_claims.py`` checks that every claim in the book is in
it and that each bound sits below the worst seed measured.

A bound is a literal number (the test reads it from the notebook's source). A comparison
between two trained numbers is a claim on their difference or ratio, so that its margin can
be measured: ``check("06 REM entropy below vanilla (bits)", h_vanilla - h_rem, above=0.0)``.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

BOUNDS = ("above", "at_least", "below", "at_most")
SYMBOLS = {"above": ">", "at_least": ">=", "below": "<", "at_most": "<="}
LOG_ENV = "CAPSBOOK_CLAIMS_LOG"


def _as_float(name: str, value) -> float:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)):
        raise TypeError(f"claim {name!r}: value must be a number; got {type(value).__name__}")
    return float(value)


def holds(value: float, bound: str, limit: float) -> bool:
    """Whether ``value`` satisfies ``bound`` (one of :data:`BOUNDS`) at ``limit``; NaN never does."""
    if math.isnan(value):
        return False
    return {"above": value > limit, "at_least": value >= limit,
            "below": value < limit, "at_most": value <= limit}[bound]


def margin(value: float, bound: str, limit: float) -> float:
    """How far ``value`` is from breaking the claim, in the value's units (negative: broken)."""
    return value - limit if bound in ("above", "at_least") else limit - value


def check(name: str, value, *, above=None, at_least=None, below=None, at_most=None) -> float:
    """Assert that the trained quantity ``value`` satisfies exactly one bound; return it as a float.

    Raises ``AssertionError`` (normal run) or logs the measurement (spread run, see the module
    docstring). Raises ``ValueError`` when not exactly one bound is given.
    """
    given = {k: v for k, v in dict(above=above, at_least=at_least, below=below, at_most=at_most).items()
             if v is not None}
    if len(given) != 1:
        raise ValueError(f"claim {name!r}: give exactly one of {BOUNDS}; got {sorted(given) or 'none'}")
    if not isinstance(name, str) or not name.strip():
        raise ValueError("claim name must be a non-empty string")
    (bound, limit), = given.items()
    limit = float(limit)
    v = _as_float(name, value)
    ok = holds(v, bound, limit)
    log = os.environ.get(LOG_ENV, "").strip()
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"name": name, "value": v, "bound": bound, "limit": limit, "holds": ok}) + "\n")
        return v
    if not ok:
        raise AssertionError(not_met(name, v, bound, limit))
    return v


def not_met(name: str, value: float, bound: str, limit: float) -> str:
    """What a claim that does not hold says (the message of :func:`check`'s ``AssertionError``)."""
    return f"claim {name!r} does not hold: {value:.6g} is not {SYMBOLS[bound]} {limit:g}"


def read_log(path: str | Path) -> list[dict]:
    """The claims one spread execution logged (one dict per line)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
