"""Routing-by-agreement (Sabour et al. 2017, Procedure 1; chapter 2).

Couplings ``c`` are ``(B, I, J)``: each input capsule ``i`` distributes one unit
over its parents ``j`` (softmax over ``J``).
"""
from __future__ import annotations

import torch

from .checks import check_positive_int, check_tensor
from .ops import bmm, squash


def dynamic_routing(u_hat: torch.Tensor, iterations: int = 3, detach: bool = False):
    """Dynamic routing of Sabour et al. 2017, Procedure 1 (chapter 2; chapter 4 for ``detach``).

    Starting from logits ``b = 0``, each iteration computes
    ``c_i = softmax_j(b_i)`` (Eq. 3), ``s_j = sum_i c_ij u_hat_{j|i}`` (Eq. 2),
    ``v_j = squash(s_j)`` (Eq. 1), and, except after the last, the agreement
    update ``b_ij += u_hat_{j|i} . v_j``.

    Args:
        u_hat: votes ``(B, I, J, D)``.
        iterations: number of routing iterations ``r >= 1``.
        detach: if True the couplings are constants for back-propagation
            (Gu & Tresp 2020): the logits are computed without a graph and the
            gradient reaches ``u_hat`` only through ``s_j = sum_i c_ij u_hat_{j|i}``.

    Returns:
        ``(v, c)``: output capsules ``(B, J, D)`` and the couplings ``(B, I, J)``
        that produced them (those of the last iteration).
    """
    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")
    check_positive_int("iterations", iterations)
    B, I, J, _ = u_hat.shape
    b = u_hat.new_zeros(B, I, J)
    if detach:
        with torch.no_grad():
            u = by_parent(u_hat.detach())
            for _ in range(iterations - 1):
                c = torch.softmax(b, dim=2)
                v = squash(weighted_sum(c, u))
                b = b + agreement(u, v)
            c = torch.softmax(b, dim=2)
        v = squash(weighted_sum(c, by_parent(u_hat)))
        return v, c
    u = by_parent(u_hat)
    for t in range(iterations):
        c = torch.softmax(b, dim=2)
        v = squash(weighted_sum(c, u))
        if t < iterations - 1:
            b = b + agreement(u, v)
    return v, c


def by_parent(u_hat: torch.Tensor) -> torch.Tensor:
    """Votes ``(B, I, J, D)`` laid out parent-major, ``(B*J, I, D)``: one copy that every
    contraction of a routing pass reads (:func:`weighted_sum`, :func:`agreement`)."""
    B, I, J, D = u_hat.shape
    return u_hat.transpose(1, 2).reshape(B * J, I, D)


def weighted_sum(c: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``s_j = sum_i c_ij u_hat_{j|i}`` (Eq. 2) for couplings ``c (B, I, J)`` and votes ``u`` from
    :func:`by_parent`: ``(B, J, D)``. The same numbers as ``einsum("bij,bijd->bjd", c, u_hat)``,
    gradients included (:func:`capslib.ops.bmm`)."""
    B, I, J = c.shape
    return bmm(c.transpose(1, 2).reshape(B * J, 1, I), u).view(B, J, u.shape[-1])


def agreement(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``u_hat_{j|i} . v_j`` for votes ``u`` from :func:`by_parent` and outputs ``v (B, J, D)``:
    ``(B, I, J)``, the same numbers as ``einsum("bijd,bjd->bij", u_hat, v)``."""
    B, J, D = v.shape
    return bmm(u, v.reshape(B * J, D, 1)).view(B, J, -1).transpose(1, 2)


def routing_trace(u_hat: torch.Tensor, iterations: int = 3):
    """Couplings and outputs after every routing iteration (for figures; chapter 2).

    Returns lists ``cs`` (each ``(B, I, J)``) and ``vs`` (each ``(B, J, D)``) of
    length ``iterations``; ``cs[-1], vs[-1]`` equal :func:`dynamic_routing`'s result.
    Runs without a graph.
    """
    check_tensor("u_hat", u_hat, dims=4, floating=True, shape_doc="(B, I, J, D)")
    check_positive_int("iterations", iterations)
    cs, vs = [], []
    with torch.no_grad():
        b = u_hat.new_zeros(u_hat.shape[:3])
        u = by_parent(u_hat)
        for _ in range(iterations):
            c = torch.softmax(b, dim=2)
            v = squash(weighted_sum(c, u))
            b = b + agreement(u, v)
            cs.append(c)
            vs.append(v)
    return cs, vs
