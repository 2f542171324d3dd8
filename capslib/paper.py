"""The numbers this book quotes from papers: one sourced table, ``book/paper_results.yml``.

Chapters never type a paper's number. They glue it from here (``glue(chapter="06")`` makes
``paper_<key>`` — the number as the paper prints it, with its unit — and ``paper_<key>_value``,
the float) and build their "paper vs this book" tables with :func:`capslib.results.paper_vs_book`,
which looks paper keys up in this table. The scoreboard reads the same table.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "book" / "paper_results.yml"
BIB = ROOT / "references.bib"
FIELDS = {"quantity", "value", "decimals", "pm", "unit", "paper", "where", "chapter", "book"}
REQUIRED = {"quantity", "value", "decimals", "unit", "paper", "where", "chapter"}
UNITS = {"%", "bits", "nats", "min", "s", "M", ""}
READINGS = {"percent", "error_percent", "value"}


def _bib_keys(path: Path = BIB) -> set[str]:
    return set(re.findall(r"^@\w+\{([^,\s]+),", path.read_text(), flags=re.M))


def validate(table: dict, bib_keys: set[str]) -> None:
    """Raise ValueError naming the entry and field that break the table's rules."""
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{TABLE.name} must map keys to entries")
    for key, e in table.items():
        if not re.fullmatch(r"[a-z][a-z0-9_]*", str(key)):
            raise ValueError(f"paper key {key!r}: use lower-case letters, digits and '_' (it becomes a glue name)")
        if not isinstance(e, dict):
            raise ValueError(f"paper entry {key!r} must be a mapping of fields")
        missing, unknown = REQUIRED - set(e), set(e) - FIELDS
        if missing or unknown:
            raise ValueError(f"paper entry {key!r}: missing {sorted(missing)}, unknown {sorted(unknown)}")
        if isinstance(e["value"], bool) or not isinstance(e["value"], (int, float)):
            raise ValueError(f"paper entry {key!r}: value must be a number, got {e['value']!r}")
        if not isinstance(e["decimals"], int) or not 0 <= e["decimals"] <= 6:
            raise ValueError(f"paper entry {key!r}: decimals must be an integer 0..6, got {e['decimals']!r}")
        if e["unit"] not in UNITS:
            raise ValueError(f"paper entry {key!r}: unit {e['unit']!r} not one of {sorted(UNITS)}")
        if e["paper"] not in bib_keys:
            raise ValueError(f"paper entry {key!r}: {e['paper']!r} is not a key of references.bib")
        if not str(e["where"]).strip() or not str(e["quantity"]).strip():
            raise ValueError(f"paper entry {key!r}: 'where' and 'quantity' must say something")
        if not re.fullmatch(r"\d\d", str(e["chapter"])):
            raise ValueError(f"paper entry {key!r}: chapter must be two digits as a string, got {e['chapter']!r}")
        if "pm" in e and (isinstance(e["pm"], bool) or not isinstance(e["pm"], (int, float))):
            raise ValueError(f"paper entry {key!r}: pm must be a number")
        if "book" in e:
            b = e["book"]
            if (not isinstance(b, dict) or not {"metric", "as"} <= set(b) <= {"metric", "as", "note"}
                    or b["as"] not in READINGS):
                raise ValueError(f"paper entry {key!r}: book must be {{metric: <name>, as: one of "
                                 f"{sorted(READINGS)}[, note: <how this book's number differs>]}}")


@lru_cache(maxsize=None)
def _load(path: str, mtime: float) -> dict:
    import yaml

    table = yaml.safe_load(Path(path).read_text())
    validate(table, _bib_keys())
    return table


def table() -> dict:
    """Every entry of the sourced table, validated."""
    return _load(str(TABLE), TABLE.stat().st_mtime)


def entry(key: str) -> dict:
    """One entry; a clear KeyError for an unknown key."""
    t = table()
    if key not in t:
        close = [k for k in t if k.split("_")[0] == key.split("_")[0]]
        raise KeyError(f"{key!r} is not in {TABLE.name}" + (f" (same paper: {', '.join(close)})" if close else ""))
    return t[key]


def value(key: str) -> float:
    """The number as a float, in the entry's unit."""
    return float(entry(key)["value"])


def text(key: str, pm: bool = False) -> str:
    """The number as the paper prints it, with its unit (``0.25%``, ``9.53 bits``); ``pm`` adds the ±."""
    e = entry(key)
    d = e["decimals"]
    num = f"{e['value']:,.{d}f}" if e["value"] >= 10_000 else f"{e['value']:.{d}f}"
    if pm and "pm" in e:
        pm_digits = len(repr(float(e["pm"])).split(".")[1].rstrip("0")) if "." in repr(float(e["pm"])) else 0
        num += f" ± {e['pm']:.{max(d, pm_digits)}f}"
    unit = e["unit"]
    return num + ("%" if unit == "%" else f" {unit}" if unit else "")


def source(key: str) -> str:
    """Where the number is printed: ``renzulli2022rem, Table 9``."""
    e = entry(key)
    return f"{e['paper']}, {e['where']}"


def keys(chapter: str | None = None) -> list[str]:
    """Keys of one chapter (two digits, e.g. ``"06"``) or of all chapters."""
    return [k for k, e in table().items() if chapter is None or e["chapter"] == chapter]


def glue(chapter: str | None = None) -> list[str]:
    """Glue ``paper_<key>`` (text with unit), ``paper_<key>_pm`` (text with ±, where given) and
    ``paper_<key>_value`` (float) for the entries of ``chapter`` (all if None); returns the keys."""
    from myst_nb import glue as _glue

    ks = keys(chapter)
    for k in ks:
        _glue(f"paper_{k}", text(k), display=False)
        _glue(f"paper_{k}_pm", text(k, pm=True), display=False)
        _glue(f"paper_{k}_value", value(k), display=False)
    return ks


def is_key(obj) -> bool:
    return isinstance(obj, str) and obj in table()
