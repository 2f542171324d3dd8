"""The numbers this book quotes from papers: one sourced table, ``book/paper_results.yml``.

Chapters never type a paper's number. They glue it from here (``glue(chapter="06")`` makes
``paper_<key>`` — the number as the paper prints it, with its unit — and ``paper_<key>_value``,
the float) and build their "paper vs this book" tables with :func:`capslib.book.results.paper_vs_book`,
which looks paper keys up in this table. The scoreboard reads the same table.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "book" / "paper_results.yml"
BIB = ROOT / "references.bib"
FIELDS = {"quantity", "value", "decimals", "pm", "unit", "paper", "where", "chapter", "book"}
REQUIRED = {"quantity", "value", "decimals", "unit", "paper", "where", "chapter"}
UNITS = {"%", "bits", "nats", "min", "s", "M", ""}
READINGS = {"percent", "error_percent", "value"}
# ``book``: which recorded metric measures the entry's quantity (``metric``, read ``as``), how it was
# spread over seeds (``seeds``: a path into the metrics, ``/``-separated, ``*`` for every seed) or
# its binomial standard error (``se``: a metric), or, for a mean whose per-seed values were not
# recorded, the metric listing its seeds (``seed_list``), and ``proxy: true`` when the book measures a stand-in
# (another test set), which the scoreboard then keeps out of the paper's rows.
BOOK_FIELDS = {"metric", "as", "note", "seeds", "se", "proxy", "seed_list"}


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
            if (not isinstance(b, dict) or not {"metric", "as"} <= set(b) <= BOOK_FIELDS
                    or b["as"] not in READINGS):
                raise ValueError(f"paper entry {key!r}: book must be {{metric: <name>, as: one of "
                                 f"{sorted(READINGS)}[, note: <how this book's number differs>], [seeds: <path>], "
                                 f"[se: <metric> | seed_list: <metric>], [proxy: true]}}")
            if sum(k in b for k in ("seeds", "se", "seed_list")) > 1:
                raise ValueError(f"paper entry {key!r}: book gives one of seeds, se and seed_list")
            if "proxy" in b and (b["proxy"] is not True or "note" not in b):
                raise ValueError(f"paper entry {key!r}: book proxy must be true and come with a note saying "
                                 f"how the book's quantity differs from the paper's")


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


@lru_cache(maxsize=None)
def _bib_entries(path: str = str(BIB)) -> dict[str, dict[str, str]]:
    """``key -> {field: value}`` of references.bib (the top-level ``field = {value}`` pairs)."""
    out: dict[str, dict[str, str]] = {}
    for m in re.finditer(r"^@\w+\{([^,\s]+),(.*?)^\}", Path(path).read_text(), flags=re.M | re.S):
        out[m.group(1)] = {f.lower(): v.strip() for f, v in
                           re.findall(r"^\s*(\w+)\s*=\s*\{(.*?)\},?\s*$", m.group(2), flags=re.M)}
    return out


def cite(paper_key: str, parenthetical: bool = False) -> str:
    """A reader's citation of a references.bib key: ``Sabour et al. (2017)``, ``Gu and Tresp (2020)``,
    ``Hauser (2019)`` (the first authors' surnames and the year); ``parenthetical``: ``Sabour et al.
    2017``, for use inside parentheses."""
    e = _bib_entries().get(paper_key)
    if e is None or "author" not in e or "year" not in e:
        raise ValueError(f"cite: {paper_key!r} is not an entry of references.bib with an author and a year")
    surnames = [a.split(",")[0].strip() if "," in a else a.strip().split()[-1]
                for a in re.split(r"\s+and\s+", e["author"])]
    surnames = [re.sub(r"[{}]", "", s) for s in surnames]
    who = surnames[0] if len(surnames) == 1 else " and ".join(surnames) if len(surnames) == 2 \
        else f"{surnames[0]} et al."
    return f"{who} {e['year']}" if parenthetical else f"{who} ({e['year']})"


def source(key: str) -> str:
    """Where the number is printed, as a reader cites it: ``Renzulli et al. 2025, Table 9``."""
    e = entry(key)
    return f"{cite(e['paper'], parenthetical=True)}, {e['where']}"


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


def _walk(node, parts: list[str], where: str) -> list:
    if not parts:
        return [node]
    head, rest = parts[0], parts[1:]
    if head == "*":
        items = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if items is None:
            raise KeyError(f"{where}: '*' needs a list or a mapping")
        return [v for item in items for v in _walk(item, rest, where)]
    if not isinstance(node, dict) or head not in node:
        raise KeyError(f"{where}: no {head!r} among {sorted(node) if isinstance(node, dict) else type(node).__name__}")
    return _walk(node[head], rest, where)


def book_reading(key: str, metrics: dict) -> dict | None:
    """This book's measurement of entry ``key`` from a results file's ``metrics``, in the paper's unit:
    ``{"value", "half", "n", "how"}`` (``half``: 95 % half-width, Student-t over ``n`` seeds or
    binomial for one run; None where the run gives none). None when the metric was not recorded."""
    from . import stats

    e = entry(key)
    b = e.get("book")
    if b is None:
        raise KeyError(f"paper entry {key!r} names no book metric")
    raw = metrics.get(b["metric"])
    if raw is None or isinstance(raw, str):
        return None
    scale, flip = {"percent": (100.0, False), "error_percent": (100.0, True), "value": (1.0, False)}[b["as"]]
    convert = (lambda v: scale * (1 - v)) if flip else (lambda v: scale * v)
    if "seeds" in b:
        values = [float(v) for v in _walk(metrics, b["seeds"].split("/"), f"{key}: seeds {b['seeds']!r}")]
        summary = stats.summarise(values)
        if abs(summary.mean - float(raw)) > 1e-6 * max(1.0, abs(float(raw))):
            raise ValueError(f"{key}: the mean over seeds {summary.mean!r} is not the recorded {b['metric']} {raw!r}")
        return {"value": convert(summary.mean), "half": scale * summary.half if summary.n > 1 else None,
                "n": summary.n, "how": f"mean of {summary.n} seeds; ± 95% Student-t interval"}
    if "se" in b and metrics.get(b["se"]) is not None:
        return {"value": convert(float(raw)), "half": scale * 1.96 * float(metrics[b["se"]]), "n": 1,
                "how": "one run; ± 95% binomial interval"}
    if "seed_list" in b and isinstance(metrics.get(b["seed_list"]), list):
        n = len(metrics[b["seed_list"]])
        return {"value": convert(float(raw)), "half": None, "n": n,
                "how": f"mean of {n} seeds (per-seed values not recorded)"}
    return {"value": convert(float(raw)), "half": None, "n": 1, "how": "one run"}
