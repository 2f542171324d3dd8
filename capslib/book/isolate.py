"""Independent runs of a chapter (one per seed, say) each in a process of its own, at one thread.

A chapter that trains the same small network over several seeds spends most of its time in runs that
share nothing. On a CPU, one small training uses two threads poorly; two processes at one thread each
use two cores well. :func:`map_isolated` runs ``fn(item)`` for every item in a child process forked
from the kernel, at most ``workers`` at a time, each child at one thread, and returns the results in
the items' order. Because every run happens in a fresh fork at one thread, its numbers do not depend on
how many workers there are, nor on what the caller's random generators did before: a run sees the
caller's state as it was when the map began, and leaves it untouched.

What ``fn`` must be: a function of its item alone whose result can be pickled (numbers, dicts, tensors,
small modules); what it changes in the caller's variables is lost with its process. What it prints is
captured and printed by the caller, in the items' order. Where forking is not possible or not safe
(no ``fork`` start method, CUDA already in use, or ``$CAPSBOOK_NO_FORK`` set) the runs happen one after
another in this process, at one thread, with the random generators' states restored around each run:
the same numbers, no parallelism.
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import random
import sys
import traceback
from typing import Callable, Sequence

import numpy as np
import torch


def can_fork() -> bool:
    """Whether runs go to forked processes here (see the module's notes)."""
    no_fork = os.environ.get("CAPSBOOK_NO_FORK", "").strip() not in ("", "0")
    return ("fork" in mp.get_all_start_methods() and not no_fork
            and not (torch.cuda.is_available() and torch.cuda.is_initialized()))


def default_workers() -> int:
    """As many workers as this session has threads (``$CAPSBOOK_THREADS`` or torch's count)."""
    return max(1, torch.get_num_threads())


@contextlib.contextmanager
def _one_thread_and_same_generators():
    threads = torch.get_num_threads()
    states = (torch.random.get_rng_state(), np.random.get_state(), random.getstate())
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


def _captured(fn, item):
    """``fn(item)`` with stdout and stderr captured: ``(result, text)``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        result = fn(item)
    return result, out.getvalue()


def _child(fn, item, conn) -> None:
    torch.set_num_threads(1)
    try:
        result, text = _captured(fn, item)
        payload = pickle.dumps(("ok", result, text))
    except BaseException as err:      # everything goes back to the caller, KeyboardInterrupt included
        payload = pickle.dumps(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
    conn.send_bytes(payload)
    conn.close()


def map_isolated(fn: Callable, items: Sequence, workers: int | None = None) -> list:
    """``[fn(item) for item in items]``, each call in a forked process at one thread, at most ``workers``
    (default :func:`default_workers`) at a time; results in the items' order. A run that raises makes
    this raise :class:`RuntimeError` naming the item, with the run's traceback; a process that dies
    without an answer (killed, out of memory) does the same with its exit code."""
    items = list(items)
    if workers is None:
        workers = default_workers()
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"workers must be an int >= 1; got {workers!r}")
    if not can_fork():
        results = []
        for item in items:
            with _one_thread_and_same_generators():
                result, text = _captured(fn, item)
            sys.stdout.write(text)
            results.append(result)
        return results
    ctx = mp.get_context("fork")
    answers: dict[int, tuple] = {}
    running: dict = {}                     # reading end -> (index, process)
    pending = list(enumerate(items))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        while pending or running:
            while pending and len(running) < workers:
                k, item = pending.pop(0)
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child, args=(fn, item, writer), daemon=True)
                proc.start()
                writer.close()
                running[reader] = (k, proc)
            for reader in multiprocessing.connection.wait(list(running)):
                k, proc = running.pop(reader)
                try:
                    answers[k] = pickle.loads(reader.recv_bytes())
                except EOFError:
                    proc.join()
                    answers[k] = ("died", f"its process ended with exit code {proc.exitcode} and no answer", "")
                reader.close()
                proc.join()
    finally:
        for reader, (_, proc) in running.items():
            proc.terminate()
            proc.join()
            reader.close()
    results = []
    for k, item in enumerate(items):
        kind, value, text = answers[k]
        if kind != "ok":
            raise RuntimeError(f"map_isolated: the run for item {item!r} failed: {value}\n{text}")
        sys.stdout.write(text)
        results.append(value)
    return results
