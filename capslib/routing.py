"""Routing-by-agreement (Sabour et al. 2017, Procedure 1; chapter 2).

Couplings ``c`` are ``(B, I, J)``: each input capsule ``i`` distributes one unit
over its parents ``j`` (softmax over ``J``).
"""
from __future__ import annotations

import torch

from .checks import check_positive_int, check_tensor
from .ops import squash


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
            u = u_hat.detach()
            for _ in range(iterations - 1):
                c = torch.softmax(b, dim=2)
                v = squash(torch.einsum("bij,bijd->bjd", c, u))
                b = b + torch.einsum("bijd,bjd->bij", u, v)
            c = torch.softmax(b, dim=2)
        v = squash(torch.einsum("bij,bijd->bjd", c, u_hat))
        return v, c
    for t in range(iterations):
        c = torch.softmax(b, dim=2)
        v = squash(torch.einsum("bij,bijd->bjd", c, u_hat))
        if t < iterations - 1:
            b = b + torch.einsum("bijd,bjd->bij", u_hat, v)
    return v, c


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
        for _ in range(iterations):
            c = torch.softmax(b, dim=2)
            v = squash(torch.einsum("bij,bijd->bjd", c, u_hat))
            b = b + torch.einsum("bijd,bjd->bij", u_hat, v)
            cs.append(c)
            vs.append(v)
    return cs, vs
