"""The book's machinery: what the chapters need to run, record and show their experiments, but a
reader of ``capslib`` would not reuse. It imports the library (``capslib``); the library never
imports it.

- :mod:`capslib.book.units`: experiment units (one complete training each), their committed results
  and the fingerprints that tell a current result from a stale one;
- ``capslib.book.chNN``: a chapter's units.
"""
