"""Fair timing of alternatives on a shared machine: chapters 4 and 5 compare the cost of training
steps this way (full against detached routing; one, two or three EM iterations)."""
from __future__ import annotations

import time

import torch


def interleaved_seconds(steps: dict, rounds: int = 15, warmup: int = 2, device=None) -> dict:
    """Wall time of each callable in ``steps`` (name -> function of no arguments), measured in
    ``rounds`` rounds after ``warmup`` rounds that are not kept; within a round every callable runs
    once, the order rotating by one from round to round.

    Timing the alternatives against each other this way, rather than in separate runs one after the
    other, keeps the comparison fair on a shared machine: a neighbour that slows it for a while slows
    every member of a round alike, so a ratio taken round by round keeps the difference between the
    callables (chapters 4 and 5 assert such ratios). ``device``: a CUDA device to synchronise
    before and after each call (the time is then the device's, not the launch's).

    Returns name -> list of ``rounds`` seconds, in round order.
    """
    if not steps or not all(callable(f) for f in steps.values()):
        raise ValueError("steps must be a non-empty dict of callables")
    if not (isinstance(rounds, int) and rounds >= 1) or not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"rounds must be an int >= 1 and warmup an int >= 0; got {rounds!r}, {warmup!r}")
    cuda = device is not None and torch.device(device).type == "cuda"
    names = list(steps)
    out = {name: [] for name in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            steps[name]()
            if cuda:
                torch.cuda.synchronize(device)
            if r >= warmup:
                out[name].append(time.perf_counter() - t0)
    return out
