"""Data-parallel training for :func:`capslib.train.fit` under ``torchrun`` (one process per GPU).

:func:`distributed_ranks` says whether ``fit`` runs data-parallel; :func:`init_distributed` joins the
process group ``torchrun`` describes. The other helpers are the collectives ``fit`` calls: the same
starting weights on every rank, gradients summed over ranks, an epoch's sums added up.
"""
from __future__ import annotations

import os

import torch
from torch import nn


def distributed_ranks() -> tuple[int, int] | None:
    """``(rank, world size)`` when :func:`fit` runs data-parallel: a ``torch.distributed`` process group
    of more than one process is initialised (``torchrun`` sets it up; :func:`init_distributed`). None
    otherwise.

    Under it every rank holds the whole training set and draws the same seeded permutation; each global
    batch (``batch_size`` images, augmented as one batch) is split by striding, rank ``r`` taking images
    ``r, r + W, ...``; each rank's batch-mean loss is weighted by its share of the batch and the
    gradients are summed over the ranks, so every rank takes the step one process would take on the
    global batch (up to the order of floating-point sums). Losses, accuracies and image counts are
    summed over ranks; rank 0 alone prints and writes checkpoints. Every rank must run the same code
    path (the same parameters receive gradients on each), and ``$CAPSBOOK_TIME_LIMIT`` is not applied.
    Dropout and other random draws inside a step use a stream of each rank's own."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def init_distributed() -> torch.device:
    """Join the process group ``torchrun`` describes (``$WORLD_SIZE`` > 1; NCCL on CUDA, gloo on the
    CPU) and return this rank's device; without ``torchrun``, the default device and no group."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    cuda = torch.cuda.is_available()
    dev = torch.device("cpu")
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dev


def broadcast_parameters(model: nn.Module) -> None:
    import torch.distributed as dist

    for t in [*model.parameters(), *model.buffers()]:
        dist.broadcast(t.data, src=0)


def sum_gradients(model: nn.Module) -> None:
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def sum_over_ranks(total, correct, nonfinite, seen: int):
    import torch.distributed as dist

    t = torch.stack([total.double(), correct.double(), nonfinite.double(),
                     torch.tensor(float(seen), dtype=torch.float64, device=total.device)])
    dist.all_reduce(t)
    return t[0], t[1].long(), t[2].long(), int(t[3])
