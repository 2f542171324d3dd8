"""The box under each chapter's "What you will learn": where the page's numbers come from.

A reader meets a chapter's numbers long before its paper-scale section, and most of them come from
trainings sized for a laptop's CPU. :func:`scale_note` says so in one or two sentences, with how many
of the chapter's paper-scale runs (:mod:`capslib.book.units`) exist; :func:`glue_scale` glues it as
``page_scale`` for the box in the chapter's opening markdown.

The cell that calls it is tagged ``paper-scale``, so ``make paper-scale`` refreshes the count when
new results arrive; in that mode (``CAPSBOOK_PAPER_SCALE_ONLY=1``, set by
:func:`capslib.tools.reproduce.render_paper_scale`) the rest of the page keeps its committed ``ci``
outputs, and the note describes those.
"""
from __future__ import annotations

import os

from . import profiles, results

PAPER_SCALE_SECTION = "The chapter at paper scale"
GLUE_NAME = "page_scale"


def page_profile() -> str:
    """The profile the page's ordinary cells ran at: ``ci`` when only the paper-scale cells are
    being executed again (the committed outputs are ``ci``), else the current profile."""
    if os.environ.get("CAPSBOOK_PAPER_SCALE_ONLY", "").strip() not in ("", "0"):
        return "ci"
    return profiles.current()


def _made(chapter: str) -> tuple[int, int, set]:
    """How many of the chapter's units are done, how many it plans, and the kinds of processor the
    done ones ran on (``"GPU"``, ``"CPU"``)."""
    from . import units
    declared = units.all_units(chapter)
    done = [res for st, res in (units.state(u) for u in declared) if st == "done"]
    kinds = {"CPU" if str(res.get("device", "")).startswith("cpu") else "GPU" for res in done}
    return len(done), len(declared), kinds


def scale_note(chapter: str, profile: str | None = None) -> str:
    """Where the numbers of chapter ``chapter`` ("01".."07") come from, as plain sentences."""
    from .. import datasets
    from . import units

    if chapter not in ("01", *units.CHAPTERS):
        raise ValueError(f"chapter must be one of 01, {', '.join(units.CHAPTERS)}; got {chapter!r}")
    if chapter == "01":
        return ("This page trains no network; everything on it runs in seconds on a CPU. "
                "The chapters that train capsule networks say in this place where their numbers come from.")
    profile = profile or page_profile()
    if profile == "ci":
        digits = 10 * datasets.EMBEDDED_SPLIT[0]
        page = (f"The networks trained on this page are small runs on a CPU, at most {digits:,} training "
                f"digits from a subset of MNIST that ships with the book, sized so that "
                f"the whole page executes in a few minutes on a laptop. They show how each mechanism behaves; they "
                f"are not meant to reach the papers' accuracies; where the text says \u201cci\u201d, it means these runs.")
    else:
        page = ("The networks trained on this page ran at the book's larger profile, on MNIST's training digits "
                "less a validation set, with fewer epochs and seeds than the papers used.")
    done, total, kinds = _made(chapter)
    section = f"the section \u201c{PAPER_SCALE_SECTION}\u201d"
    if done == 0:
        runs = f"none of them has been made yet, and {section} will show their results"
    else:
        made = f"all {total} have" if done == total else f"{done} of the {total} {'has' if done == 1 else 'have'}"
        where = " on a " + kinds.pop() if len(kinds) == 1 else " on GPUs and CPUs"
        runs = f"{made} been made{where}, and {section} shows what {'it' if done == 1 else 'they'} found"
    return (f"{page} The paper-scale trainings are longer runs on MNIST's training digits less a validation set, whose "
            f"results are stored with the book: the book plans {total} for this chapter; {runs}.")


def glue_scale(chapter: str) -> str:
    """Glue :func:`scale_note` as ``page_scale`` and return it."""
    text = scale_note(chapter)
    results.glue(GLUE_NAME, text)
    return text
