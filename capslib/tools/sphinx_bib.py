"""A Sphinx extension for the book's bibliography: entries labelled author-year.

In-text citations are author-year already (``bibtex_reference_style: author_year``); a reader who
follows one lands on the bibliography, whose entries sphinxcontrib-bibtex labels ``[SFH17]`` by
default. This registers the pybtex style ``capsbook``: the ``unsrt`` formatting with labels such
as ``Sabour et al. 2017``, ``Gu and Tresp 2020`` or ``Hauser 2019`` (a letter appended where two
entries would share one). ``_config.yml`` names it in ``bibtex_default_style``.
"""
from __future__ import annotations

from collections import Counter


def _surname(person) -> str:
    parts = person.prelast_names + person.last_names
    return " ".join(str(p) for p in parts).replace("{", "").replace("}", "")


def author_year(entry) -> str:
    """``Surname year``, ``A and B year`` or ``A et al. year`` from a pybtex entry."""
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    year = entry.fields.get("year", "n.d.")
    if not people:
        return f"{entry.fields.get('title', entry.key)[:30]} {year}"
    names = [_surname(p) for p in people]
    who = names[0] if len(names) == 1 else f"{names[0]} and {names[1]}" if len(names) == 2 else f"{names[0]} et al."
    return f"{who} {year}"


def _styles():
    from pybtex.style.formatting.unsrt import Style as Unsrt
    from pybtex.style.labels import BaseLabelStyle

    class AuthorYearLabels(BaseLabelStyle):
        def format_labels(self, sorted_entries):
            labels = [author_year(e) for e in sorted_entries]
            count, seen = Counter(labels), Counter()
            for label in labels:
                if count[label] == 1:
                    yield label
                else:
                    yield label + "abcdefghijklmnopqrstuvwxyz"[seen[label]]
                    seen[label] += 1

    class CapsbookStyle(Unsrt):
        default_label_style = AuthorYearLabels

    return AuthorYearLabels, CapsbookStyle


def register() -> None:
    from pybtex.plugin import find_plugin, register_plugin

    try:
        find_plugin("pybtex.style.formatting", "capsbook")
        return
    except Exception:  # noqa: BLE001 - not registered yet
        pass
    labels, style = _styles()
    register_plugin("pybtex.style.labels", "capsbook", labels)
    register_plugin("pybtex.style.formatting", "capsbook", style)


def setup(app):
    register()
    return {"parallel_read_safe": True, "parallel_write_safe": True}
