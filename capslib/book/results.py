"""Headline numbers of each chapter, written to ``book/results/<profile>/<chapter>.json``.

``ci`` results are git-ignored; ``full`` results are committed. Each file holds
the metrics with the device, torch version, commit and wall time that made them, and the digest of
the chapter's code cells it was made with (:func:`code_digest`), so that a page can tell a number of the
chapter as it stands from one made by an older version of it (:func:`code_status`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_DIR = ROOT / "book" / "results"
# ``$CAPSBOOK_RESULTS`` redirects what a run writes and reads first (``make book`` executes copies of
# the notebooks and keeps their results in its build folder, so no tracked file changes).
RESULTS_DIR = Path(os.environ.get("CAPSBOOK_RESULTS", "").strip() or COMMITTED_DIR)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=ROOT, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def code_digest(nb_path: Path) -> str:
    """A digest of a notebook's code cells: the version of the experiments its numbers come from (the
    spread of the claims keys its runs by it too)."""
    import nbformat

    cells = nbformat.read(nb_path, as_version=4).cells
    return _digest_of(cells)


def _digest_of(cells) -> str:
    code = "\n\n".join(c.source for c in cells if c.cell_type == "code")
    return hashlib.sha1(code.encode()).hexdigest()[:12]


def _notebook(chapter: str) -> Path:
    return ROOT / "book" / f"{chapter}.ipynb"


def digest_at_commit(commit: str, nb: Path) -> str | None:
    """:func:`code_digest` of the notebook as committed at ``commit`` (a revision git names); None without git
    or that revision."""
    import nbformat

    if not commit or commit == "unknown":
        return None
    try:
        shown = subprocess.run(["git", "show", f"{commit}:{nb.relative_to(ROOT).as_posix()}"], cwd=ROOT,
                               capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if shown.returncode != 0:
        return None
    return _digest_of(nbformat.reads(shown.stdout, as_version=4).cells)


CODE_STATUS = {   # key -> how a page says which version of its chapter made a run ("run <day> on <machine> ...")
    "current": "by the chapter's code as it stands",
    "older": "by an older version of the chapter",
    "changed since": "at a commit since which the chapter's code has changed",
    "same as at its commit": "at a commit whose code of the chapter is the present one",
    "unknown": "by a version of the chapter not known here",
}


def code_status(payload: dict) -> str:
    """Which version of its chapter made a recorded payload, a key of :data:`CODE_STATUS`: its digest against
    the notebook's code cells as they stand; for a payload recorded before payloads carried a digest, the
    notebook as committed at the payload's commit against them (a run of edits not yet committed reads as
    "changed since" though its code may be the present one)."""
    nb = _notebook(payload["chapter"])
    if not nb.exists():
        return "unknown"
    now = code_digest(nb)
    if "code_digest" in payload:
        return "current" if payload["code_digest"] == now else "older"
    then = digest_at_commit(str(payload.get("commit", "")), nb)
    if then is None:
        return "unknown"
    return "same as at its commit" if then == now else "changed since"


def _plain(value):
    """Tensors and NumPy values to JSON-ready Python values."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple, dict, str)):
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def record(chapter: str, metrics: dict, profile: str | None = None) -> Path:
    """Write ``metrics`` of ``chapter`` for the active profile; returns the file written."""
    from .session import cpu_label, current_session

    if not isinstance(metrics, dict) or not metrics:
        raise ValueError("metrics must be a non-empty dict of name -> value")
    from . import profiles

    sess = current_session()
    profile = profile or profiles.storage_name(sess.profile)
    dev = torch.cuda.get_device_name(sess.device) if sess.device.type == "cuda" else f"cpu ({cpu_label()})"
    payload = {
        "chapter": chapter,
        "profile": profile,
        "device": dev,
        "torch": torch.__version__,
        "commit": _commit(),
        "wall_seconds": round(time.time() - sess.started, 1),
        "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
        "metrics": _plain(metrics),
    }
    if _notebook(chapter).exists():        # the notebook being executed: its code cells as they run
        payload["code_digest"] = code_digest(_notebook(chapter))
    path = RESULTS_DIR / profile / f"{chapter}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def load(chapter: str, profile: str | None = None) -> dict | None:
    """The recorded payload of ``chapter`` at ``profile`` (default: active), or None."""
    from . import profiles

    path = RESULTS_DIR / (profile or profiles.storage_name()) / f"{chapter}.json"
    return json.loads(path.read_text()) if path.exists() else None


def all_results() -> list[dict]:
    """Every recorded payload of the real runs, all profiles (not smoke or spread runs)."""
    from .profiles import PROFILES

    found = {}
    for folder in dict.fromkeys([COMMITTED_DIR, RESULTS_DIR]):  # a redirected run's own files win
        for p in sorted(folder.glob("*/*.json")):
            if p.parent.name in PROFILES:
                found[(p.parent.name, p.name)] = p
    return [json.loads(p.read_text()) for _, p in sorted(found.items())]


def glue(name: str, value, display: bool = False):
    """Glue one measured number (or sentence) for the prose with myst-nb; NumPy and torch scalars are
    turned into Python numbers first (their repr would not format in ``{glue:text}`name:.3f```).
    Returns the plain value."""
    from myst_nb import glue as _glue

    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"glue name must be an identifier (letters, digits, '_'), got {name!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"glue {name!r}: expected a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    elif hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if not isinstance(value, (bool, int, float, str)):
        raise TypeError(f"glue {name!r}: expected a number or a string, got {type(value).__name__}")
    _glue(name, value, display=display)
    return value


def glue_many(prefix: str, values: dict) -> None:
    """``glue(f"{prefix}_{key}", value)`` for every item."""
    for k, v in values.items():
        glue(f"{prefix}_{k}", v)


def paper_vs_book(rows: list[tuple], paper_pm: str | None = None, book_pm: str | None = None):
    """A table of ``(quantity, paper, this book's value[, note])`` rows as a DataFrame.

    ``paper_pm`` / ``book_pm`` say what each column's ± is ("SD over 5 runs", "95 % interval over 3
    seeds"); given, they go into the column's heading, since the two are rarely the same thing.

    Where a paper's number has a paper-scale counterpart (experiment units declared with
    :func:`capslib.book.units.paper_scale`), the table gains a column with it, read from the committed
    results: mean ± SD over the seeds run, or "not yet run"; "—" in the rows no unit measures.

    ``paper`` is a key of ``book/paper_results.yml`` (shown as the paper prints it, with its source),
    ``None`` (not reported), or words without digits ("polarized", "by eye"): numbers from papers
    come only from the sourced table."""
    import pandas as pd

    from . import paper

    out = []
    for r in rows:
        if not 3 <= len(r) <= 4:
            raise ValueError(f"paper_vs_book: rows are (quantity, paper, book[, note]), got {r!r}")
        quantity, ref, book, *note = r
        if ref is None:
            shown = "not reported"
        elif paper.is_key(ref):
            shown = f"{paper.text(ref, pm=True)} ({paper.source(ref)})"
        elif isinstance(ref, str) and not any(ch.isdigit() for ch in ref):
            shown = ref
        else:
            raise ValueError(f"paper_vs_book: {ref!r} for {quantity!r} is neither a key of "
                             f"book/paper_results.yml nor words without numbers; add the paper's number "
                             f"to that table with its source and pass its key")
        out.append((quantity, shown, book, note[0] if note else "", ref))
    for what, label in (("paper_pm", paper_pm), ("book_pm", book_pm)):
        if label is not None and (not isinstance(label, str) or not label.strip()):
            raise ValueError(f"paper_vs_book: {what} says what the ± is, in words; got {label!r}")
    columns = [f"paper (± {paper_pm})" if paper_pm else "paper", f"this book (± {book_pm})" if book_pm else "this book"]
    from .units import paper_scale_cell

    scale = [paper_scale_cell(ref, quantity=row[0]) for *row, ref in out]
    frame = pd.DataFrame([row[:4] for row in out], columns=["quantity", *columns, "note"]).set_index("quantity")
    if any(cell is not None for cell in scale):
        frame.insert(2, "this book at paper scale (± SD over seeds)", [cell or "—" for cell in scale])
    return frame
