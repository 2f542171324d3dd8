"""The spread table (``book/results/ci_spread.json``), read by the chapters: every claim on a trained
number measured over seeds, thread counts and processors (``python -m capslib.tools.spread`` measures
it). A chapter glues a claim's spread into its prose with :func:`glue_claim`."""
from __future__ import annotations

import json
from pathlib import Path

SPREAD_FILE = Path(__file__).resolve().parents[2] / "book" / "results" / "ci_spread.json"


def stats(name: str, path: Path = SPREAD_FILE) -> dict:
    """The spread of one claim (mean, std, min, max, worst, n, seeds, bound, limit) from the table."""
    table = json.loads(path.read_text())
    if name not in table["claims"]:
        raise KeyError(f"claim {name!r} is not in {path.name}; run `make spread` (known: {len(table['claims'])})")
    return table["claims"][name]


def glue_claim(key: str, name: str, path: Path = SPREAD_FILE) -> dict:
    """Glue a claim's spread for the chapter's prose (myst-nb): ``<key>_mean``, ``_sd``, ``_min``,
    ``_max``, ``_limit`` (floats); ``_runs``, ``_seeds``, ``_processors`` (ints: processor types, a run
    without a recorded one counting as one) and ``_distinct`` (how many different values the runs
    gave: runs of one seed that agree exactly count once); ``_processor_types`` (text, "1 processor
    type" or "2 processor types"). Returns the stats, with ``distinct`` added."""
    from myst_nb import glue

    d = dict(stats(name, path))
    d["distinct"] = len({float(f"{v:.12g}") for v in d["values"].values()})
    for field, value in (("mean", d["mean"]), ("sd", d["std"]), ("min", d["min"]), ("max", d["max"]),
                         ("limit", d["limit"])):
        glue(f"{key}_{field}", float(value), display=False)
    glue(f"{key}_runs", int(d["n"]), display=False)
    glue(f"{key}_seeds", int(d["seeds"]), display=False)
    processors = int(d.get("processors", 1))
    glue(f"{key}_processors", processors, display=False)
    glue(f"{key}_processor_types", f"{processors} processor type{'' if processors == 1 else 's'}", display=False)
    glue(f"{key}_distinct", d["distinct"], display=False)
    return d


def by_seed(names: list[str], threads: int = 2, path: Path = SPREAD_FILE) -> dict[int, dict[str, float]]:
    """The values of the claims ``names`` per seed, from the spread's runs at ``threads`` threads: one run per
    seed (each a whole execution of the chapter, its networks trained from that seed), so that quantities
    measured in the same run can be paired seed by seed. A seed measured on several processors takes the run of
    the processor measured last; a seed missing any of ``names`` is left out."""
    table = json.loads(path.read_text())
    for name in names:
        if name not in table["claims"]:
            raise KeyError(f"claim {name!r} is not in {path.name}; run `make spread`")
    measured = table.get("processors", {})
    chosen: dict[int, str] = {}
    for key, run in table["runs"].items():
        if run["threads"] != threads or not all(key in table["claims"][n]["values"] for n in names):
            continue
        seed, last = run["seed"], chosen.get(run["seed"])
        if last is None or measured.get(run.get("cpu") or "", "") > measured.get(table["runs"][last].get("cpu") or "", ""):
            chosen[seed] = key
    return {seed: {n: float(table["claims"][n]["values"][key]) for n in names} for seed, key in sorted(chosen.items())}
