"""What :func:`capslib.train.fit` and :func:`capslib.data.load` run on; no chapter teaches it.

* :mod:`~capslib.engine.steps`: one training step and fit's fast path (static shapes, fused Adam, CUDA graph);
* :mod:`~capslib.engine.checkpoints`: fit's checkpoints, written atomically and keyed by run fingerprints;
* :mod:`~capslib.engine.distributed`: fit under ``torchrun``, one process per GPU;
* :mod:`~capslib.engine.switches`: the ``CAPSBOOK_*`` environment switches (profile, smoke runs, progress
  bars, ``torch.compile``, device and seed defaults).

A reader calls ``fit`` and ``load``; these modules are their machinery. Like the rest of the library they
import neither :mod:`capslib.book` nor :mod:`capslib.tools`.
"""
